"""How artifacts and change records are kept in the store's catalogue.

An artifact's value in the `artifacts` sub-database is a fixed header
(created-at, change-feed sequence, pinned flag) followed by the canonical
manifest bytes; the id is the SHA-256 of those manifest bytes alone, so
pinning never changes an id. This module turns records into the wire's
ArtifactInfo and resolves id prefixes to key ranges. It knows nothing of
LMDB or gRPC.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvgraft.artifact import page_sizes
from kvgraft.errors import InvalidArgument
from kvgraft.v1 import kvgraft_pb2 as pb

_HEADER = struct.Struct("<qQB7x")  # created unix ms, sequence, pinned, padding
MIN_PREFIX_CHARS = 8


@dataclass(frozen=True)
class ArtifactRecord:
    created_unix_ms: int
    sequence: int
    pinned: bool
    canonical: bytes  # the manifest, deterministic serialization

    def manifest(self) -> pb.Manifest:
        return pb.Manifest.FromString(self.canonical)


def encode_record(record: ArtifactRecord) -> bytes:
    header = _HEADER.pack(record.created_unix_ms, record.sequence, record.pinned)
    return header + record.canonical


def decode_record(raw: bytes | memoryview) -> ArtifactRecord:
    view = memoryview(raw)
    created, sequence, pinned = _HEADER.unpack(view[: _HEADER.size])
    return ArtifactRecord(created, sequence, bool(pinned), bytes(view[_HEADER.size :]))


def artifact_info(
    artifact_id: str, record: ArtifactRecord, manifest: pb.Manifest
) -> pb.ArtifactInfo:
    sizes = page_sizes(manifest)
    page_bytes = sum(sizes[digest] for digest in manifest.page_sha256)
    return pb.ArtifactInfo(
        artifact_id=artifact_id,
        num_tokens=len(manifest.token_ids),
        num_segments=len(manifest.segment_ends),
        num_pages=len(manifest.page_sha256),
        page_bytes=page_bytes,
        layout=manifest.layout,
        model_fingerprint=manifest.model_fingerprint,
        labels=dict(manifest.labels),
        created_unix_ms=record.created_unix_ms,
        pinned=record.pinned,
        sequence=record.sequence,
    )


def change_record(sequence: int, kind: int, artifact_id: str, unix_ms: int) -> pb.ChangeRecord:
    return pb.ChangeRecord(sequence=sequence, kind=kind, artifact_id=artifact_id, unix_ms=unix_ms)


def resolve_prefix_bounds(id_or_prefix: str) -> tuple[bytes, bytes]:
    """The key range [low, high] that holds every id starting with the prefix."""
    prefix = id_or_prefix.lower()
    if not MIN_PREFIX_CHARS <= len(prefix) <= 64 or any(
        c not in "0123456789abcdef" for c in prefix
    ):
        raise InvalidArgument(
            f"{id_or_prefix!r} is not an artifact id: give 8 to 64 hex characters"
        )
    low = bytes.fromhex(prefix.ljust(64, "0"))
    high = bytes.fromhex(prefix.ljust(64, "f"))
    return low, high
