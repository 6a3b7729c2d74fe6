"""`Endpoint`: a daemon as replication uses it, over the store and replication RPCs.

kvgraft.Client is one; the replication package names only this protocol, so it
never imports the client (whose `replicate_to` and `replicate_from` are built
on it). A source is read through `list_artifacts`, `watch`, `stats`, `stat`
and `get_artifact_messages`; a target (kvgraft.replication.target.ClientTarget)
is read through `list_artifacts` and `watch` (what it holds, what its pins expired)
and written through `missing_pages`, `put_artifact_messages` and `delete`;
`info` tells two daemons apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

from kvgraft.stream import Stream
from kvgraft.v1 import kvgraft_pb2 as pb


class Endpoint(Protocol):
    address: str

    def info(self) -> pb.InfoResponse: ...
    def stats(self) -> pb.StatsResponse: ...
    def list_artifacts(self) -> Iterator[pb.ArtifactInfo]: ...
    def stat(self, artifact_id: str) -> pb.StatResponse: ...
    def delete(self, artifact_id: str) -> pb.DeleteResponse: ...
    def missing_pages(self, digests: Iterable[bytes]) -> list[bytes]: ...
    def watch(self, from_sequence: int = 1, *, follow: bool = False) -> Stream[pb.ChangeRecord]: ...
    def get_artifact_messages(
        self, artifact_id: str, *, manifest_only: bool = False, only_pages: Iterable[bytes] = ()
    ) -> Stream[bytes]: ...
    def put_artifact_messages(self, messages: Iterable[bytes]) -> pb.PutArtifactResponse: ...
    def close(self) -> None: ...
