"""The store's pages: their bytes in segment files, their records in LMDB.

kvgraftd.store.artifact_store owns artifacts, references and the change log and calls this
module for pages. It owns the `page_locations` sub-database (record format:
kvgraftd.store.page_records), the segment files (kvgraftd.store.segments) and the
`segment_tail` and `page_bytes` meta keys.

Contract:
* `write(needed_bytes, file_bytes, body)` runs `body(txn)` in one LMDB write
  transaction (kvgraftd.store.lmdb_env) in which it may `append(txn, records)`:
  the appended bytes are durable before the transaction commits and cut off
  if it does not, so a record never names bytes that are not on disk. One
  append at a time.
* `new_pages(txn, sizes, records)`: which of a manifest's pages need writing;
  a page neither stored nor sent, or stored at another size, is refused
  (InvalidArgument) before anything is written.
* `drop(txn, digests)` removes pages' records and returns their locations;
  once that transaction has committed, `free(locations)` gives the space
  back (when no read that could still see the bytes is running). The
  `page_bytes` counter follows what is dropped, and what is appended
  (`count_bytes`: the caller counts the pages it wrote, staged ones too).
* Reads (`read_into`, `verified`, `read_framed`) read the pages into memory
  of the caller's or of their own (a guarded copy, never a view of a mapping:
  kvgraftd.store.segments) and check every page's xxh3-128, raising CorruptPage
  rather than hand out a corrupt byte; `unchecked` (a context) hands out each
  page's xxh3-128 with the page where it lies in its segment's mapping
  (InPlacePage: for the attention kernel, which checks it as it reads it under the
  native fault guard, kvgraftd.engine.model.decode_attention), or a copy where
  reads are not mapped; the pages' space is not given back before the `with`
  block ends. The other reads' copies are the caller's: no transaction or read of
  the store is held while it uses them.
* `open(format_version)` moves a format-1 store's pages into segments
  (kvgraftd.store.migration) and makes the segment files agree with the
  index (what a crash left half-done is cut off or given back).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import lmdb
import numpy as np

from kvgraft.errors import InvalidArgument
from kvgraftd.store import migration as store_migration
from kvgraftd.store import page_records
from kvgraftd.store.catalog import add_counter
from kvgraftd.store.lmdb_env import LmdbEnv
from kvgraftd.store.page_records import PageRecord, StoredPages, location_of
from kvgraftd.store.segments import Location, SegmentFiles, Tail

_TAIL = struct.Struct("<IQ")  # meta segment_tail: the committed end of the segments
PAGE_BYTES = b"page_bytes"  # meta: the bytes of every stored page (staged ones too)
T = TypeVar("T")


class PageStore:
    """The pages of the store whose LMDB environment is `env` (segments in `directory`)."""

    def __init__(self, env: LmdbEnv, directory: Path, *, segment_bytes: int) -> None:
        self._env = env
        self._db = env.db["page_locations"]
        self._refs = env.db["refs"]
        self._meta = env.db["meta"]
        self._segments = SegmentFiles(directory, segment_bytes=segment_bytes)
        self._appending = threading.Lock()

    def open(self, format_version: int) -> None:
        self._segments.open(self._tail(), self._live_locations())
        if format_version == 1:
            store_migration.migrate_v1(self._env, self.write, self.append)

    def close(self) -> None:
        self._segments.close()

    def _tail(self) -> Tail:
        with self._env.read() as txn:
            found = txn.get(b"segment_tail", db=self._meta)
            return Tail(*_TAIL.unpack(found)) if found is not None else Tail(1, 0)

    def _live_locations(self) -> list[Location]:
        with self._env.read() as txn:
            records = txn.cursor(db=self._db).iternext(keys=False, values=True)
            return [location_of(record) for record in records]

    # ------------------------------------------------------------------
    # writes

    def write(self, needed_bytes: int, file_bytes: int, body: Callable[[lmdb.Transaction], T]) -> T:
        """`body(txn)` in one write transaction; the segments follow its fate."""
        with self._appending:
            try:
                result = self._env.write(needed_bytes, body, file_bytes=file_bytes)
            except BaseException:
                self._segments.discard()
                raise
            self._segments.commit()
            return result

    def append(self, txn: lmdb.Transaction, records: Mapping[bytes, PageRecord]) -> None:
        """Write the records' bytes and their index records (inside `write`)."""
        if not records:
            return
        page_records.write_pages(self._stored(txn), records)
        txn.put(b"segment_tail", _TAIL.pack(*self._segments.pending), db=self._meta)

    def is_stored(self, txn: lmdb.Transaction, digest: bytes) -> bool:
        return txn.get(digest, db=self._db) is not None

    def new_pages(
        self, txn: lmdb.Transaction, sizes: Mapping[bytes, int], records: Mapping[bytes, PageRecord]
    ) -> dict[bytes, PageRecord]:
        """The records of the manifest's pages not stored yet; every other page must be."""
        new: dict[bytes, PageRecord] = {}
        for digest, size in sizes.items():
            found = txn.get(digest, db=self._db)
            if found is None:
                record = records.get(digest)
                if record is None:
                    raise InvalidArgument(
                        f"page {digest.hex()[:16]} is neither stored nor sent; ask MissingPages "
                        "and send every page it returns before the manifest"
                    )
                new[digest] = record
                continue
            # A hash names one byte string, so one size: a manifest naming a stored
            # page at another size would commit an artifact nobody can read back.
            length = location_of(found).length
            if length != size:
                raise InvalidArgument(
                    f"page {digest.hex()[:16]} is stored with {length} bytes; the manifest's "
                    f"layout needs {size}: fix the manifest's layout"
                )
        return new

    def drop(self, txn: lmdb.Transaction, digests: Iterable[bytes]) -> list[Location]:
        """Remove pages' records (`page_bytes` counted down once); the locations of those
        that had one, for `free` after the commit."""
        records = (txn.pop(digest, db=self._db) for digest in digests)
        locations = [location_of(record) for record in records if record is not None]
        self.count_bytes(txn, -sum(location.length for location in locations))
        return locations

    def count_bytes(self, txn: lmdb.Transaction, delta: int) -> None:
        """Pages of `delta` bytes were appended (or, negative, dropped) inside `txn`."""
        add_counter(txn, self._meta, PAGE_BYTES, delta)

    def free(self, locations: list[Location], defer: bool = False) -> None:
        self._segments.free(locations, defer)

    def give_back(self) -> None:
        self._segments.give_back()

    # ------------------------------------------------------------------
    # reads

    def missing(self, digests: Sequence[bytes]) -> list[bytes]:
        """The digests whose pages are not stored (staged pages count as stored)."""
        with self._env.read() as txn:
            cursor = txn.cursor(db=self._db)
            return [digest for digest in digests if not cursor.set_key(digest)]

    def disk_bytes(self) -> int:
        return self._segments.disk_bytes()

    def live_bytes(self) -> int:
        return self._segments.live_bytes()

    def count(self, txn: lmdb.Transaction) -> int:
        return txn.stat(self._db)["entries"]

    def read_into(self, digests: Sequence[bytes], dests: Sequence[np.ndarray]) -> None:
        with self._reading() as stored:
            page_records.read_into(stored, digests, dests)

    def verified(self, digests: Sequence[bytes]) -> list[np.ndarray]:
        with self._reading() as stored:
            return page_records.verified_copies(stored, digests)

    @contextmanager
    def unchecked(
        self, digests: Sequence[bytes]
    ) -> Iterator[list[tuple[bytes, page_records.InPlacePage | np.ndarray]]]:
        with self._segments.reading():  # an InPlacePage's mapping lasts as long as this
            with self._env.read() as txn:
                pages = page_records.unchecked_pages(self._stored(txn), digests)
            yield pages

    def read_framed(self, digests: Sequence[bytes], frame: page_records.Framer) -> bytes:
        with self._reading() as stored:
            return page_records.gather_framed(stored, digests, frame)

    @contextmanager
    def reading_index(self) -> Iterator[StoredPages]:
        """A read transaction of the index and the segments, whose pages keep their bytes
        inside."""
        with self._reading() as stored:
            yield stored

    @contextmanager
    def _reading(self) -> Iterator[StoredPages]:
        with self._segments.reading(), self._env.read() as txn:
            yield self._stored(txn)

    def _stored(self, txn: lmdb.Transaction) -> StoredPages:
        return StoredPages(txn, self._db, self._refs, self._segments)
