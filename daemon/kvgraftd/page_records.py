"""Stored pages: their record format and verified reads out of an LMDB transaction.

A page is stored as one value of the `pages` sub-database:

    xxh3-128 of the bytes (16 bytes) || the page bytes

keyed by the page's SHA-256. SHA-256 names the page everywhere (manifests,
the wire, dedup); the xxh3-128 beside it is checked on every read, after the
bytes are copied out of the map (or in place, for a caller that reads the
map directly), because it costs a fraction of SHA-256 and catches what the
disk or the map can do to a page. A mismatch raises DataLoss and no byte of
the page reaches the caller: `read_into` zeroes its destinations,
`verified_views` hands out no view, `verify_framed` fails before the joined
bytes are handed on.

A page on its way in is a `PageRecord`: its xxh3-128 and a view of its
bytes, not yet joined. `RecordWriter` lays the two side by side in one
scratch buffer right before LMDB copies the value into its own pages, so a
written page costs one copy of its bytes in memory (LMDB's), where a joined
record made ahead of the write cost an allocation and a copy more (about
0.5 s per GB here, as much as the rest of the in-memory work together).

Functions of a transaction; kvgraftd.store owns the transactions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import lmdb
import numpy as np

from kvgraft.errors import DataLoss, NotFound
from kvgraft.page_checks import first_mismatch, split_pages, xxh3_128

PAGE_CHECKSUM_BYTES = 16  # xxh3-128 ahead of each stored page

Buffer = bytes | bytearray | memoryview | np.ndarray  # a page's bytes, C-contiguous

# frame(index, sha256, xxh3, size) -> the bytes that precede a page (gather_framed)
Framer = Callable[[int, bytes, bytes, int], bytes]
# what verify_framed checks: (sha256, xxh3, offset in the joined bytes, size) per page
FramedChecks = list[tuple[bytes, bytes, int, int]]


class PageRecord(NamedTuple):
    """A page ready to store: its xxh3-128 and its bytes, a view (not a copy).

    Whoever made it keeps the bytes unchanged until they are stored (a byte
    changed in between would be stored under a checksum it fails: caught on
    every read, never served).
    """

    checksum: bytes
    data: memoryview


def page_record(data: Buffer) -> PageRecord:
    """A page's record: its xxh3-128 and a byte view of `data` (C-contiguous)."""
    view = memoryview(data).cast("B")
    return PageRecord(xxh3_128(view), view)


def page_records_of(pages: Mapping[bytes, Buffer]) -> dict[bytes, PageRecord]:
    """`page_record` of every page, checksummed side by side (kvgraft.page_checks)."""
    items = list(pages.items())
    records: list[PageRecord | None] = [None] * len(items)

    def checksum(lo: int, hi: int) -> None:
        for index in range(lo, hi):
            records[index] = page_record(items[index][1])

    split_pages(len(items), sum(memoryview(data).nbytes for _, data in items), checksum)
    return {digest: record for (digest, _), record in zip(items, records, strict=True)}


class RecordWriter:
    """Puts records into a pages database as values `xxh3-128 || bytes`, one copy each.

    The scratch buffer is reused for every put and kept up to
    `KEPT_SCRATCH_BYTES` (a larger page gets one of its own, let go after
    the put); callers serialize on it (the store's write lock does).
    """

    KEPT_SCRATCH_BYTES = 4 << 20

    def __init__(self) -> None:
        self._scratch = bytearray()

    def put(
        self, txn: lmdb.Transaction, db, digest: bytes, record: PageRecord, overwrite: bool = True
    ) -> bool:
        """txn.put of the record's stored form; False where it exists and not `overwrite`."""
        size = PAGE_CHECKSUM_BYTES + len(record.data)
        scratch = self._scratch
        if len(scratch) < size:
            scratch = bytearray(size)
            if size <= self.KEPT_SCRATCH_BYTES:
                self._scratch = scratch
        with memoryview(scratch)[:size] as value:
            value[:PAGE_CHECKSUM_BYTES] = record.checksum
            value[PAGE_CHECKSUM_BYTES:] = record.data
            return txn.put(digest, value, db=db, overwrite=overwrite)  # LMDB copies it now


def read_into(
    txn: lmdb.Transaction, db, digests: Sequence[bytes], dests: Sequence[np.ndarray]
) -> None:
    """Copy each page into its uint8 destination and verify it there (runs side by side)."""
    records = [_record(txn, db, digest) for digest in digests]
    for digest, record, dest in zip(digests, records, dests, strict=True):
        if len(record) - PAGE_CHECKSUM_BYTES != dest.nbytes:
            raise DataLoss(f"page {digest.hex()[:16]} has the wrong size in the store")

    def copy_and_check(lo: int, hi: int) -> int | None:
        # each page checked right after its copy, while it is still in cache
        for index in range(lo, hi):
            record, dest = records[index], dests[index]
            dest[:] = np.frombuffer(record, np.uint8, offset=PAGE_CHECKSUM_BYTES)
            if xxh3_128(dest) != record[:PAGE_CHECKSUM_BYTES]:
                return index
        return None

    bad = split_pages(len(records), sum(d.nbytes for d in dests), copy_and_check)
    if bad is not None:
        for dest in dests:
            dest[:] = 0  # never leave corrupt bytes where a caller may look
        raise DataLoss(corrupt_message(digests[bad]))


def verified_views(txn: lmdb.Transaction, db, digests: Sequence[bytes]) -> list[np.ndarray]:
    """Each page as a read-only uint8 view of the map, checked in place (runs side by side).

    No copy: one read of the bytes, for the check. The views are valid while
    `txn` is open.
    """
    records = [_record(txn, db, digest) for digest in digests]
    views = [np.frombuffer(record, np.uint8, offset=PAGE_CHECKSUM_BYTES) for record in records]
    bad = first_mismatch(views, [record[:PAGE_CHECKSUM_BYTES] for record in records])
    if bad is not None:
        raise DataLoss(corrupt_message(digests[bad]))
    return views


def gather_framed(
    txn: lmdb.Transaction, db, digests: Sequence[bytes], frame: Framer
) -> tuple[bytes, FramedChecks]:
    """frame(0, ...) + page 0 + frame(1, ...) + page 1 + ... in one copy, not yet verified."""
    parts: list[bytes | memoryview] = []
    checks: FramedChecks = []
    offset = 0
    for index, digest in enumerate(digests):
        view = _record(txn, db, digest)
        checksum = bytes(view[:PAGE_CHECKSUM_BYTES])
        size = len(view) - PAGE_CHECKSUM_BYTES
        prefix = frame(index, digest, checksum, size)
        parts += (prefix, view[PAGE_CHECKSUM_BYTES:])
        offset += len(prefix)
        checks.append((digest, checksum, offset, size))
        offset += size
    return b"".join(parts), checks


def verify_framed(joined: bytes, checks: FramedChecks) -> None:
    """Check every page of gather_framed's copy (outside the transaction)."""
    out = memoryview(joined)
    pages = [out[start : start + size] for _, _, start, size in checks]
    bad = first_mismatch(pages, [expected for _, expected, _, _ in checks])
    if bad is not None:
        raise DataLoss(corrupt_message(checks[bad][0]))


def corrupt_message(digest: bytes) -> str:
    return (
        f"page {digest.hex()[:16]} is corrupt on disk (checksum mismatch); it was not served. "
        "Restore the store from a replica or re-deposit the artifact."
    )


def _record(txn: lmdb.Transaction, db, digest: bytes) -> memoryview:
    record = txn.get(digest, db=db)
    if record is None:
        raise NotFound(f"page {digest.hex()[:16]} is not in the store")
    return memoryview(record)
