"""Where replication copies to: the `Target` protocol, and `ClientTarget` (a daemon over gRPC).

kvgraftd's follow mode has its own target, its local store
(kvgraftd.replication.follower.LocalTarget). `holdings` says what a target holds (which
of it is quarantined, and whose signatures each carries); `expired` what its TTL pins
deleted, read from its own change feed, so a pass does not copy those back. Deletes
answer "deleted", "absent" (nothing to delete) or "pinned" (kept: a pinned artifact
cannot be deleted).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from kvgraft import wire
from kvgraft.errors import FailedPrecondition, NotFound
from kvgraft.replication.endpoint import Endpoint
from kvgraft.replication.feed import expiries, read_feed
from kvgraft.v1 import kvgraft_pb2 as pb


@dataclass(frozen=True)
class Holdings:
    """What a target holds when a pass begins."""

    present: set[str]  # every artifact
    quarantined: set[str]  # of those, the ones a scrub found corrupt (a pass repairs them)
    signers: dict[str, frozenset[bytes]]  # artifact id -> public keys of its signatures


class Target(Protocol):
    """Where artifacts are copied to."""

    def holdings(self) -> Holdings: ...
    # artifact id -> when (unix ms) its TTL pin expired, for those deleted so and not back
    def expired(self) -> dict[str, int]: ...
    def has_artifact(self, artifact_id: str) -> bool: ...
    def missing_pages(self, digests: list[bytes]) -> list[bytes]: ...
    def put_parts(self, parts: Iterator[wire.PutPart]) -> pb.PutArtifactResponse: ...
    # "deleted", "absent", "pinned", "foreign" (the target did not get it from the source)
    def delete_artifact(self, artifact_id: str) -> str: ...


class ClientTarget:
    """A daemon reached over gRPC (a kvgraft.Client, or any Endpoint)."""

    def __init__(self, client: Endpoint) -> None:
        self.client = client

    def holdings(self) -> Holdings:
        infos = list(self.client.list_artifacts())
        return Holdings(
            present={i.artifact_id for i in infos},
            quarantined={i.artifact_id for i in infos if i.quarantined},
            signers={
                i.artifact_id: frozenset(s.public_key for s in i.provenance.signatures)
                for i in infos
            },
        )

    def expired(self) -> dict[str, int]:
        return expiries(read_feed(self.client, 1))  # read twice and checked, as a source's

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
