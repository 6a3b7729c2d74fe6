"""Where replication copies to: the `Target` protocol, and `ClientTarget` (a daemon over gRPC).

kvgraftd's follow mode has its own target, its local store
(kvgraftd.replication.follower.LocalTarget). Deletes answer "deleted", "absent" (nothing
to delete) or "pinned" (kept: a pinned artifact cannot be deleted).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from kvgraft import wire
from kvgraft.errors import FailedPrecondition, NotFound
from kvgraft.replication.endpoint import Endpoint
from kvgraft.v1 import kvgraft_pb2 as pb


class Target(Protocol):
    """Where artifacts are copied to."""

    # (every artifact held, those of them quarantined: a scrub found them corrupt)
    def holdings(self) -> tuple[set[str], set[str]]: ...
    def has_artifact(self, artifact_id: str) -> bool: ...
    def missing_pages(self, digests: list[bytes]) -> list[bytes]: ...
    def put_parts(self, parts: Iterator[wire.PutPart]) -> pb.PutArtifactResponse: ...
    # "deleted", "absent", "pinned", "foreign" (the target did not get it from the source)
    def delete_artifact(self, artifact_id: str) -> str: ...


class ClientTarget:
    """A daemon reached over gRPC (a kvgraft.Client, or any Endpoint)."""

    def __init__(self, client: Endpoint) -> None:
        self.client = client

    def holdings(self) -> tuple[set[str], set[str]]:
        infos = list(self.client.list_artifacts())
        return {i.artifact_id for i in infos}, {i.artifact_id for i in infos if i.quarantined}

    def has_artifact(self, artifact_id: str) -> bool:
        try:
            self.client.stat(artifact_id)
        except NotFound:
            return False
        return True

    def missing_pages(self, digests: list[bytes]) -> list[bytes]:
        return self.client.missing_pages(digests)

    def put_parts(self, parts: Iterator[wire.PutPart]) -> pb.PutArtifactResponse:
        return self.client.put_artifact_messages(map(wire.encode_put, parts))

    def delete_artifact(self, artifact_id: str) -> str:
        try:
            self.client.delete(artifact_id)
        except NotFound:
            return "absent"
        except FailedPrecondition:
            if self.client.stat(artifact_id).info.pinned:
                return "pinned"
            raise
        return "deleted"
