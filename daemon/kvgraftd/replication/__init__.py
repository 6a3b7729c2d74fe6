"""The daemon's side of replication: following peers (follower) and the Replicate RPC
(pulls), both through kvgraft.replication into the local store.

May import kvgraftd.store and kvgraft.
"""
