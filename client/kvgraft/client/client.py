"""`kvgraft.Client`: typed calls to a kvgraftd daemon.

One class over one connection (kvgraft.client.connection.Connection: the
channel, the deadlines, gRPC errors mapped to kvgraft.errors), whose calls are
grouped by what they serve: the store and its remote tier
(kvgraft.client.store_calls), the engine (engine_calls), the knowledge library
(library_calls) and replication (replication_calls). Use it as a context
manager to close the channel.
"""

from __future__ import annotations

from kvgraft.client.connection import DEFAULT_SERVER, default_server
from kvgraft.client.engine_calls import EngineCalls
from kvgraft.client.library_calls import LibraryCalls
from kvgraft.client.replication_calls import ReplicationCalls
from kvgraft.client.store_calls import StoreCalls

__all__ = ["DEFAULT_SERVER", "Client", "default_server"]


class Client(StoreCalls, EngineCalls, LibraryCalls, ReplicationCalls):
    """A connection to one kvgraftd, and every call it answers."""
