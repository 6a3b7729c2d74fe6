"""Pages that no longer hash to their names, and the artifacts holding them.

`Quarantine` is a part the Store holds (kvgraftd.store.artifact_store: it offers the
public methods below as its own) over the store's LMDB environment and pages.
kvgraftd.store.scrub reads every page with `hash_batch` and hands the corrupt ones
to `quarantine`; so does every read that finds one (`ReadQuarantine`, below: the
Store's `read_quarantine`).

Contract:
* `hash_batch(after, limit)` recomputes the SHA-256 of up to `limit` stored
  pages (staged ones included) after the key `after`, in key order, inside one
  read transaction, and returns the digests whose bytes do not hash to them.
* `quarantine(digests)` in one write transaction: every artifact naming one
  of them is recorded in the `quarantine` sub-database (and its change-feed
  status stays: it is still stored), leaves the chain index (no prefix reuse
  through it), and is refused by grafts and exports with DataLoss; the corrupt
  pages' records are dropped (their bytes freed) while their reference counts
  stay, so MissingPages lists them and a good copy (a replica, a pull, the
  remote tier) sends them again.
* A commit of a quarantined artifact (`repair_in`, from commit_artifact)
  writes the pages it brings; every quarantined artifact whose pages are all
  stored again leaves the quarantine and, if trusted, re-enters the chain index.
* A read that finds a page corrupt or unreadable (CorruptPage, inside
  `quarantining_corrupt`) reports it: the quarantine is written on a thread
  of its own (the reader may be the compute thread, and the write may wait
  behind a commit), and `reads.settled()` waits for every report so far.
  `check_servable` and a lease (Store.reading) wait for it, and refuse an
  artifact quarantined by then, so a request that starts once a read failed
  never grafts the same pages.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import lmdb
import numpy as np

from kvgraft.artifact import page_sizes
from kvgraft.errors import DataLoss
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store import catalog, staging, trust_index
from kvgraftd.store.catalog import decode_record
from kvgraftd.store.lmdb_env import LmdbEnv
from kvgraftd.store.page_records import INDEX_RECORD, CorruptPage
from kvgraftd.store.page_store import PageStore
from kvgraftd.store.segments import Location

log = logging.getLogger(__name__)

_WHEN = struct.Struct("<q")
QUARANTINE_DATABASES = ("quarantine",)


class ReadQuarantine:
    """Pages reads found corrupt, quarantined on a thread of its own (see the contract).
    `pages` and `artifacts` count what reads found and quarantined since start."""

    def __init__(self, quarantine: Callable[[list[bytes]], tuple[list[str], list[str]]]) -> None:
        self._quarantine = quarantine
        self._changed = threading.Condition()
        self._reported: set[bytes] = set()  # not quarantined yet (some being, on the thread)
        self._running = False
        self.pages = 0
        self.artifacts = 0

    def report(self, digest: bytes) -> None:
        with self._changed:
            if digest in self._reported:  # other reads of it, before its quarantine
                return
            self._reported.add(digest)
            self.pages += 1
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="read-quarantine", daemon=True).start()
        log.error("event=corrupt_page_read page=%s", digest.hex())

    def settled(self) -> None:
        """Wait until every page reported so far is quarantined (or failed to be)."""
        with self._changed:
            while self._running:
                self._changed.wait()

    def _run(self) -> None:
        done: set[bytes] = set()
        while True:
            with self._changed:
                self._reported -= done
                digests = sorted(self._reported)
                if not digests:
                    self._running = False
                    self._changed.notify_all()
                    return
            try:
                _, new = self._quarantine(digests)
            except Exception as exc:  # the next read, or the next scrub, finds them again
                log.error("could not quarantine the artifacts holding corrupt pages: %s", exc)
                new = []
            done = set(digests)
            with self._changed:
                self.artifacts += len(new)


class Quarantine:
    """The quarantine of the store whose environment is `env` and pages `pages`; `reads`
    quarantines what reads find corrupt."""

    def __init__(self, env: LmdbEnv, pages: PageStore) -> None:
        self._db, self._read, self._write = env.db, env.read, env.write
        self._pages = pages
        self.reads = ReadQuarantine(self.quarantine_pages)

    @contextmanager
    def quarantining_corrupt(self) -> Iterator[None]:
        """Around a read: a page found corrupt inside is reported (see the contract)."""
        try:
            yield
        except CorruptPage as corrupt:
            self.reads.report(corrupt.digest)
            raise

    def hash_batch(self, after: bytes, limit: int) -> tuple[bytes, int, int, list[bytes]]:
        """(last key read, pages, bytes, corrupt digests) of up to `limit` pages after `after`."""
        corrupt: list[bytes] = []
        last, pages, size = after, 0, 0
        buffer = np.empty(0, np.uint8)
        with self._pages.reading_index() as stored:
            cursor = stored.txn.cursor(db=self._db["page_locations"])
            found = cursor.set_range(after) if after else cursor.first()
            while found and pages < limit:
                key = bytes(cursor.key())
                if key == after:
                    found = cursor.next()
                    continue
                _, segment, offset, length = INDEX_RECORD.unpack(cursor.value())
                if buffer.nbytes < length:
                    buffer = np.empty(length, np.uint8)
                data = buffer[:length]
                try:
                    stored.segments.read([Location(segment, offset, length)], [data])
                    intact = hashlib.sha256(data).digest() == key
                except DataLoss:  # the segment is short, missing or unreadable
                    intact = False
                if not intact:
                    corrupt.append(key)
                last, pages, size = key, pages + 1, size + length
                found = cursor.next()
        return last, pages, size, corrupt

    def quarantine(self, digests: list[bytes]) -> list[str]:
        """Quarantine the artifacts holding `digests` (see the contract); their ids."""
        return self.quarantine_pages(digests)[0]

    def quarantine_pages(self, digests: list[bytes]) -> tuple[list[str], list[str]]:
        """`quarantine`: (ids of the artifacts holding `digests`, those quarantined now)."""
        bad = set(digests)
        if not bad:
            return [], []

        def body(txn: lmdb.Transaction) -> tuple[list[str], list[str], list[Location]]:
            held: list[str] = []
            new: list[str] = []
            for key, value in txn.cursor(db=self._db["artifacts"]):
                record = bytes(value)
                # a manifest holds each page hash as is: most records are passed over unparsed
                if not any(digest in record for digest in bad):
                    continue
                manifest = decode_record(record).manifest()
                if bad.isdisjoint(manifest.page_sha256):
                    continue
                aid = bytes(key)
                held.append(aid.hex())
                if txn.get(aid, db=self._db["quarantine"]) is None:
                    trust_index.withdraw_vouchers(txn, self._db, aid, manifest)
                    txn.put(aid, _WHEN.pack(catalog.now_ms()), db=self._db["quarantine"])
                    new.append(aid.hex())
            freed = self._pages.drop(txn, bad)
            for digest in bad:
                if txn.get(digest, db=self._db["refs"]) is None:
                    staging.unstage(txn, self._db, digest)  # a staged page: just gone
            return held, new, freed

        held, new, freed = self._write(0, body)
        self._pages.free(freed)
        for aid in new:
            log.error("event=artifact_quarantined artifact_id=%s", aid)
        return held, new

    def is_quarantined(self, artifact_id: str) -> bool:
        with self._read() as txn:
            aid = catalog.parse_full_id(artifact_id)
            return txn.get(aid, db=self._db["quarantine"]) is not None

    def quarantined_ids(self) -> list[str]:
        with self._read() as txn:
            cursor = txn.cursor(db=self._db["quarantine"])
            return [bytes(key).hex() for key in cursor.iternext(values=False)]

    def check_servable(self, artifact_id: str) -> None:
        """DataLoss for a quarantined artifact: its bytes are not all there (quarantines
        reads found under way are waited for)."""
        self.reads.settled()
        if self.is_quarantined(artifact_id):
            raise DataLoss(
                f"artifact {artifact_id[:16]} is quarantined: a read or a scrub found a page "
                "of it corrupt. Repair it from a good copy (kvgraft replicate from a replica, or "
                "kvgraft remote sync --pull), or delete it"
            )

    def repair_in(self, txn, aid: bytes, manifest: pb.Manifest, records) -> tuple[int, int]:
        """Inside commit_artifact's transaction: write the pages a quarantined artifact's
        repair brings and lift every quarantine now whole. (pages, bytes) written."""
        sizes = page_sizes(manifest)
        new = {
            digest: record
            for digest, record in records.items()
            if digest in sizes and not self._pages.is_stored(txn, digest)
        }
        self._pages.append(txn, new)
        for digest in sizes:  # pages of the repair staged by its upload: claimed now
            staging.unstage(txn, self._db, digest)
        written = sum(len(record.data) for record in new.values())
        self._pages.count_bytes(txn, written)
        for key in list(txn.cursor(db=self._db["quarantine"]).iternext(values=False)):
            held = bytes(key)
            record = decode_record(txn.get(held, db=self._db["artifacts"]))
            held_manifest = record.manifest()
            if all(self._pages.is_stored(txn, d) for d in page_sizes(held_manifest)):
                txn.delete(held, db=self._db["quarantine"])
                if trust_index.is_trusted(trust_index.read(txn, self._db, held)):
                    trust_index.vouch(txn, self._db, held, held_manifest)
                log.warning("event=artifact_repaired artifact_id=%s", held.hex())
        return len(new), written
