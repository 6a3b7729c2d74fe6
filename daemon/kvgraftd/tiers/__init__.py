"""The memory tiers between the store and the compute: the device pool, the host cache,
the live buffers of growing contexts, and `Tiers`, the set an engine's contexts share.

May import kvgraftd.store.
"""
