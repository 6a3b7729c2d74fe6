"""The store as a cache: readers, use, removal in batches, pins that expire.

`Lifecycle` is a part the Store holds (kvgraftd.store.artifact_store: it offers
the public methods below as its own) over the store's LMDB environment, pages,
usage book and evictor; kvgraftd.store.eviction decides what to remove, this
module removes it safely.

Contract:
* `reading(artifact_id)` holds a lease for a graft or an export: the artifact
  is neither evicted, expired nor deleted until it ends (NotFound if it is
  already gone, or quarantined: the caller computes instead). It counts as a
  use. It first waits for the quarantines of pages reads found corrupt
  (kvgraftd.store.quarantine), so no lease starts on pages known to be bad.
* `remove(aids, reason)` deletes, in one transaction, those of `aids` that
  nobody reads, pinned ones included only for `REASON_EXPIRED`, and for
  `REASON_EVICTED` none the evictor's `keep` holds (asked inside the
  transaction: a hold begun after the candidates were picked, a re-put not yet
  uploaded, counts too). Each gets a change record with its reason (followers
  keep evicted artifacts, delete expired ones). Pages another artifact holds
  stay. `delete_artifact` (a Delete call) removes one, waiting for its readers,
  refusing a pinned one; a `keep` hold does not stop it (the caller asked).
* The usage book changes inside each removal's (and commit's) transaction:
  transactions are serialized, so the book follows the catalogue, and no lease
  starts on an artifact whose records are going.
* Pins with a TTL: `pin_expiry` (artifact id -> unix ms) is written in the
  pin's own transaction (`set_pinned`), so an expiry survives a restart exactly; `expire_due`
  deletes what is due by the store's clock.
* Last use and reused tokens (kvgraftd.store.usage) are written to `usage` by
  `flush_usage` (every 30 s by the maintenance loop, and at close).
* Whether an artifact is a conversation context is its manifest's label
  (kvgraft.conversations), read into the usage book at every start and commit; the
  evictor counts them from the book (`Evictor.conversation_totals`, set here).
"""

from __future__ import annotations

import dataclasses
import logging
import struct
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import lmdb

from kvgraft.artifact import page_sizes
from kvgraft.conversations import is_conversation
from kvgraft.errors import FailedPrecondition, NotFound
from kvgraft.tenancy import owner_of
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store import catalog, chains, trust_index
from kvgraftd.store.catalog import ArtifactRecord, decode_record, encode_record
from kvgraftd.store.eviction import Evictor
from kvgraftd.store.lmdb_env import LmdbEnv
from kvgraftd.store.owned_pages import count_owned
from kvgraftd.store.page_store import PageStore
from kvgraftd.store.quarantine import ReadQuarantine
from kvgraftd.store.segments import Location
from kvgraftd.store.usage import USAGE_RECORD, Usage, UsageBook

log = logging.getLogger(__name__)

_EXPIRY = struct.Struct("<q")
_U64 = struct.Struct("<Q")
LIFECYCLE_DATABASES = ("usage", "pin_expiry")
_PINNED = "artifact {} is pinned; unpin it first (kvgraft pin --off ID)"


class Lifecycle:
    """The cache lifecycle of the store whose environment is `env` and pages `pages`.
    `reads`: the quarantine of pages reads found corrupt (a lease waits for it);
    `budgeted_bytes()`: what the budget counts (kvgraftd.store.staging);
    `notify_change()`: wakes the change feed's waiters (an artifact is gone)."""

    def __init__(
        self,
        env: LmdbEnv,
        pages: PageStore,
        usage: UsageBook,
        clock: Callable[[], int],
        *,
        evictor: Evictor,
        reads: ReadQuarantine,
        budgeted_bytes: Callable[[], int],
        notify_change: Callable[[], None],
    ) -> None:
        self._db, self._read, self._write = env.db, env.read, env.write
        self._pages = pages
        self._usage = usage
        self._clock = clock
        self._evictor = evictor
        self._reads = reads
        self._budgeted_bytes = budgeted_bytes
        self._notify_change = notify_change
        evictor.conversation_totals = usage.conversation_totals  # what their bound counts

    def load_usage(self) -> None:
        """Fill the usage book from the catalogue and the `usage` sub-database."""
        with self._read() as txn:
            usage_db, artifacts = self._db["usage"], self._db["artifacts"]
            for key, value in txn.cursor(db=artifacts):
                aid = bytes(key)
                record = decode_record(value)
                manifest = record.manifest()
                used = txn.get(aid, db=usage_db)
                last, reused = (
                    USAGE_RECORD.unpack(used) if used is not None else (record.created_unix_ms, 0)
                )
                self._usage.added(aid, _usage_of(manifest, record.pinned, last, reused))

    def flush_usage(self) -> int:
        """Write the uses noted since the last flush; returns how many artifacts."""
        dirty = self._usage.dirty()
        if not dirty:
            return 0

        def body(txn: lmdb.Transaction) -> None:
            for aid, value in dirty.items():
                if txn.get(aid, db=self._db["artifacts"]) is not None:
                    txn.put(aid, value, db=self._db["usage"])

        self._write(64 * len(dirty), body)
        return len(dirty)

    # ------------------------------------------------------------------
    # readers

    @contextmanager
    def reading(self, artifact_id: str, reused_tokens: int = 0) -> Iterator[None]:
        """Hold the artifact for a reader (see the module's contract); counts as a use."""
        aid = catalog.parse_full_id(artifact_id)
        self._reads.settled()
        with self._read() as txn:
            if txn.get(aid, db=self._db["quarantine"]) is not None:
                raise NotFound(f"artifact {artifact_id[:16]} is quarantined (a page was corrupt)")
        with self._usage.lease(aid):
            self._usage.used(aid, self._clock(), reused_tokens)
            yield

    def usage(self, artifact_id: str) -> Usage | None:
        return self._usage.get(catalog.parse_full_id(artifact_id))

    def evictable(self) -> dict[bytes, Usage]:
        """Every artifact a policy may evict now (not pinned, not read)."""
        return self._usage.snapshot()

    def give_back(self) -> None:
        """Punch out the holes of evicted pages now (the keeper does, every second)."""
        self._pages.give_back()

    def cache_totals(self) -> tuple[int, int]:
        """(artifacts, bytes of the segment files' live pages less the staged ones): what
        budgets count (kvgraftd.store.staging)."""
        return self._usage.count(), self._budgeted_bytes()

    def cache_totals_of(self, tenant: str) -> tuple[int, int]:
        """(artifacts, page bytes) of one tenant's artifacts: what its budget counts."""
        return self._usage.totals_of(tenant)

    def raise_inflation(self, priority: float) -> None:
        self._usage.inflate(priority)

    # ------------------------------------------------------------------
    # removal

    def remove(self, aids: Iterable[bytes], reason: int) -> tuple[int, int]:
        """Delete those of `aids` nobody reads, in one transaction; returns (artifacts,
        page bytes freed)."""
        taken = self._usage.claim(aids)
        if not taken:
            return 0, 0
        expiring = reason == pb.ChangeRecord.REASON_EXPIRED
        evicting = reason == pb.ChangeRecord.REASON_EVICTED
        keep = self._evictor.keep
        now = self._clock()

        def body(txn: lmdb.Transaction, take_out) -> tuple[list[bytes], list[Location], dict]:
            gone, missing, freed, credits = [], [], [], {}
            for aid in taken:
                found = txn.get(aid, db=self._db["artifacts"])
                record = decode_record(found) if found is not None else None
                if record is None:
                    missing.append(aid)  # deleted meanwhile: out of the book too
                    continue
                if expiring:  # still due? (unpinned or pinned again since it was found)
                    expiry = txn.get(aid, db=self._db["pin_expiry"])
                    if expiry is None or _EXPIRY.unpack(expiry)[0] > now:
                        continue
                elif record.pinned or (evicting and keep(aid)):
                    continue  # pinned, or held since it was picked (not yet uploaded)
                manifest = record.manifest()
                entries = list(chains.manifest_entries(manifest))
                freed += self._remove_in(txn, aid, manifest, reason, entries)
                gone.append(aid)
                earned = self._usage.get(aid)
                heir = _heir(txn, self._db, entries) if earned and earned.reused_tokens else None
                if heir is not None:
                    credits[heir] = credits.get(heir, 0) + earned.reused_tokens
            take_out(gone + missing)
            return gone, freed, credits

        gone, freed, credits = self._write_removal(taken, body)
        for heir, tokens in credits.items():  # the reuse a prefix earned stays with the prefix
            self._usage.used(heir, 0, tokens)
        # Under a byte budget the space goes back at once, so that the disk holds the
        # budget; without one, holes are punched in batches (SegmentFiles.give_back).
        self._pages.free(freed, defer=not self._evictor.budget.bytes)
        if gone:
            self._notify_change()
        freed_bytes = sum(location.length for location in freed)
        name = pb.ChangeRecord.Reason.Name(reason).removeprefix("REASON_").lower()
        for aid in gone:
            log.info("event=artifact_deleted artifact_id=%s reason=%s", aid.hex(), name)
        return len(gone), freed_bytes

    def delete_artifact(self, artifact_id: str, wait_s: float = 20.0) -> tuple[int, int]:
        """Remove an artifact; returns (pages freed, bytes freed). Waits up to `wait_s` for
        its readers (grafts, exports) to finish."""
        aid = catalog.parse_full_id(artifact_id)
        usage = self._usage.get(aid)
        if usage is not None and usage.pinned:  # refused without a claim, which readers wait on
            raise FailedPrecondition(_PINNED.format(artifact_id))
        self._usage.claim_waiting(aid, wait_s)

        def body(txn: lmdb.Transaction, take_out) -> list[Location]:
            record = require_present(txn, self._db, aid, artifact_id)
            if record.pinned:
                raise FailedPrecondition(_PINNED.format(artifact_id))
            reason = pb.ChangeRecord.REASON_UNSPECIFIED
            locations = self._remove_in(txn, aid, record.manifest(), reason)
            take_out([aid])
            return locations

        locations = self._write_removal([aid], body)
        self._pages.free(locations)
        freed, freed_bytes = len(locations), sum(location.length for location in locations)
        self._notify_change()
        log.info(  # one logfmt line per artifact deleted
            "event=artifact_deleted artifact_id=%s pages_freed=%d bytes_freed=%d",
            artifact_id,
            freed,
            freed_bytes,
        )
        return freed, freed_bytes

    def _write_removal(self, claimed: list[bytes], body):
        """`body(txn, take_out)` in one write transaction, then the claims released.
        `take_out(aids)` takes artifacts out of the usage book inside the transaction
        (transactions are serialized: no lease starts on them from there, no commit's
        `added` interleaves); if the transaction fails they are put back."""
        taken_out: dict = {}

        def take_out(aids: list[bytes]) -> None:
            taken_out.update(self._usage.removed(aids))

        try:
            return self._write(0, lambda txn: body(txn, take_out))
        except BaseException:
            self._usage.restore(taken_out)
            raise
        finally:
            self._usage.unclaim(claimed)

    def _remove_in(
        self, txn, aid: bytes, manifest: pb.Manifest, reason: int, entries=None
    ) -> list[Location]:
        """Delete one artifact inside `txn`; the locations to free after the commit.
        `entries`: its chain entries, when the caller has them."""
        unreferenced: list[bytes] = []
        refs, get, put, pack, unpack = self._db["refs"], txn.get, txn.put, _U64.pack, _U64.unpack
        for digest in dict.fromkeys(manifest.page_sha256):  # each distinct page once
            count = unpack(get(digest, db=refs))[0] - 1
            if count:
                put(digest, pack(count), db=refs)
                continue
            txn.delete(digest, db=refs)
            unreferenced.append(digest)
        locations = self._pages.drop(txn, unreferenced)
        count_owned(txn, self._db["owned_pages"], manifest, -1)
        trust_index.forget(txn, self._db, aid, manifest, entries)
        txn.delete(aid, db=self._db["artifacts"])
        txn.delete(aid, db=self._db["usage"])
        txn.delete(aid, db=self._db["pin_expiry"])
        txn.delete(aid, db=self._db["quarantine"])
        catalog.append_change(txn, self._db["log"], pb.ChangeRecord.KIND_DELETED, aid, reason)
        return locations

    # ------------------------------------------------------------------
    # pins that expire

    def set_pinned(self, artifact_id: str, pinned: bool, ttl_s: float = 0) -> ArtifactRecord:
        """Pin or unpin; a pin with `ttl_s` expires then (the artifact is deleted)."""
        with self._read() as txn:
            full_id = catalog.resolve(txn, self._db["artifacts"], artifact_id)
        aid = catalog.parse_full_id(full_id)

        def body(txn: lmdb.Transaction) -> ArtifactRecord:
            found = txn.get(aid, db=self._db["artifacts"])
            if found is None:  # deleted since it was resolved
                raise NotFound(f"artifact {artifact_id} was deleted")
            record = dataclasses.replace(decode_record(found), pinned=pinned)
            self._set_expiry_in(txn, aid, pinned, ttl_s)
            txn.put(aid, encode_record(record), db=self._db["artifacts"])
            return record

        record = self._write(0, body)
        self._usage.set_pinned(aid, pinned)
        return record

    def pin_expiry(self, artifact_id: str) -> int:
        """When the artifact's pin expires (unix ms), 0 for none."""
        with self._read() as txn:
            found = txn.get(catalog.parse_full_id(artifact_id), db=self._db["pin_expiry"])
            return _EXPIRY.unpack(found)[0] if found is not None else 0

    def _set_expiry_in(self, txn, aid: bytes, pinned: bool, ttl_s: float) -> None:
        if ttl_s and pinned:
            expires = self._clock() + int(ttl_s * 1000)
            txn.put(aid, _EXPIRY.pack(expires), db=self._db["pin_expiry"])
        else:
            txn.delete(aid, db=self._db["pin_expiry"])

    def due_expiries(self) -> list[bytes]:
        """The artifacts whose pin has expired."""
        now = self._clock()
        with self._read() as txn:
            cursor = txn.cursor(db=self._db["pin_expiry"])
            return [bytes(key) for key, value in cursor if _EXPIRY.unpack(value)[0] <= now]

    def expire_due(self) -> int:
        """Delete the artifacts whose pins have expired; returns how many."""
        due = self.due_expiries()
        return self.remove(due, pb.ChangeRecord.REASON_EXPIRED)[0] if due else 0


def _heir(txn, dbs, entries: list) -> bytes | None:
    """The artifact vouching now for the last chain page of a removed artifact (`entries`:
    its chain entries): it holds the same prefix, and takes over the reuse it earned."""
    return trust_index.voucher(txn, dbs, entries[-1][0]) if entries else None


def _usage_of(manifest: pb.Manifest, pinned: bool, last_used_ms: int, reused: int) -> Usage:
    sizes = page_sizes(manifest)
    return Usage(
        last_used_ms=last_used_ms,
        reused_tokens=reused,
        page_bytes=sum(sizes.values()),
        pinned=pinned,
        owner=owner_of(manifest.labels),
        conversation=is_conversation(manifest.labels),
    )


def usage_of_new(manifest: pb.Manifest, now_ms: int) -> Usage:
    """The usage of an artifact just committed."""
    return _usage_of(manifest, False, now_ms, 0)


def require_present(txn, dbs, aid: bytes, artifact_id: str):
    found = txn.get(aid, db=dbs["artifacts"])
    if found is None:
        raise NotFound(f"artifact {artifact_id} is not in the store (kvgraft ls lists them)")
    return decode_record(found)
