"""Stored pages: their index records and verified reads.

A page's bytes lie in a segment file (kvgraftd.store.segments); its record in the
`page_locations` sub-database, keyed by the page's SHA-256, is

    xxh3-128 of the bytes (16 bytes) || segment u32 || offset u64 || length u64

SHA-256 names the page everywhere (manifests, the wire, dedup); the xxh3-128
is checked on every read, as the bytes are copied into memory of the
caller's (kvgraftd.store.segments), because it costs a fraction of
SHA-256 and catches what the disk or a stray write can do to a page. A page
that fails it, or whose segment cannot give its bytes (cut short, removed,
unreadable), raises CorruptPage (a DataLoss naming the page) and no byte of
it reaches the caller: `read_into` zeroes its destinations, `verified_copies`
and `gather_framed` hand out nothing. A page whose record was dropped while
artifacts still hold it (kvgraftd.store.quarantine) reads as DataLoss too.

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

from kvgraft.errors import DataLoss, KvgraftError, NotFound
from kvgraft.page_buffers import aligned_empty, block_aligned, page_slots
from kvgraft.page_checks import pipelined_pages, xxh3_128
from kvgraftd.store.segment_reads import UnreadPage
from kvgraftd.store.segments import Location, SegmentFiles

INDEX_RECORD = struct.Struct("<16sIQQ")  # xxh3-128, segment, offset, length
INDEX_BYTES_PER_PAGE = 256  # what a page's records cost LMDB, with room to spare
PAGE_BYTES_GUESS = 64 << 10  # a page's size before its record is read (for splitting work)

Buffer = bytes | bytearray | memoryview | np.ndarray  # a page's bytes, C-contiguous

# frame(index, sha256, xxh3, size) -> the bytes that precede a page (gather_framed)
Framer = Callable[[int, bytes, bytes, int], bytes]
Located = list[tuple[bytes, Location]]  # (xxh3-128, location) of each page read


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


class CorruptPage(DataLoss):
    """A stored page whose bytes fail their checksum or cannot be read: `digest` names it
    (the store quarantines the artifacts holding it)."""

    def __init__(self, digest: bytes, why: str = "") -> None:
        super().__init__(why or corrupt_message(digest))
        self.digest = digest


class StoredPages(NamedTuple):
    """The pages an index transaction sees, with the segments that hold their bytes."""

    txn: lmdb.Transaction
    db: object
    refs: object  # the refs sub-database: a page held by artifacts but not stored was lost
    segments: SegmentFiles

    def locate(self, digests: Sequence[bytes]) -> Located:
        """(xxh3-128, location) of each stored page; kept to the bare calls (a hot path)."""
        get, db, unpack = self.txn.get, self.db, INDEX_RECORD.unpack
        found: list[tuple[bytes, Location]] = []
        for digest in digests:
            record = get(digest, db=db)
            if record is None:
                raise self._absent(digest)
            checksum, segment, offset, length = unpack(record)
            found.append((checksum, Location(segment, offset, length)))
        return found

    def read(
        self, digests: Sequence[bytes], located: Located, dests: Sequence[Buffer], check: bool
    ) -> int | None:
        """Copy pages into `dests`, each checked against its xxh3-128 where `check`: the index
        of the first page that fails it, or None; CorruptPage for the first one its segment
        cannot give whole."""
        try:
            return self.segments.read(
                [location for _, location in located],
                dests,
                [checksum for checksum, _ in located] if check else None,
            )
        except UnreadPage as lost:
            raise _unreadable(digests[lost.index], lost) from None

    def _absent(self, digest: bytes) -> KvgraftError:
        if self.txn.get(digest, db=self.refs) is not None:
            return DataLoss(
                f"page {digest.hex()[:16]} was found corrupt on disk and dropped; the "
                "artifacts holding it are quarantined until a good copy repairs them "
                "(kvgraft replicate from a replica, or kvgraft remote sync --pull)"
            )
        return NotFound(f"page {digest.hex()[:16]} is not in the store")


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
    """Read each page into its uint8 destination and verify it there (runs side by side)."""

    def sized(lo: int, located: Located) -> Sequence[np.ndarray]:
        for index, (_, location) in enumerate(located, lo):
            if location.length != dests[index].nbytes:
                raise DataLoss(f"page {digests[index].hex()[:16]} has the wrong size in the store")
        return dests[lo : lo + len(located)]

    _read_checked(stored, digests, sized, dests[0].nbytes if dests else 0)


def verified_copies(stored: StoredPages, digests: Sequence[bytes]) -> list[np.ndarray]:
    """Each page read into an array of its own and verified there (read-only: a caller may
    keep it as it is, e.g. the host cache). The arrays of a few MiB of pages read together
    are slots of one pooled buffer (kvgraft.page_buffers: reused memory, no faults), which
    goes back to the pool once none of them is referenced."""

    def slots(lo: int, located: Located) -> Sequence[np.ndarray]:
        sizes = {index: location.length for index, (_, location) in enumerate(located)}
        return list(page_slots(sizes).values())

    copies = _read_checked(stored, digests, slots, 0)
    for copy in copies:
        copy.flags.writeable = False
    return copies


def _read_checked(
    stored: StoredPages,
    digests: Sequence[bytes],
    dests_of: Callable[[int, Located], Sequence[np.ndarray]],
    page_bytes: int,
) -> list[np.ndarray]:
    """Locate the pages piece by piece and copy each piece, checked, into `dests_of(lo,
    located)` (the destinations of pages lo, lo + 1, ...) on the page-check pool while the
    next piece is located (the index's lookups take a fifth of a read's time: overlapped,
    not added). The destinations; where a page fails, every destination is zeroed and the
    page's CorruptPage raised."""
    count = len(digests)
    located: Located = [None] * count  # type: ignore[list-item]
    dests: list[np.ndarray] = [None] * count  # type: ignore[list-item]
    unread: dict[int, CorruptPage] = {}

    def locate(lo: int, hi: int) -> None:
        located[lo:hi] = stored.locate(digests[lo:hi])
        dests[lo:hi] = dests_of(lo, located[lo:hi])

    def read_and_check(lo: int, hi: int) -> int | None:
        # each page checked as it is copied (or right after, while it is still in cache)
        try:
            bad = stored.read(digests[lo:hi], located[lo:hi], dests[lo:hi], check=True)
        except CorruptPage as lost:
            first_unread = digests.index(lost.digest, lo, hi)  # those before: read whole
            unread[first_unread] = lost
            return first_unread
        return None if bad is None else lo + bad

    try:
        bad = pipelined_pages(count, page_bytes or PAGE_BYTES_GUESS, locate, read_and_check)
    except BaseException:
        _zero(dests)
        raise
    if bad is not None:
        _zero(dests)
        raise unread.get(bad) or CorruptPage(digests[bad])
    return dests


def _zero(dests: Sequence[np.ndarray | None]) -> None:
    for dest in dests:  # never leave corrupt bytes where a caller may look
        if dest is not None and dest.flags.writeable:
            dest[:] = 0


class InPlacePage(NamedTuple):
    """A stored page where it lies in its segment's mapping: for guarded native code only
    (the attention kernel), while the read that handed it out lasts; never a view."""

    address: int
    nbytes: int


def unchecked_pages(
    stored: StoredPages, digests: Sequence[bytes]
) -> list[tuple[bytes, InPlacePage | np.ndarray]]:
    """(xxh3-128, bytes not yet verified) of each page, for a caller that checks them as
    it reads them: where the segments are mapped, each page where it lies (InPlacePage:
    no copy); else copies in one pooled buffer of their own (kvgraft.page_buffers: reused
    memory, no faults)."""
    located = stored.locate(digests)
    try:
        addresses = stored.segments.addresses([location for _, location in located])
    except UnreadPage as lost:  # its segment is missing or cannot be mapped
        raise _unreadable(digests[lost.index], lost) from None
    if addresses is not None:
        return [
            (checksum, InPlacePage(address, location.length))
            for (checksum, location), address in zip(located, addresses, strict=True)
        ]
    buffer = aligned_empty(sum(location.length for _, location in located))
    copies, at = [], 0
    for _, location in located:
        copies.append(buffer[at : at + location.length])
        at += location.length
    stored.read(digests, located, copies, check=False)
    return [(checksum, copy) for (checksum, _), copy in zip(located, copies, strict=True)]


def gather_framed(stored: StoredPages, digests: Sequence[bytes], frame: Framer) -> bytes:
    """frame(0, ...) + page 0 + frame(1, ...) + page 1 + ..., every page verified as read."""
    located = stored.locate(digests)
    frames = [
        frame(index, digest, checksum, location.length)
        for index, (digest, (checksum, location)) in enumerate(zip(digests, located, strict=True))
    ]
    buffer = bytearray(sum(map(len, frames)) + sum(location.length for _, location in located))
    view, slots, at = memoryview(buffer), [], 0
    for framing, (_, location) in zip(frames, located, strict=True):
        view[at : at + len(framing)] = framing
        at += len(framing)
        slots.append(view[at : at + location.length])
        at += location.length
    bad = stored.read(digests, located, slots, check=True)
    if bad is not None:
        raise CorruptPage(digests[bad])
    return bytes(buffer)


def unreadable_page(digest: bytes) -> CorruptPage:
    """What a page read where it lies (InPlacePage) but not whole raises: its segment was
    cut short or could not be read."""
    return CorruptPage(
        digest,
        f"page {digest.hex()[:16]} could not be read from its segment file (cut short or "
        f"unreadable: the disk may be failing). {QUARANTINED}",
    )


def corrupt_message(digest: bytes) -> str:
    return (
        f"page {digest.hex()[:16]} is corrupt on disk (checksum mismatch); it was not served. "
        f"{QUARANTINED}"
    )


QUARANTINED = (
    "The artifacts holding it are quarantined: retry, and what they held is computed "
    "afresh; a good copy repairs them (kvgraft replicate, kvgraft remote sync --pull)."
)


def _unreadable(digest: bytes, lost: DataLoss) -> CorruptPage:
    return CorruptPage(digest, f"page {digest.hex()[:16]} was not served: {lost} {QUARANTINED}")
