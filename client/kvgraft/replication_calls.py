"""The replication calls of `kvgraft.Client`: the change feed, raw page streams, replicate
and pull; and `Stream`, a server stream that can be cancelled.

A mixin of kvgraft.client.Client, which supplies the channel (`_stub`, `_get`,
`_put`), the deadlines (`timeout_s`, `transfer_timeout_s`) and the one place
where gRPC errors become kvgraft.errors (`_mapped`, `_stream`). Replication
itself is kvgraft.replication (through this process) or the daemon's
Replicate (`pull_from`: straight from the source to the daemon called).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, TypeVar

from kvgraft.errors import Unavailable
from kvgraft.replication_summary import ReplicationSummary
from kvgraft.v1 import kvgraft_pb2 as pb

if TYPE_CHECKING:
    from kvgraft.client import Client

T = TypeVar("T")


class ReplicationCalls:
    def watch(self, from_sequence: int = 1, *, follow: bool = False) -> Stream[pb.ChangeRecord]:
        """The change feed from `from_sequence`; with `follow` it waits for new records
        until `cancel()` is called on the returned iterator."""
        request = pb.WatchRequest(from_sequence=from_sequence, follow=follow)
        timeout = None if follow else self.timeout_s
        call = self._open(self._stub.Watch, request, timeout)
        return Stream(self._stream(call), call.cancel)

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
        call = self._open(self._get, request, self.transfer_timeout_s)
        return Stream(self._stream(call), call.cancel)

    def put_artifact_messages(self, messages: Iterable[bytes]) -> pb.PutArtifactResponse:
        """PutArtifact from encoded PutArtifactRequest messages: pages, then the manifest."""
        with self._mapped():
            return self._put(iter(messages), timeout=self.transfer_timeout_s)

    def replicate_to(self, target: Client | str, **options) -> ReplicationSummary:
        """Make `target` hold this daemon's artifacts, deletes too (kvgraft.replication_session)."""
        from kvgraft.replication_session import replicate

        return replicate(self, target, **options)

    def replicate_from(self, source: Client | str, **options) -> ReplicationSummary:
        """Make this daemon hold `source`'s artifacts, deletes too (kvgraft.replication_session)."""
        from kvgraft.replication_session import replicate

        return replicate(source, self, **options)

    def pull_from(
        self, source: str, *, from_sequence: int = 1, progress=None
    ) -> ReplicationSummary:
        """Make this daemon copy `source`'s artifacts, deletes too, straight from `source`
        (the Replicate RPC: the bytes do not pass through this process). `source` is the
        address as this daemon reaches it; `progress` has tqdm's `total` and `update(n)`.
        Returns the ReplicationSummary."""
        request = pb.ReplicateRequest(source=source, from_sequence=from_sequence)
        last, done = None, 0
        for last in self._stream(self._open(self._stub.Replicate, request, None)):
            if progress is not None:
                progress.total = last.bytes_planned
                progress.update(last.bytes_done - done)
            done = last.bytes_done
        if last is None or not last.done:
            raise Unavailable(f"the Replicate stream of {self.address} ended before its summary")
        summary = ReplicationSummary.from_proto(last.summary)
        summary.target = self.address
        return summary


class Stream(Iterator[T]):
    """The messages of a server stream, and `cancel()` to end it early (from any thread)."""

    def __init__(self, messages: Iterator[T], cancel: Callable[[], object]) -> None:
        self._messages = messages
        self._cancel = cancel

    def __next__(self) -> T:
        return next(self._messages)

    def cancel(self) -> None:
        self._cancel()  # a no-op once the call has ended

    def close(self) -> None:
        """Cancel the call and close the iterator (as for a generator)."""
        self._cancel()
        close = getattr(self._messages, "close", None)
        if close is not None:
            close()
