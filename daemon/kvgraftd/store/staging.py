"""Staged pages: the pages of uploads not finished yet, kept on disk for a resume.

Sub-database `staged` (inside the store's transactions): page SHA-256 -> u64 unix
ms when staged || u64 the disk it takes (whole 4 KiB blocks). Format-2 stores
kept only the time (8 bytes); such entries count nothing on the way out.
The meta counter `staged_bytes` is the disk all staged pages take; `stage`
refuses, writing nothing, pages that would take it past the daemon's limit, so
an upload of many tiny pages cannot fill the disk (a 4-byte page takes 4 KiB).

Staged pages are outside the store's budget: what the budget counts is the
segments' live bytes less the staged ones (`budgeted_bytes`), so uploads that
never send their manifest cannot make the store evict an artifact; they are
bounded apart (`staged_max_bytes` here, per connection and in memory:
kvgraftd.store.upload_limits). A commit that claims staged pages brings them
into the budget, so it counts them as incoming (`staged_disk_of`).

A staged page is staged no more when an artifact claims it (kvgraftd.store.artifact_store's
reference count) or when it is collected, `staged_ttl_s` after it was staged,
unless an upload still in progress staged it (`uploading`): a slow upload of a
large artifact keeps its pages for as long as it may run (the daemon's max_call_s
from its start), not longer.

`Staging` is a part the Store holds (kvgraftd.store.artifact_store: it offers
`stage_pages`, `uploading` and `collect_staged` as its own) over the store's LMDB
environment and pages.

Collecting must stay cheap: it takes `_staging_lock`, which every read of the budgeted
bytes takes too. It skips the scan of `staged` while no page can be due (a lower bound of
the oldest staged time, kept in memory), and removes what is due in transactions of
COLLECT_BATCH pages, letting the lock go between them.
"""

from __future__ import annotations

import logging
import math
import struct
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import lmdb

from kvgraft.errors import ResourceExhausted
from kvgraft.page_buffers import block_aligned
from kvgraftd.store.catalog import add_counter, counter, now_ms
from kvgraftd.store.lmdb_env import LmdbEnv
from kvgraftd.store.page_records import PageRecord, write_needs
from kvgraftd.store.page_store import PageStore
from kvgraftd.store.segments import Location

log = logging.getLogger(__name__)

_STAGED = struct.Struct("<QQ")  # when a page was staged (unix ms), the disk it takes
_U64 = struct.Struct("<Q")
STAGED_BYTES = b"staged_bytes"
COLLECT_BATCH = 4096  # staged pages one collecting transaction removes (the lock held)


def stage(
    txn: lmdb.Transaction,
    dbs,
    pages: PageStore,
    records: Mapping[bytes, PageRecord],
    limit_bytes: int,
) -> dict[bytes, PageRecord]:
    """Append the records not stored yet and mark them staged; returns them. Refused
    (ResourceExhausted) when they would take the staged disk past `limit_bytes` (0: none)."""
    new = {d: r for d, r in records.items() if not pages.is_stored(txn, d)}
    disk = {d: block_aligned(len(r.data)) for d, r in new.items()}
    staged = counter(txn, dbs["meta"], STAGED_BYTES)
    if limit_bytes and staged + sum(disk.values()) > limit_bytes:
        raise ResourceExhausted(
            f"pages of unfinished uploads take {staged} bytes of disk; these "
            f"{sum(disk.values())} would pass the daemon's limit (staged_max_bytes = "
            f"{limit_bytes}): finish or abandon uploads, or wait for staged_ttl_s"
        )
    pages.append(txn, new)
    now = now_ms()
    for digest in new:
        txn.put(digest, _STAGED.pack(now, disk[digest]), db=dbs["staged"])
    add_counter(txn, dbs["meta"], STAGED_BYTES, sum(disk.values()))
    return new


def unstage(txn: lmdb.Transaction, dbs, digest: bytes) -> None:
    """A page is staged no more (claimed or collected): its disk leaves the count."""
    found = txn.pop(digest, db=dbs["staged"])
    if found is not None and len(found) == _STAGED.size:
        add_counter(txn, dbs["meta"], STAGED_BYTES, -_STAGED.unpack(found)[1])


def staged_before(txn: lmdb.Transaction, dbs, unix_ms: int) -> tuple[list[bytes], float]:
    """The pages staged at or before `unix_ms`, and when the oldest of the others was
    staged (inf: none)."""
    due, rest_ms = [], math.inf
    for key, value in txn.cursor(db=dbs["staged"]):
        at = _U64.unpack(value[:8])[0]
        if at <= unix_ms:
            due.append(bytes(key))
        else:
            rest_ms = min(rest_ms, at)
    return due, rest_ms


class Staging:
    """The staged pages of the store whose environment is `env` and pages `pages`."""

    def __init__(self, env: LmdbEnv, pages: PageStore) -> None:
        self._db, self._read, self._write = env.db, env.read, env.write
        self._pages = pages
        # Held by a collection from its commit until its pages' space is freed, and by
        # every read of the budgeted bytes: in between, the staged count no longer holds
        # those pages while the live bytes still do (the budget would see an artifact's).
        self._staging_lock = threading.Lock()
        # uploads in progress: their pages, and until when (unix ms) they keep them
        self._uploading: dict[int, tuple[Mapping[bytes, object], float]] = {}
        self._collecting = threading.Lock()  # one collection at a time
        self._oldest_lock = threading.Lock()
        # No staged page is older (unix ms; None: unknown, a scan finds out). A collection
        # sets it from its scan and the pages staged while it ran (`_staged_meanwhile_ms`).
        self._oldest_staged_ms: float | None = None
        self._staged_meanwhile_ms = math.inf
        self.staged_scans = 0  # scans of `staged` by collections (tests read it)

    def stage_pages(self, records: Mapping[bytes, PageRecord], limit_bytes: int = 0) -> int:
        """Persist received pages ahead of their manifest; returns pages written. All staged
        pages together stay within `limit_bytes` of disk (0: no limit; kvgraftd.store.staging)."""

        staged_at = now_ms()  # no later than the time stage() records

        def body(txn: lmdb.Transaction) -> int:
            new = stage(txn, self._db, self._pages, records, limit_bytes)
            self._pages.count_bytes(txn, sum(len(record.data) for record in new.values()))
            return len(new)

        written = self._pages.write(*write_needs(records.values()), body)
        # After the commit: a collection whose scan began before it learns of it here.
        with self._oldest_lock:
            if self._oldest_staged_ms is not None:
                self._oldest_staged_ms = min(self._oldest_staged_ms, staged_at)
            self._staged_meanwhile_ms = min(self._staged_meanwhile_ms, staged_at)
        return written

    @contextmanager
    def uploading(self, staged: Mapping[bytes, object], for_s: float = math.inf) -> Iterator[None]:
        """While it runs, and for at most `for_s` from now, no collection takes a page in
        `staged` (an upload's pages, which it keeps adding to), however long ago it was
        staged."""
        with self._staging_lock:
            self._uploading[id(staged)] = (staged, now_ms() + for_s * 1000)
        try:
            yield
        finally:
            with self._staging_lock:
                del self._uploading[id(staged)]

    def collect_staged(self, older_than_s: float) -> int:
        """Delete staged pages older than `older_than_s` that nothing references and no
        upload in progress staged. On a full disk (the index cannot be written) it logs so
        and leaves them to the next call."""
        with self._collecting:
            limit = now_ms() - int(older_than_s * 1000)
            with self._oldest_lock:
                if self._oldest_staged_ms is not None and self._oldest_staged_ms > limit:
                    return 0  # nothing can be due: no scan
                self._staged_meanwhile_ms = math.inf
            self.staged_scans += 1
            with self._read() as txn:
                due, rest_ms = staged_before(txn, self._db, limit)
            now = now_ms()
            with self._staging_lock:  # the union of the running uploads' pages, once
                running = [pages for pages, until in self._uploading.values() if until > now]
                kept = set().union(*running)
            collectable = [digest for digest in due if digest not in kept]
            if len(collectable) < len(due):  # a running upload's: due again next time
                rest_ms = min(rest_ms, limit)
            due = collectable
            collected = 0
            for start in range(0, len(due), COLLECT_BATCH):
                done = self._collect_batch(due[start : start + COLLECT_BATCH], limit)
                if done is None:  # the index could not be written: a next call tries again
                    rest_ms = -math.inf
                    break
                collected += done
            with self._oldest_lock:
                oldest = min(rest_ms, self._staged_meanwhile_ms)
                self._oldest_staged_ms = None if oldest == -math.inf else oldest
        if collected:
            log.info("collected %d staged pages older than %.0f s", collected, older_than_s)
        return collected

    def _collect_batch(self, due: list[bytes], limit: int) -> int | None:
        """Remove the staged pages `due` (staged at or before `limit`) in one transaction,
        under the lock the budget's readers take; how many, or None on a full disk."""

        def body(txn: lmdb.Transaction) -> tuple[int, list[Location]]:
            doomed = []
            for digest in due:
                found = txn.get(digest, db=self._db["staged"])  # claimed or staged again?
                if found is not None and _U64.unpack(found[:8])[0] <= limit:
                    unstage(txn, self._db, digest)
                    doomed.append(digest)
            # one claimed by an artifact since is kept
            unclaimed = [d for d in doomed if txn.get(d, db=self._db["refs"]) is None]
            return len(doomed), self._pages.drop(txn, unclaimed)

        with self._staging_lock:
            try:
                collected, freed = self._write(0, body)
            except ResourceExhausted as exc:  # the daemon's housekeeping goes on
                log.warning("staged pages not collected this time: %s", exc)
                return None
            self._pages.free(freed)
        return collected

    def budgeted_bytes(self) -> int:
        """What the store's budget counts: the bytes of the segments' live pages less the
        staged ones (kvgraftd.store.eviction)."""
        with self._staging_lock:
            live = self._pages.live_bytes()  # first: a page staged meanwhile is then left out
            with self._read() as txn:
                staged = counter(txn, self._db["meta"], STAGED_BYTES)
        return max(0, live - staged)

    def staged_disk_of(self, digests: Iterable[bytes]) -> int:
        """The disk those of `digests` that are staged take: a commit claiming them brings
        them into the budget."""
        with self._read() as txn:
            if not counter(txn, self._db["meta"], STAGED_BYTES):
                return 0
            found = (txn.get(digest, db=self._db["staged"]) for digest in digests)
            return sum(
                _STAGED.unpack(v)[1] for v in found if v is not None and len(v) == _STAGED.size
            )
