"""`kvgraft.Client`: typed calls to a kvgraftd daemon.

One class over one connection (kvgraft.client.connection.Connection: the
channel, the deadlines, gRPC errors mapped to kvgraft.errors), whose calls are
grouped by what they serve: the store and its remote tier
(kvgraft.client.store_calls), the engine (engine_calls), the knowledge library
(library_calls) and replication (replication_calls). Each group is written
against what it needs of a connection, declared once (the Protocol
kvgraft.client.connection.Connected); the Client joins the groups with the
Connection that implements it. Use it as a context manager to close the channel.
"""

from __future__ import annotations

from kvgraft.client.connection import DEFAULT_SERVER, Connection, default_server
from kvgraft.client.engine_calls import EngineCalls
from kvgraft.client.library_calls import LibraryCalls
from kvgraft.client.replication_calls import ReplicationCalls
from kvgraft.client.store_calls import StoreCalls

__all__ = ["DEFAULT_SERVER", "Client", "default_server"]


class Client(StoreCalls, EngineCalls, LibraryCalls, ReplicationCalls, Connection):
    """A connection to one kvgraftd, and every call it answers.

        with Client("kv1.example:50551", tls_ca="ca.pem") as client:
            print(client.generate("Hello", max_new_tokens=8).text)

    Arguments (all but `address` by keyword; None or absent: the default):

    address
        "host:port" of the daemon; a host alone ("localhost", "[::1]") gets the
        daemon's port, 50551. Default: $KVGRAFT_SERVER, else 127.0.0.1:50551.
    timeout_s
        deadline in seconds of the store's small calls (info, list_artifacts, stat,
        pin, delete, ...); default 30.
    compute_timeout_s
        deadline of the calls that compute (deposit, generate, graft, verify, lookup,
        ask, library_add); default 3600, the daemon's own `max_call_s`.
    transfer_timeout_s
        deadline of whole transfers (put_artifact, get_artifact, bundles, replication)
        and long-running streams (scrub, pull_from, remote_sync); default 3600.
        Only `watch(follow=True)` runs without a deadline, until cancelled.
    token, token_file
        the bearer token every call carries, or a file holding it
        ($KVGRAFT_TOKEN_FILE); never logged nor shown.
    tls
        True: TLS, trusting the system's CA certificates ($KVGRAFT_TLS=1). Any
        other TLS argument turns TLS on too.
    tls_ca
        PEM file of the CA that signed the daemon's certificate ($KVGRAFT_TLS_CA).
    tls_cert, tls_key
        PEM client certificate and its private key, for a daemon that requires one
        (mutual TLS; $KVGRAFT_TLS_CERT, $KVGRAFT_TLS_KEY).
    tls_server_name
        the name to check the daemon's certificate against, when it is not the host
        of `address` ($KVGRAFT_TLS_SERVER_NAME).
    keepalive_s, keepalive_timeout_s
        a ping every `keepalive_s` (default 20) while calls are open; a connection
        whose ping goes unanswered `keepalive_timeout_s` (default 10) is dropped, so
        a silent network fails the call instead of holding it to its deadline.

    Failures raise the classes of kvgraft.errors (NotFound, InvalidArgument,
    Unavailable, DeadlineExceeded, ...), never grpc.RpcError; a bad option value
    given to a method raises TypeError or ValueError, as Python does.
    """
