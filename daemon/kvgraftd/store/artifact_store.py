"""The artifact store: an LMDB index and segment files of content-addressed pages.

Sub-databases (docs/architecture.md, "The store"):
  page_locations  sha256 -> xxh3-128 || segment, offset, length   the bytes: segments/
  refs       sha256 -> u64 reference count                   pages referenced by artifacts
  staged     sha256 -> u64 unix ms, u64 disk bytes           uploads not finished (store.staging)
  artifacts  artifact id (32 bytes) -> record header || canonical manifest
  log        u64 sequence (big-endian) -> ChangeRecord        the replication feed
  chains     chain key -> chain entry                        prefix lookup (engine)
  chain_children  parent key || tokens || chain key -> ""    the entries after each page
  meta       name -> value                         format version, counters, segment tail
  provenance artifact id -> Provenance             why it is trusted (kvgraftd.store.trust_index)
  vouchers   chain key || artifact id -> ""       trusted artifacts holding a chain page
  untrusted_heads  first tokens || artifact id -> ""   untrusted artifacts (Lookup names them)
  usage      artifact id -> last use, reused tokens   (kvgraftd.store.lifecycle)
  pin_expiry artifact id -> unix ms                    when a TTL pin expires
  quarantine artifact id -> unix ms                    a scrub found it corrupt
  owned_pages  tenant key || sha256 -> u64            pages a tenant's artifacts reference

Invariants:
* An artifact's pages, reference counts, manifest and log record commit in
  one write transaction; a reader sees an artifact whole or not at all.
  Page bytes are appended to the segment files and synced before that
  transaction commits (kvgraftd.store.segments), so an index record never names
  bytes that are not durable; bytes whose transaction failed are cut off.
* Every page read is copied out of its segment (pread: a damaged segment
  fails the read, never the process) and checked against its xxh3-128; a
  mismatch or missing bytes raise DataLoss and no byte of the page is
  returned, and the artifacts holding it are quarantined
  (kvgraftd.store.quarantine).
* Pages received before their manifest may be staged (persisted but
  referenced by nothing, invisible to readers of artifacts) so a cut transfer
  resumes; staged pages nobody claims are collected after a grace period.
* A write that would eat into `min_free_bytes` of the disk is refused with
  ResourceExhausted before it starts; a full disk fails the write cleanly,
  never the process (kvgraftd.store.lmdb_env keeps the environment: transactions,
  map growth, the disk reserve).

This module keeps artifacts, references and the change log; the pages are
kvgraftd.store.page_store's. The Store's other parts are mixins, each its own
concept: staged pages (kvgraftd.store.staging), trust and prefix lookups
(kvgraftd.store.trusted_prefixes), the cache lifecycle: readers' leases, removal,
expiring pins (kvgraftd.store.lifecycle, its budget kvgraftd.store.eviction), and
quarantine (kvgraftd.store.quarantine). Only modules of kvgraftd.store import
lmdb; none of them knows about gRPC.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import shutil
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np

from kvgraft.artifact import canonical_bytes, page_sizes
from kvgraft.errors import FailedPrecondition, NotFound, ResourceExhausted
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store import catalog, page_records, staging, trust_index
from kvgraftd.store import migration as store_migration
from kvgraftd.store.catalog import (
    SEQUENCE_KEY,
    ArtifactRecord,
    decode_record,
    encode_record,
    now_ms,
)
from kvgraftd.store.eviction import NO_BUDGET, CacheBudget, Evictor
from kvgraftd.store.lifecycle import LIFECYCLE_DATABASES, Lifecycle, usage_of_new
from kvgraftd.store.lmdb_env import LmdbEnv
from kvgraftd.store.owned_pages import count_owned, owned_key
from kvgraftd.store.page_records import PageRecord, write_needs
from kvgraftd.store.page_store import PageStore
from kvgraftd.store.quarantine import QUARANTINE_DATABASES, Quarantine, ReadQuarantine
from kvgraftd.store.segments import DEFAULT_SEGMENT_BYTES, Location
from kvgraftd.store.staging import Staging
from kvgraftd.store.trusted_prefixes import TrustedPrefixes
from kvgraftd.store.usage import USAGE_FLUSH_S, UsageBook

log = logging.getLogger(__name__)

_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class CommitResult:
    artifact_id: str
    already_present: bool
    pages_written: int
    bytes_written: int
    sequence: int


@dataclass(frozen=True)
class StoreStats:
    artifacts: int
    pages: int
    page_bytes: int
    staged_pages: int
    map_size_bytes: int
    map_used_bytes: int
    segment_disk_bytes: int
    disk_free_bytes: int
    last_sequence: int


class Store(Lifecycle, Quarantine, TrustedPrefixes, Staging):
    """A kvgraft store in directory `path` (created if missing). `clock`: unix ms, for
    last uses and pin expiries (tests move it)."""

    def __init__(
        self,
        path: Path,
        *,
        initial_map_bytes: int = 1 << 30,
        min_free_bytes: int = 256 << 20,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        clock: Callable[[], int] = now_ms,
        budget: CacheBudget = NO_BUDGET,
    ) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lmdb = LmdbEnv(
            self.path,
            (
                "page_locations",
                "refs",
                "staged",
                "artifacts",
                "log",
                "chains",
                "chain_children",
                "meta",
                "provenance",
                "vouchers",
                "untrusted_heads",
                "owned_pages",
                *LIFECYCLE_DATABASES,
                *QUARANTINE_DATABASES,
            ),
            initial_map_bytes=initial_map_bytes,
            min_free_bytes=min_free_bytes,
        )
        self._db = self._lmdb.db
        self._read = self._lmdb.read
        self._init_staging()
        self._write = self._lmdb.write
        self._pages = PageStore(self._lmdb, self.path / "segments", segment_bytes=segment_bytes)
        self._changed = threading.Condition()
        self._clock = clock
        self._usage = UsageBook()
        self.evictor = Evictor(self, budget)
        self.read_quarantine = ReadQuarantine(self._quarantine_pages)  # corrupt pages reads found
        # One commit at a time from making its room to using it (the usage book changes
        # inside each transaction, so it follows the catalogue: kvgraftd.store.lifecycle).
        self._admitting = threading.Lock()
        try:
            version = store_migration.check_format(self._lmdb, self.path)
            self._pages.open(version)
            if version < store_migration.STORE_FORMAT_VERSION:
                store_migration.migrate_index(self._lmdb, max(version, 2))
            self._load_usage()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.read_quarantine.settled()
        try:
            self.flush_usage()
        # a full disk at shutdown, or a store directory gone (lmdb_env): expected, no traceback
        except (ResourceExhausted, FailedPrecondition) as exc:
            log.warning(
                "could not record the artifacts' last uses: the uses since the last write "
                "(at most %.0f s of them) are forgotten; no data is lost (%s)",
                USAGE_FLUSH_S,
                exc,
            )
        except Exception:  # a closing store loses recent use times, never data
            log.exception("could not record the artifacts' last uses")
        self._lmdb.close()
        self._pages.close()

    # ------------------------------------------------------------------
    # pages

    def missing_pages(self, digests: Sequence[bytes]) -> list[bytes]:
        """The digests whose pages are not stored (staged pages count as stored)."""
        return self._pages.missing(digests)

    def pages_not_owned(self, tenant: str, digests: Sequence[bytes]) -> list[bytes]:
        """The digests no artifact of `tenant` references (what a tenant is told to send:
        another tenant's pages count as missing, so no answer says who holds what)."""
        owned, prefix = self._db["owned_pages"], owned_key(tenant, b"")
        with self._read() as txn:
            return [d for d in digests if txn.get(prefix + d, db=owned) is None]

    def read_pages_into(self, digests: Sequence[bytes], dests: Sequence[np.ndarray]) -> None:
        """Read each page into its uint8 destination and verify it there."""
        with self._quarantining_corrupt():
            self._pages.read_into(digests, dests)

    @contextmanager
    def verified_pages(self, digests: Sequence[bytes]) -> Iterator[list[np.ndarray]]:
        """The pages, each read into an array of its own and verified there."""
        with self._quarantining_corrupt():
            yield self._pages.verified(digests)

    @contextmanager
    def pages_to_check(self, digests: Sequence[bytes]) -> Iterator[list[tuple[bytes, np.ndarray]]]:
        """(xxh3-128, unchecked copy) of each page: the caller checks each one, raising
        CorruptPage inside the `with` block for one that fails (it is quarantined)."""
        with self._quarantining_corrupt():
            yield self._pages.unchecked(digests)

    def read_page(self, digest: bytes) -> tuple[bytes, bytes]:
        """One page's bytes and xxh3-128, verified."""
        checksum: list[bytes] = []
        data = self.read_pages_framed(
            [digest], lambda i, d, xxh3, size: checksum.append(xxh3) or b""
        )
        return data, checksum[0]

    def read_pages_framed(self, digests: Sequence[bytes], frame: page_records.Framer) -> bytes:
        """frame(0, ...) + page 0 + frame(1, ...) + ..., every page verified: `frame(index,
        sha256, xxh3, size)` gives the bytes before page `index` (the wire)."""
        with self._quarantining_corrupt():
            return self._pages.read_framed(digests, frame)

    # ------------------------------------------------------------------
    # artifacts

    def commit_artifact(
        self,
        manifest: pb.Manifest,
        records: Mapping[bytes, PageRecord],
        provenance: pb.Provenance = trust_index.UNRECORDED,
    ) -> CommitResult:
        """Store a validated manifest with the page records not yet stored.

        Every page the manifest names must be stored, staged or in `records`
        (whose sizes the caller checked); otherwise nothing is written. The
        provenance is kept (merged with an earlier one for an artifact already
        present); the artifact's pages enter the chain index only when trusted.
        """
        canonical = canonical_bytes(manifest)
        aid = hashlib.sha256(canonical).digest()
        sizes = page_sizes(manifest)
        index_bytes, file_bytes = write_needs(records[d] for d in sizes if d in records)

        def body(txn: lmdb.Transaction) -> CommitResult:
            found = txn.get(aid, db=self._db["artifacts"])
            if found is not None:
                sequence = decode_record(found).sequence
                repaired = (0, 0)
                if txn.get(aid, db=self._db["quarantine"]) is not None:
                    repaired = self._repair_in(txn, aid, manifest, records)
                trust_index.record(txn, self._db, aid, manifest, provenance)
                return CommitResult(aid.hex(), True, *repaired, sequence)
            new = self._pages.new_pages(txn, sizes, records)
            self._pages.append(txn, new)
            for digest in sizes:
                self._reference_page(txn, digest)
            count_owned(txn, self._db["owned_pages"], manifest, +1)
            written_bytes = sum(len(record.data) for record in new.values())
            self._add_page_bytes(txn, written_bytes)
            written = len(new)
            trust_index.record(txn, self._db, aid, manifest, provenance)
            sequence = catalog.append_change(txn, self._db["log"], pb.ChangeRecord.KIND_ADDED, aid)
            record = ArtifactRecord(now_ms(), sequence, False, canonical)
            txn.put(aid, encode_record(record), db=self._db["artifacts"])
            self._usage.added(aid, usage_of_new(manifest, self._clock()))  # see _admitting
            added.append(aid)
            return CommitResult(aid.hex(), False, written, written_bytes, sequence)

        added: list[bytes] = []

        with self._admitting:
            if self._usage.get(aid) is None:  # an artifact present takes no room
                # the staged pages it claims enter the budget too (kvgraftd.store.staging)
                claimed = self._staged_disk_of(d for d in sizes if d not in records)
                self.evictor.make_room(file_bytes + claimed)
            try:
                result = self._pages.write(index_bytes + len(canonical), file_bytes, body)
            except BaseException:
                self._usage.removed(added)  # its transaction failed: not stored
                raise
        if not result.already_present:
            self._notify_change()
            log.info(  # one logfmt line per artifact written: machines read it
                "event=artifact_written artifact_id=%s sequence=%d pages_written=%d "
                "bytes_written=%d tokens=%d",
                result.artifact_id,
                result.sequence,
                result.pages_written,
                result.bytes_written,
                len(manifest.token_ids),
            )
        return result

    def _reference_page(self, txn, digest: bytes) -> None:
        """Add one reference to a stored page (a staged page is staged no more)."""
        refs = self._db["refs"]
        count = txn.get(digest, db=refs)
        if count is None:
            staging.unstage(txn, self._db, digest)
        txn.put(digest, _U64.pack(1 if count is None else _U64.unpack(count)[0] + 1), db=refs)

    def _drop_pages(self, txn, digests: Iterable[bytes]) -> list[Location]:
        """Remove pages' records (the page-bytes counter updated once); the locations of
        those that had one, for the segments to free after the commit."""
        locations = [self._pages.drop(txn, digest) for digest in digests]
        locations = [location for location in locations if location is not None]
        self._add_page_bytes(txn, -sum(location.length for location in locations))
        return locations

    def meta_time(self, name: bytes) -> int:
        """A unix-ms time kept in `meta` (0 when never set)."""
        with self._read() as txn:
            return catalog.counter(txn, self._db["meta"], name)

    def set_meta_time(self, name: bytes, unix_ms: int) -> None:
        self._write(0, lambda txn: txn.put(name, _U64.pack(unix_ms), db=self._db["meta"]))

    def _add_page_bytes(self, txn, delta: int) -> None:
        catalog.add_counter(txn, self._db["meta"], b"page_bytes", delta)

    def set_pinned(self, artifact_id: str, pinned: bool, ttl_s: float = 0) -> ArtifactRecord:
        """Pin or unpin; a pin with `ttl_s` expires then (the artifact is deleted)."""
        aid = catalog.parse_full_id(self.resolve(artifact_id))

        def body(txn: lmdb.Transaction) -> ArtifactRecord:
            found = txn.get(aid, db=self._db["artifacts"])
            if found is None:  # deleted since resolve()
                raise NotFound(f"artifact {artifact_id} was deleted")
            record = dataclasses.replace(decode_record(found), pinned=pinned)
            self._set_expiry_in(txn, aid, pinned, ttl_s)
            txn.put(aid, encode_record(record), db=self._db["artifacts"])
            return record

        record = self._write(0, body)
        self._usage.set_pinned(aid, pinned)
        return record

    def resolve(self, id_or_prefix: str, visible: catalog.Visible | None = None) -> str:
        """The full id of the one artifact whose id starts with `id_or_prefix` (of those
        `visible` accepts)."""
        with self._read() as txn:
            return catalog.resolve(txn, self._db["artifacts"], id_or_prefix, visible)

    def get_record(self, artifact_id: str) -> ArtifactRecord:
        aid = catalog.parse_full_id(self.resolve(artifact_id))
        with self._read() as txn:
            found = txn.get(aid, db=self._db["artifacts"])
            if found is None:
                raise NotFound(f"artifact {artifact_id} was deleted")
            return decode_record(found)

    def list_records(
        self, after: bytes, limit: int, visible: catalog.Visible | None = None
    ) -> list[tuple[str, ArtifactRecord]]:
        """Up to `limit` artifacts with ids greater than `after`, in id order (of those
        `visible` accepts)."""
        with self._read() as txn:
            return catalog.records_after(txn, self._db["artifacts"], after, limit, visible)

    # ------------------------------------------------------------------
    # change feed and counters

    def changes_since(self, sequence: int, limit: int = 1000) -> list[pb.ChangeRecord]:
        with self._read() as txn:
            return catalog.changes_since(txn, self._db["log"], sequence, limit)

    def _notify_change(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def wake(self) -> None:
        """Wake whoever waits for a change (a stopping maintenance thread)."""
        self._notify_change()

    def wait_for_change(self, timeout_s: float) -> None:
        """Block until an artifact is added or deleted, or `timeout_s` passes."""
        with self._changed:
            self._changed.wait(timeout_s)

    def stats(self) -> StoreStats:
        with self._read() as txn:
            last = txn.cursor(db=self._db["log"])
            page_bytes = txn.get(b"page_bytes", db=self._db["meta"])
            stats = StoreStats(
                artifacts=txn.stat(self._db["artifacts"])["entries"],
                pages=self._pages.count(txn),
                page_bytes=_U64.unpack(page_bytes)[0] if page_bytes is not None else 0,
                staged_pages=txn.stat(self._db["staged"])["entries"],
                map_size_bytes=0,
                map_used_bytes=0,
                segment_disk_bytes=self._pages.disk_bytes(),
                disk_free_bytes=shutil.disk_usage(self.path).free,
                last_sequence=SEQUENCE_KEY.unpack(last.key())[0] if last.last() else 0,
            )
        map_size, map_used = self._lmdb.map_bytes()
        return dataclasses.replace(stats, map_size_bytes=map_size, map_used_bytes=map_used)
