"""The replication calls of `kvgraft.Client`: the change feed, raw page streams, replicate
and pull.

These calls make a Client a kvgraft.replication.endpoint.Endpoint. Replication
itself is kvgraft.replication (through this process: `replicate_to`,
`replicate_from`) or the daemon's Replicate (`pull_from`: straight from the
source to the daemon called). Streams are kvgraft.stream.Stream: `cancel()`
ends them early.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvgraft.client.connection import Connection
from kvgraft.errors import Unavailable
from kvgraft.replication.endpoint import Endpoint
from kvgraft.replication.session import replicate
from kvgraft.replication.summary import ReplicationSummary
from kvgraft.stream import Stream
from kvgraft.v1 import kvgraft_pb2 as pb


class ReplicationCalls(Connection):
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

    def replicate_to(
        self, target: Endpoint | str, *, client_options: dict | None = None, **options
    ) -> ReplicationSummary:
        """Make `target` hold this daemon's artifacts, deletes too (kvgraft.replication.session).

        `target` is a Client or an address, opened with `client_options` (TLS, token)."""
        return replicate(self, target, connect=self._connector(client_options), **options)

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
