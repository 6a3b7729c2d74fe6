"""The client of a kvgraftd daemon: `Client` (kvgraft.client.client), its connection and the
calls grouped by what they serve (store, engine, library and remote, replication).

May import kvgraft.replication and the core modules of kvgraft.
"""

from kvgraft.client.client import Client

__all__ = ["Client"]
