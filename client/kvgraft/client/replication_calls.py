"""The replication calls of `kvgraft.Client`: the change feed, raw page streams, replicate
and pull.

These calls make a Client a kvgraft.replication.endpoint.Endpoint. Replication
itself is kvgraft.replication (relayed through this process: `replicate_from`,
and `replicate_to` when the target will not pull) or the daemon's Replicate
(`pull_from`: straight from the source to the daemon called; `replicate_to`
asks the target for it first, as it is faster and spares this machine the
bytes). Streams are kvgraft.stream.Stream: `cancel()` ends them early.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable

from kvgraft.client.connection import STORE, TRANSFER, Connected
from kvgraft.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvgraftError,
    Unavailable,
    Unimplemented,
)
from kvgraft.replication.endpoint import Endpoint
from kvgraft.replication.session import refuse_same_daemon, replicate
from kvgraft.replication.summary import ReplicationSummary
from kvgraft.stream import Stream
from kvgraft.v1 import kvgraft_pb2 as pb

log = logging.getLogger(__name__)

# The options of kvgraft.replication.session.replicate that a pull serves too;
# any other one given (follow, stop, on_position, workers, max_attempts,
# on_change) only a relay does.
PULL_OPTIONS = frozenset({"from_sequence", "progress"})


class ReplicationCalls(Connected):
    def watch(self, from_sequence: int = 1, *, follow: bool = False) -> Stream[pb.ChangeRecord]:
        """The change feed from `from_sequence`; with `follow` it waits for new records
        until `cancel()` is called on the returned iterator."""
        request = pb.WatchRequest(from_sequence=from_sequence, follow=follow)
        kind = None if follow else STORE  # a follow runs until cancelled
        call = self._open(self._stub.Watch, request, kind)
        return Stream(self._stream(call, kind), call.cancel)

    def get_artifact_messages(
        self, artifact_id: str, *, manifest_only: bool = False, only_pages: Iterable[bytes] = ()
    ) -> Stream[bytes]:
        """GetArtifact as raw GetArtifactResponse messages, for kvgraft.wire to parse.

        Replication forwards pages without assembling artifacts. The caller
        checks the pages (get_artifact does it for you) and may `cancel()`.
        """
        request = pb.GetArtifactRequest(
            artifact_id=artifact_id, manifest_only=manifest_only, only_pages=list(only_pages)
        )
        call = self._open(self._get, request, TRANSFER)
        return Stream(self._stream(call, TRANSFER), call.cancel)

    def put_artifact_messages(self, messages: Iterable[bytes]) -> pb.PutArtifactResponse:
        """PutArtifact from encoded PutArtifactRequest messages: pages, then the manifest."""
        with self._mapped(TRANSFER):
            return self._put(iter(messages), timeout=self.transfer_timeout_s)

    def replicate_to(
        self,
        target: Endpoint | str,
        *,
        pull: bool | None = None,
        source_address: str | None = None,
        client_options: dict | None = None,
        **options,
    ) -> ReplicationSummary:
        """Make `target` hold this daemon's artifacts, deletes too.

        `target` is a Client or an address, opened with `client_options` (TLS, token).
        Options are kvgraft.replication.session.replicate's (from_sequence, progress,
        follow, stop, on_position, workers, max_attempts, on_change).

        With `pull` None (the default) the target is asked to copy straight from
        this daemon first (`target.pull_from`, the Replicate RPC: faster, and the
        bytes skip this process); a target that does not allow it (FAILED_PRECONDITION
        naming `[replication] pull_from`), predates it (UNIMPLEMENTED) or cannot reach
        this daemon (UNAVAILABLE) is relayed to instead: this process reads here and
        writes there. Any other error of the
        pull is raised. Only a one-shot pass with no options but from_sequence and
        progress can be pulled: others are relayed at once, as is a target given as
        an endpoint without `pull_from`, and one that reaches this daemon as
        loopback while the target is not (its address names another machine).
        `pull=True` pulls or raises; `pull=False` always relays. `source_address`
        is this daemon's address as the target reaches it (default `self.address`).
        The summary's `mode` says which way it went: "pull" or "relay".
        """
        connect = self._connector(client_options)
        if pull is False:
            return replicate(self, target, connect=connect, **options)
        relay_only = sorted(
            k
            for k, v in options.items()
            if k not in PULL_OPTIONS and v is not None and v is not False  # follow=False: none
        )
        if relay_only:
            if pull:
                raise InvalidArgument(
                    f"a pull copies once and takes only {', '.join(sorted(PULL_OPTIONS))}; "
                    f"{', '.join(relay_only)} need a relay: give pull=None or pull=False"
                )
            return replicate(self, target, connect=connect, **options)
        source = source_address or self.address
        opened = isinstance(target, str)
        target_client = connect(target) if opened else target
        try:
            if not hasattr(target_client, "pull_from"):
                if pull:
                    raise InvalidArgument(
                        f"the target {target_client.address} is an endpoint without pull_from: "
                        "give a kvgraft.Client or an address to pull"
                    )
                return replicate(self, target_client, connect=connect, **options)
            unreachable = _loopback(source) and not _loopback(target_client.address)
            if pull is None and source_address is None and unreachable:
                return replicate(self, target_client, connect=connect, **options)
            refuse_same_daemon(self, target_client)
            pull_options = {k: v for k, v in options.items() if k in PULL_OPTIONS}
            try:
                return target_client.pull_from(source, **pull_options)
            except (FailedPrecondition, Unimplemented, Unavailable) as exc:
                # refused, too old, or it cannot reach this daemon: the relay can (copies
                # are idempotent, so what a cut pull moved is not moved again)
                if pull or not (isinstance(exc, Unavailable) or _pull_refused(exc)):
                    raise
                log.info(
                    "%s does not pull from %s (%s: %s): relaying through this process",
                    target_client.address,
                    source,
                    exc.code,
                    exc,
                )
            return replicate(self, target_client, connect=connect, **options)
        finally:
            if opened:
                target_client.close()

    def replicate_from(
        self, source: Endpoint | str, *, client_options: dict | None = None, **options
    ) -> ReplicationSummary:
        """Make this daemon hold `source`'s artifacts, deletes too (kvgraft.replication.session).

        `source` is a Client or an address, opened with `client_options` (TLS, token)."""
        return replicate(source, self, connect=self._connector(client_options), **options)

    def _connector(self, client_options: dict | None):
        """How a session opens an address: a client of this one's class."""
        return lambda address: type(self)(address, **(client_options or {}))

    def pull_from(
        self, source: str, *, from_sequence: int = 1, progress=None
    ) -> ReplicationSummary:
        """Make this daemon copy `source`'s artifacts, deletes too, straight from `source`
        (the Replicate RPC: the bytes do not pass through this process). `source` is the
        address as this daemon reaches it; `progress` has tqdm's `total` and `update(n)`.
        Returns the ReplicationSummary (`mode` "pull"). A daemon whose
        `[replication] pull_from` does not name `source` refuses with
        FailedPrecondition."""
        request = pb.ReplicateRequest(source=source, from_sequence=from_sequence)
        last = self._progress_stream(
            self._stub.Replicate, request, progress, lambda last: last.bytes_planned
        )
        summary = ReplicationSummary.from_proto(last.summary)
        summary.target = self.address
        summary.mode = "pull"
        return summary


def _pull_refused(error: KvgraftError) -> bool:
    """A target's no to a pull, before it copied anything: the source is not in its
    `[replication] pull_from` (kvgraftd.replication.pulls: FAILED_PRECONDITION naming the
    setting), or it is a daemon without the Replicate RPC (UNIMPLEMENTED)."""
    if isinstance(error, Unimplemented):
        return True
    return isinstance(error, FailedPrecondition) and "pull_from" in str(error)


def _loopback(address: str) -> bool:
    """Whether host:port names this machine only (localhost, 127.0.0.0/8, ::1)."""
    host = address.rpartition(":")[0].strip("[]") or address
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
