"""How artifacts and change records are kept in the store's catalogue.

An artifact's value in the `artifacts` sub-database is a fixed header
(created-at, change-feed sequence, pinned flag) followed by the canonical
manifest bytes; the id is the SHA-256 of those manifest bytes alone, so
pinning never changes an id. The `log` sub-database holds the change feed:
key = sequence (u64 big-endian, so keys sort by sequence), value = a
serialized ChangeRecord. This module turns records into the wire's
ArtifactInfo, reads the catalogue inside the store's transactions
(resolve, records_after, changes_since) and appends to the feed
(append_change). It knows nothing of gRPC.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvgraft.artifact import page_sizes
from kvgraft.errors import InvalidArgument, NotFound
from kvgraft.v1 import kvgraft_pb2 as pb

Visible = Callable[[Mapping[str, str]], bool]  # which artifacts a caller may see, by labels
_HEADER = struct.Struct("<qQB7x")  # created unix ms, sequence, pinned, padding
SEQUENCE_KEY = struct.Struct(">Q")  # log keys
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


def counter(txn, meta, name: bytes) -> int:
    """A u64 counter of the `meta` sub-database (0 when absent)."""
    current = txn.get(name, db=meta)
    return struct.unpack("<Q", current)[0] if current is not None else 0


def add_counter(txn, meta, name: bytes, delta: int) -> None:
    txn.put(name, struct.pack("<Q", max(0, counter(txn, meta, name) + delta)), db=meta)


def now_ms() -> int:
    """Unix time in milliseconds, as records and change records keep it."""
    return int(time.time() * 1000)


def parse_full_id(artifact_id: str) -> bytes:
    try:
        aid = bytes.fromhex(artifact_id)
    except ValueError:
        aid = b""
    if len(aid) != 32:
        raise InvalidArgument(f"{artifact_id!r} is not a full artifact id (64 hex characters)")
    return aid


def append_change(txn, db, kind: int, aid: bytes, reason: int = 0) -> int:
    """Add a change record (`kind` of artifact `aid`, deleted for `reason`) to the feed;
    returns its sequence."""
    cursor = txn.cursor(db=db)
    sequence = SEQUENCE_KEY.unpack(cursor.key())[0] + 1 if cursor.last() else 1
    entry = pb.ChangeRecord(
        sequence=sequence, kind=kind, artifact_id=aid.hex(), unix_ms=now_ms(), reason=reason
    )
    txn.put(SEQUENCE_KEY.pack(sequence), entry.SerializeToString(), db=db)
    return sequence


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


def not_found(id_or_prefix: str) -> NotFound:
    """What an id nobody stored answers, and (kvgraftd.store.tenant_view) an id the caller
    may not see: the same words, so that a refusal tells nothing."""
    return NotFound(f"no artifact id starts with {id_or_prefix} (kvgraft ls lists them)")


def resolve(txn, db, id_or_prefix: str, visible: Visible | None = None) -> str:
    """The full id of the one artifact whose id starts with `id_or_prefix` (of those whose
    labels `visible` accepts, when given)."""
    low, high = resolve_prefix_bounds(id_or_prefix)
    cursor = txn.cursor(db=db)
    found: list[str] = []
    if cursor.set_range(low):
        for key, value in cursor:
            if bytes(key) > high or len(found) == 2:
                break
            if not bytes(key).hex().startswith(id_or_prefix.lower()):
                continue
            if visible is None or visible(decode_record(value).manifest().labels):
                found.append(bytes(key).hex())
    if not found:
        raise not_found(id_or_prefix)
    if len(found) > 1:
        raise InvalidArgument(f"{id_or_prefix} matches several artifacts; give more characters")
    return found[0]


def records_after(
    txn, db, after: bytes, limit: int, visible: Visible | None = None
) -> list[tuple[str, ArtifactRecord]]:
    """Up to `limit` artifacts with ids greater than `after`, in id order (of those whose
    labels `visible` accepts, when given)."""
    out: list[tuple[str, ArtifactRecord]] = []
    cursor = txn.cursor(db=db)
    if not cursor.set_range(after):
        return out
    for key, value in cursor:
        if bytes(key) == after:
            continue
        record = decode_record(value)
        if visible is not None and not visible(record.manifest().labels):
            continue
        out.append((bytes(key).hex(), record))
        if len(out) >= limit:
            break
    return out


def changes_since(txn, db, sequence: int, limit: int) -> list[pb.ChangeRecord]:
    """Up to `limit` change records from `sequence` on, in order."""
    cursor = txn.cursor(db=db)
    out: list[pb.ChangeRecord] = []
    if cursor.set_range(SEQUENCE_KEY.pack(max(sequence, 1))):
        for value in cursor.iternext(keys=False):
            out.append(pb.ChangeRecord.FromString(bytes(value)))
            if len(out) >= limit:
                break
    return out
