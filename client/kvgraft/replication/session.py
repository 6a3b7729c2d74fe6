"""A replication session: a Replicator between two daemons given as endpoints or addresses.

`replicate(source, target, connect=...)` opens what it was given as addresses
with `connect` (kvgraft.Client passes its own class; they are closed at the
end), refuses a source that is its target (the same daemon's instance_id
in Info, whatever the addresses), then runs one pass or follows. It backs
`Client.replicate_to` / `replicate_from`; the CLI checks the pair with
`refuse_same_daemon` before its own Replicator.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvgraft.errors import FailedPrecondition
from kvgraft.replication.endpoint import Endpoint
from kvgraft.replication.replicator import Replicator
from kvgraft.replication.summary import ReplicationSummary
from kvgraft.replication.target import ClientTarget


def refuse_same_daemon(source: Endpoint, target: Endpoint) -> None:
    """FailedPrecondition when both endpoints reach one daemon (the same instance_id)."""
    instance = source.info().instance_id
    if instance and instance == target.info().instance_id:
        raise FailedPrecondition(
            f"the source {source.address} and the target {target.address} are the same "
            "daemon: replicate between two daemons"
        )


def replicate(
    source: Endpoint | str,
    target: Endpoint | str,
    *,
    connect: Callable[[str], Endpoint],
    follow: bool = False,
    from_sequence: int = 1,
    stop: threading.Event | None = None,
    on_position: Callable[[int], None] | None = None,
    **replicator_options,
) -> ReplicationSummary:
    """Make `target` hold what `source` holds (see the module docstring).

    Either may be an endpoint such as a kvgraft.Client (TLS and tokens as the
    caller set them up) or an address, opened with `connect` and closed at the end. One pass by
    default (the feed from `from_sequence`); with `follow`, catch up, then keep
    applying changes until `stop` is set. Options of Replicator: workers,
    max_attempts, progress, on_change.
    """
    opened: list[Endpoint] = []

    def client_for(endpoint: Endpoint | str) -> Endpoint:
        if not isinstance(endpoint, str):
            return endpoint
        opened.append(connect(endpoint))
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
