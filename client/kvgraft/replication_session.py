"""A replication session: a Replicator between two daemons given as clients or addresses.

`replicate(source, target)` opens what it was given as addresses (and closes them
at the end), refuses a source that is its target (the same daemon's instance_id
in Info, whatever the addresses), then runs one pass or follows. It backs
`Client.replicate_to` / `replicate_from`; the CLI checks the pair with
`refuse_same_daemon` before its own Replicator.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvgraft.client import Client
from kvgraft.errors import FailedPrecondition
from kvgraft.replication import Replicator
from kvgraft.replication_summary import ReplicationSummary
from kvgraft.replication_target import ClientTarget


def refuse_same_daemon(source: Client, target: Client) -> None:
    """FailedPrecondition when both clients reach one daemon (the same instance_id)."""
    instance = source.info().instance_id
    if instance and instance == target.info().instance_id:
        raise FailedPrecondition(
            f"the source {source.address} and the target {target.address} are the same "
            "daemon: replicate between two daemons"
        )


def replicate(
    source: Client | str,
    target: Client | str,
    *,
    follow: bool = False,
    from_sequence: int = 1,
    stop: threading.Event | None = None,
    on_position: Callable[[int], None] | None = None,
    client_options: dict | None = None,
    **replicator_options,
) -> ReplicationSummary:
    """Make `target` hold what `source` holds (see the module docstring).

    Either may be a Client (TLS and tokens as the caller set them up) or an
    address, opened with `client_options` and closed at the end. One pass by
    default (the feed from `from_sequence`); with `follow`, catch up, then keep
    applying changes until `stop` is set. Options of Replicator: workers,
    max_attempts, progress, on_change.
    """
    opened: list[Client] = []

    def client_for(endpoint: Client | str) -> Client:
        if isinstance(endpoint, Client):
            return endpoint
        opened.append(Client(endpoint, **(client_options or {})))
        return opened[-1]

    try:
        source_client, target_client = client_for(source), client_for(target)
        refuse_same_daemon(source_client, target_client)
        replicator = Replicator(source_client, ClientTarget(target_client), **replicator_options)
        replicator.summary.target = target_client.address
        if follow:
            return replicator.follow(
                from_sequence, stop=stop or threading.Event(), on_position=on_position
            )
        return replicator.sync(from_sequence)
    finally:
        for client in opened:
            client.close()
