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
* Every page read is copied out of its segment, or read where it lies by the
  attention kernel (`pages_to_check`), under a fault guard (a damaged segment
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
kvgraftd.store.page_store's. The Store's other parts are objects it holds, each
its own concept over the same environment and pages, whose public methods the
Store offers as its own (each passed on below, under the part's name): staged
pages (kvgraftd.store.staging), trust and prefix lookups
(kvgraftd.store.trusted_prefixes), the cache lifecycle: readers' leases,
removal, pins that expire (kvgraftd.store.lifecycle, its budget
kvgraftd.store.eviction), and quarantine (kvgraftd.store.quarantine). The
Store's interface is declared in kvgraftd.store.interface (`ArtifactStore`).
Only modules of kvgraftd.store import lmdb; none of them knows about gRPC.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path

import numpy as np

from kvgraft.errors import FailedPrecondition, NotFound, ResourceExhausted
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store import catalog, page_records, trust_index
from kvgraftd.store import migration as store_migration
from kvgraftd.store.catalog import (
    SEQUENCE_KEY,
    ArtifactRecord,
    Visible,
    decode_record,
    now_ms,
)
from kvgraftd.store.commits import Commits
from kvgraftd.store.eviction import NO_BUDGET, CacheBudget, Evictor
from kvgraftd.store.interface import CommitResult, StoreStats
from kvgraftd.store.lifecycle import LIFECYCLE_DATABASES, Lifecycle
from kvgraftd.store.lmdb_env import LmdbEnv
from kvgraftd.store.owned_pages import owned_key
from kvgraftd.store.page_records import PageRecord
from kvgraftd.store.page_store import PAGE_BYTES, PageStore
from kvgraftd.store.quarantine import QUARANTINE_DATABASES, Quarantine
from kvgraftd.store.segments import DEFAULT_SEGMENT_BYTES
from kvgraftd.store.signing import TrustPolicy
from kvgraftd.store.staging import Staging
from kvgraftd.store.trust_index import ChainMatch
from kvgraftd.store.trusted_prefixes import TrustedPrefixes
from kvgraftd.store.usage import USAGE_FLUSH_S, Usage, UsageBook

log = logging.getLogger(__name__)

_U64 = struct.Struct("<Q")
_DATABASES = (
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
)


class Store:
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
            _DATABASES,
            initial_map_bytes=initial_map_bytes,
            min_free_bytes=min_free_bytes,
        )
        self._db, self._read, self._write = self._lmdb.db, self._lmdb.read, self._lmdb.write
        self._pages = PageStore(self._lmdb, self.path / "segments", segment_bytes=segment_bytes)
        self._changed = threading.Condition()
        self._clock = clock
        self._usage = UsageBook()
        self.evictor = Evictor(self, budget)
        self._staging = Staging(self._lmdb, self._pages)
        self._quarantine = Quarantine(self._lmdb, self._pages)
        self.read_quarantine = self._quarantine.reads  # corrupt pages reads found
        self._lifecycle = Lifecycle(
            self._lmdb,
            self._pages,
            self._usage,
            clock,
            evictor=self.evictor,
            reads=self.read_quarantine,
            budgeted_bytes=self._staging.budgeted_bytes,
            notify_change=self._notify_change,
        )
        self._trust = TrustedPrefixes(self._lmdb, self.reading)
        self._commits = Commits(
            self._lmdb,
            self._pages,
            self._usage,
            clock,
            evictor=self.evictor,
            staging=self._staging,
            quarantine=self._quarantine,
            notify_change=self._notify_change,
        )
        try:
            version = store_migration.check_format(self._lmdb, self.path)
            self._pages.open(version)
            if version < store_migration.STORE_FORMAT_VERSION:
                store_migration.migrate_index(self._lmdb, max(version, 2))
            self._lifecycle.load_usage()
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
        with self._quarantine.quarantining_corrupt():
            self._pages.read_into(digests, dests)

    @contextmanager
    def verified_pages(self, digests: Sequence[bytes]) -> Iterator[list[np.ndarray]]:
        """The pages, each read into an array of its own and verified there."""
        with self._quarantine.quarantining_corrupt():
            yield self._pages.verified(digests)

    @contextmanager
    def pages_to_check(
        self, digests: Sequence[bytes]
    ) -> Iterator[list[tuple[bytes, page_records.InPlacePage | np.ndarray]]]:
        """(xxh3-128, the page not yet checked) of each page: where it lies (InPlacePage,
        for guarded native code inside the `with` block) or a copy. The caller checks each
        one, raising CorruptPage inside the `with` block for one that fails (it is
        quarantined)."""
        with self._quarantine.quarantining_corrupt(), self._pages.unchecked(digests) as pages:
            yield pages

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
        with self._quarantine.quarantining_corrupt():
            return self._pages.read_framed(digests, frame)

    # ------------------------------------------------------------------
    # artifacts

    def commit_artifact(
        self,
        manifest: pb.Manifest,
        records: Mapping[bytes, PageRecord],
        provenance: pb.Provenance = trust_index.UNRECORDED,
    ) -> CommitResult:
        """Store a validated manifest with the page records not yet stored
        (kvgraftd.store.commits)."""
        return self._commits.commit_artifact(manifest, records, provenance)

    def meta_time(self, name: bytes) -> int:
        """A unix-ms time kept in `meta` (0 when never set)."""
        with self._read() as txn:
            return catalog.counter(txn, self._db["meta"], name)

    def set_meta_time(self, name: bytes, unix_ms: int) -> None:
        self._write(0, lambda txn: txn.put(name, _U64.pack(unix_ms), db=self._db["meta"]))

    def resolve(self, id_or_prefix: str, visible: Visible | None = None) -> str:
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
        self, after: bytes, limit: int, visible: Visible | None = None
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
            stats = StoreStats(
                artifacts=txn.stat(self._db["artifacts"])["entries"],
                pages=self._pages.count(txn),
                page_bytes=catalog.counter(txn, self._db["meta"], PAGE_BYTES),
                staged_pages=txn.stat(self._db["staged"])["entries"],
                map_size_bytes=0,
                map_used_bytes=0,
                segment_disk_bytes=self._pages.disk_bytes(),
                disk_free_bytes=shutil.disk_usage(self.path).free,
                last_sequence=SEQUENCE_KEY.unpack(last.key())[0] if last.last() else 0,
            )
        map_size, map_used = self._lmdb.map_bytes()
        return dataclasses.replace(stats, map_size_bytes=map_size, map_used_bytes=map_used)

    # ------------------------------------------------------------------
    # staged pages: kvgraftd.store.staging

    def stage_pages(self, records: Mapping[bytes, PageRecord], limit_bytes: int = 0) -> int:
        return self._staging.stage_pages(records, limit_bytes)

    def uploading(
        self, staged: Mapping[bytes, object], for_s: float = math.inf
    ) -> AbstractContextManager[None]:
        return self._staging.uploading(staged, for_s)

    def collect_staged(self, older_than_s: float) -> int:
        return self._staging.collect_staged(older_than_s)

    # ------------------------------------------------------------------
    # trust and prefix lookups: kvgraftd.store.trusted_prefixes

    def longest_chain(
        self,
        fingerprint: bytes,
        profile: pb.ComputeProfile,
        layout: pb.KvLayout,
        token_ids: Sequence[int],
        hold: ExitStack | None = None,
        namespace: str = "",
    ) -> ChainMatch:
        return self._trust.longest_chain(fingerprint, profile, layout, token_ids, hold, namespace)

    def longest_untrusted(
        self,
        fingerprint: bytes,
        profile: pb.ComputeProfile,
        layout: pb.KvLayout,
        token_ids: Sequence[int],
        visible: Visible | None = None,
    ) -> tuple[int, str]:
        return self._trust.longest_untrusted(fingerprint, profile, layout, token_ids, visible)

    def reevaluate_trust(self, policy: TrustPolicy) -> tuple[int, int] | None:
        return self._trust.reevaluate_trust(policy)

    def signer_keys(self, artifact_ids: Iterable[str]) -> dict[str, frozenset[bytes]]:
        return self._trust.signer_keys(artifact_ids)

    def provenance(self, artifact_id: str) -> pb.Provenance:
        return self._trust.provenance(artifact_id)

    def trust_artifact(self, artifact_id: str, provenance: pb.Provenance) -> pb.Provenance:
        return self._trust.trust_artifact(artifact_id, provenance)

    # ------------------------------------------------------------------
    # the cache lifecycle: kvgraftd.store.lifecycle

    def reading(self, artifact_id: str, reused_tokens: int = 0) -> AbstractContextManager[None]:
        return self._lifecycle.reading(artifact_id, reused_tokens)

    def usage(self, artifact_id: str) -> Usage | None:
        return self._lifecycle.usage(artifact_id)

    def evictable(self) -> dict[bytes, Usage]:
        return self._lifecycle.evictable()

    def cache_totals(self) -> tuple[int, int]:
        return self._lifecycle.cache_totals()

    def cache_totals_of(self, tenant: str) -> tuple[int, int]:
        return self._lifecycle.cache_totals_of(tenant)

    def raise_inflation(self, priority: float) -> None:
        self._lifecycle.raise_inflation(priority)

    def remove(self, aids: Iterable[bytes], reason: int) -> tuple[int, int]:
        return self._lifecycle.remove(aids, reason)

    def delete_artifact(self, artifact_id: str, wait_s: float = 20.0) -> tuple[int, int]:
        return self._lifecycle.delete_artifact(artifact_id, wait_s)

    def give_back(self) -> None:
        self._lifecycle.give_back()

    def flush_usage(self) -> int:
        return self._lifecycle.flush_usage()

    def set_pinned(self, artifact_id: str, pinned: bool, ttl_s: float = 0) -> ArtifactRecord:
        return self._lifecycle.set_pinned(artifact_id, pinned, ttl_s)

    def pin_expiry(self, artifact_id: str) -> int:
        return self._lifecycle.pin_expiry(artifact_id)

    def due_expiries(self) -> list[bytes]:
        return self._lifecycle.due_expiries()

    def expire_due(self) -> int:
        return self._lifecycle.expire_due()

    # ------------------------------------------------------------------
    # quarantine: kvgraftd.store.quarantine

    def hash_batch(self, after: bytes, limit: int) -> tuple[bytes, int, int, list[bytes]]:
        return self._quarantine.hash_batch(after, limit)

    def quarantine(self, digests: list[bytes]) -> list[str]:
        return self._quarantine.quarantine(digests)

    def is_quarantined(self, artifact_id: str) -> bool:
        return self._quarantine.is_quarantined(artifact_id)

    def quarantined_ids(self) -> list[str]:
        return self._quarantine.quarantined_ids()

    def check_servable(self, artifact_id: str) -> None:
        self._quarantine.check_servable(artifact_id)
