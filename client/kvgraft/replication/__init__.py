"""Replication between daemons: the Replicator (feed, page relay, guarded streams) over any
two endpoints that answer the store RPCs (kvgraft.replication.endpoint), and a session
between two daemons.

May import the core modules of kvgraft; never kvgraft.client (a Client is an endpoint).
"""

from kvgraft.replication.replicator import Replicator

__all__ = ["Replicator"]
