"""Stored pages: their index records and verified reads.

A page's bytes lie in a segment file (kvgraftd.store.segments); its record in the
`page_locations` sub-database, keyed by the page's SHA-256, is

    xxh3-128 of the bytes (16 bytes) || segment u32 || offset u64 || length u64

SHA-256 names the page everywhere (manifests, the wire, dedup); the xxh3-128
is checked on every read, after the bytes are copied out of the segment's
mapping (or in place, for a caller that reads the mapping directly), because
it costs a fraction of SHA-256 and catches what the disk or a stray write can
do to a page. A mismatch raises DataLoss and no byte of the page reaches the
caller: `read_into` zeroes its destinations, `verified_views` hands out no
view, `verify_framed` fails before the joined bytes are handed on.

A page on its way in is a `PageRecord`: a view of its bytes and its
xxh3-128, or None where the checksum is left to `write_pages`, which then
computes it right before the page's bytes are written (the page is read once
from memory for both, and while the disk writes what came before).
`write_pages` appends the bytes of a batch and puts their records.

Functions of a `StoredPages` (a transaction, the index and the segments);
kvgraftd.store.artifact_store owns the transactions and reads inside `segments.reading()`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import lmdb
import numpy as np

from kvgraft.errors import DataLoss, NotFound
from kvgraft.page_buffers import block_aligned
from kvgraft.page_checks import first_mismatch, split_pages, xxh3_128
from kvgraftd.store.segments import Location, SegmentFiles

INDEX_RECORD = struct.Struct("<16sIQQ")  # xxh3-128, segment, offset, length
INDEX_BYTES_PER_PAGE = 256  # what a page's records cost LMDB, with room to spare

Buffer = bytes | bytearray | memoryview | np.ndarray  # a page's bytes, C-contiguous

# frame(index, sha256, xxh3, size) -> the bytes that precede a page (gather_framed)
Framer = Callable[[int, bytes, bytes, int], bytes]
# what verify_framed checks: (sha256, xxh3, offset in the joined bytes, size) per page
FramedChecks = list[tuple[bytes, bytes, int, int]]


class PageRecord(NamedTuple):
    """A page ready to store: its xxh3-128 (None: computed as it is written) and
    its bytes, a view (not a copy).

    Whoever made it keeps the bytes unchanged until they are stored (a byte
    changed in between would be stored under a checksum it fails: caught on
    every read, never served).
    """

    checksum: bytes | None
    data: memoryview


def page_record(data: Buffer) -> PageRecord:
    """A page's record: its xxh3-128 and a byte view of `data` (C-contiguous)."""
    view = memoryview(data).cast("B")
    return PageRecord(xxh3_128(view), view)


def page_records_of(pages: Mapping[bytes, Buffer]) -> dict[bytes, PageRecord]:
    """Records of pages in memory, their checksums left to `write_pages`."""
    return {digest: PageRecord(None, memoryview(data).cast("B")) for digest, data in pages.items()}


def location_of(record: bytes | memoryview) -> Location:
    """The location an index record names."""
    return Location(*INDEX_RECORD.unpack(record)[1:])


class StoredPages(NamedTuple):
    """The pages an index transaction sees, with the segments that hold their bytes."""

    txn: lmdb.Transaction
    db: object
    segments: SegmentFiles

    def pages(self, digests: Sequence[bytes]) -> list[tuple[bytes, memoryview]]:
        """(xxh3-128, bytes not yet verified) of each stored page.

        The per-page cost of every read (~2 us of Python for a lookup and a
        view, against ~8 us to copy a 98 KB page): kept to the bare calls.
        """
        get, db, unpack, view = self.txn.get, self.db, INDEX_RECORD.unpack, self.segments.view
        found: list[tuple[bytes, memoryview]] = []
        for digest in digests:
            record = get(digest, db=db)
            if record is None:
                raise NotFound(f"page {digest.hex()[:16]} is not in the store")
            checksum, segment, offset, length = unpack(record)
            found.append((checksum, view(segment, offset, length)))
        return found


def write_needs(records: Iterable[PageRecord]) -> tuple[int, int]:
    """(bytes of the index, bytes of the segments) that writing `records` takes."""
    sizes = [len(record.data) for record in records]
    return INDEX_BYTES_PER_PAGE * len(sizes), sum(block_aligned(size) for size in sizes)


def write_pages(stored: StoredPages, records: Mapping[bytes, PageRecord]) -> None:
    """Append the records' bytes to the segments and put their index records.

    The bytes are durable when this returns; they belong to the store once
    the transaction commits and the caller commits the segments.
    """
    checksums = [record.checksum for record in records.values()]
    pages = [record.data for record in records.values()]

    def checksum(index: int) -> None:  # right before the page is written, overlapping the disk
        if checksums[index] is None:
            checksums[index] = xxh3_128(pages[index])

    locations = stored.segments.append(pages, checksum)
    for digest, checksum, location in zip(records, checksums, locations, strict=True):
        stored.txn.put(digest, INDEX_RECORD.pack(checksum, *location), db=stored.db)


def read_into(stored: StoredPages, digests: Sequence[bytes], dests: Sequence[np.ndarray]) -> None:
    """Copy each page into its uint8 destination and verify it there (runs side by side)."""
    pages = stored.pages(digests)
    for digest, (_, data), dest in zip(digests, pages, dests, strict=True):
        if len(data) != dest.nbytes:
            raise DataLoss(f"page {digest.hex()[:16]} has the wrong size in the store")

    def copy_and_check(lo: int, hi: int) -> int | None:
        # each page checked right after its copy, while it is still in cache
        for index in range(lo, hi):
            (checksum, data), dest = pages[index], dests[index]
            dest[:] = np.frombuffer(data, np.uint8)
            if xxh3_128(dest) != checksum:
                return index
        return None

    bad = split_pages(len(pages), sum(d.nbytes for d in dests), copy_and_check)
    if bad is not None:
        for dest in dests:
            dest[:] = 0  # never leave corrupt bytes where a caller may look
        raise DataLoss(corrupt_message(digests[bad]))


def verified_views(stored: StoredPages, digests: Sequence[bytes]) -> list[np.ndarray]:
    """Each page as a read-only uint8 view of its segment, checked in place (side by side).

    No copy: one read of the bytes, for the check. The views stay valid bytes
    while the read (`segments.reading()`) they were made in lasts.
    """
    pages = stored.pages(digests)
    views = [np.frombuffer(data, np.uint8) for _, data in pages]
    bad = first_mismatch(views, [checksum for checksum, _ in pages])
    if bad is not None:
        raise DataLoss(corrupt_message(digests[bad]))
    return views


def gather_framed(
    stored: StoredPages, digests: Sequence[bytes], frame: Framer
) -> tuple[bytes, FramedChecks]:
    """frame(0, ...) + page 0 + frame(1, ...) + page 1 + ... in one copy, not yet verified."""
    parts: list[bytes | memoryview] = []
    checks: FramedChecks = []
    offset = 0
    for index, (digest, (checksum, data)) in enumerate(
        zip(digests, stored.pages(digests), strict=True)
    ):
        prefix = frame(index, digest, checksum, len(data))
        parts += (prefix, data)
        offset += len(prefix)
        checks.append((digest, checksum, offset, len(data)))
        offset += len(data)
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
