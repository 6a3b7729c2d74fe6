"""Page bytes read out of segment files: pread into the reader's memory, never a mapping.

A read through a shared mapping of bytes the file no longer has (a segment cut
short under the daemon) or that the disk cannot give (EIO; on tmpfs, a hole
while the filesystem is full) is SIGBUS, which kills the process. pread turns
the first into a short read and the others into an error, so a damaged store
fails the reads of what it damaged, never the daemon. The price is one copy
where the mapping was read in place (docs/architecture.md, "The store").

Contract:
* `SegmentReads(path_of)` reads the file `path_of(segment)` of each segment,
  keeping one descriptor per segment read; `forget(segment)` closes it (the
  segment is being removed) and `close()` closes them all. Thread-safe.
* A location is (segment, offset, length) (kvgraftd.store.segments.Location).
  `read(locations, dests, checksums=None)` copies each page into its buffer,
  one preadv for each run of neighbours (pages lie at 4 KiB-aligned offsets:
  the padding between two is read and dropped), and given its xxh3-128 checks
  it there; it returns the index of the first page that fails its check, or
  None. Where a file lacks a page's bytes or the disk cannot read them it
  raises UnreadPage (a DataLoss) naming the first page not read whole, by its
  index in `locations`; the pages before it in their buffers are whole.
  kvgraftd.store.segment_maps reads the same way through mappings, where its
  native part was built.
* `read_bytes(location)` is one page's bytes (DataLoss where it cannot be read
  whole).
* Only what says the bytes are gone (EIO and its kin, a missing file, a file
  cut short) is DataLoss: the store quarantines what a DataLoss names and drops
  its pages. Any other error of the system (no descriptor left: EMFILE, ENFILE;
  no memory) damages nothing: it fails the read (ResourceExhausted) and no more.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from kvgraft.errors import DataLoss, ResourceExhausted
from kvgraft.page_buffers import BLOCK_BYTES, block_aligned
from kvgraft.page_checks import xxh3_128

IOV_MAX = 1024
READ_RUN_BYTES = 64 << 20  # read by one preadv at most: far below what one read may return
WritableBuffer = bytearray | memoryview  # or any object exposing a writable buffer
Location = tuple[int, int, int]  # segment, offset, length
_GAP = memoryview(bytearray(BLOCK_BYTES))  # where reads drop the padding between pages
# errors that say a segment's bytes cannot be had: the disk, or the filesystem, lost them
_GONE = frozenset({errno.EIO, errno.ENXIO, errno.ENODATA, errno.EBADMSG, errno.EUCLEAN})
_SHORT_OF = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})  # the process's, not the disk's


class UnreadPage(DataLoss):
    """`read` could not read page `index` of its list whole."""

    def __init__(self, index: int, why: str) -> None:
        super().__init__(why)
        self.index = index


class SegmentReads:
    def __init__(self, path_of: Callable[[int], Path]) -> None:
        self._path_of = path_of
        self._fds: dict[int, int] = {}  # segment -> descriptor opened for reads
        self._lock = threading.Lock()

    def read(
        self,
        locations: Sequence[Location],
        dests: Sequence[WritableBuffer],
        checksums: Sequence[bytes] | None = None,
    ) -> int | None:
        """Copy each page into its buffer and, given `checksums`, check it there; the index
        of the first page that fails its check (those after it are not to be used), or
        None."""
        index = 0
        while index < len(locations):
            run = _run(locations, index)
            pieces: list[memoryview] = []
            for at in range(index, run):
                length = locations[at][2]
                pieces.append(memoryview(dests[at]).cast("B")[:length])
                gap = block_aligned(length) - length
                if at + 1 < run and gap:
                    pieces.append(_GAP[:gap])
            segment, offset, _ = locations[index]
            try:
                got = os.preadv(self._fd(segment), pieces, offset)
            except OSError as exc:
                self._not_damage(locations[index], exc)
                raise UnreadPage(index, self._unreadable(locations[index], exc)) from None
            for at in range(index, run):  # the first page the file did not give whole
                if got < locations[at][1] + locations[at][2] - offset:
                    raise UnreadPage(at, self._cut_short(locations[at]))
                if checksums is not None and xxh3_128(dests[at]) != checksums[at]:
                    return at  # checked while it is still in cache
            index = run
        return None

    def read_bytes(self, location: Location) -> bytes:
        """One page's bytes; DataLoss where it cannot be read whole."""
        segment, offset, length = location
        try:
            data = os.pread(self._fd(segment), length, offset)
        except OSError as exc:
            self._not_damage(location, exc)
            raise DataLoss(self._unreadable(location, exc)) from None
        if len(data) < length:
            raise DataLoss(self._cut_short(location))
        return data

    def forget(self, segment: int) -> None:
        with self._lock:
            fd = self._fds.pop(segment, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def _fd(self, segment: int) -> int:
        fd = self._fds.get(segment)
        if fd is not None:
            return fd
        with self._lock:
            fd = self._fds.get(segment)
            if fd is None:
                fd = self._fds[segment] = os.open(
                    self._path_of(segment), os.O_RDONLY | os.O_CLOEXEC
                )
            return fd

    def _not_damage(self, location: Location, exc: OSError) -> None:
        """Raise what `exc` is where it does not say the segment's bytes are gone (see the
        contract); return where it does."""
        if isinstance(exc, FileNotFoundError) or exc.errno in _GONE:
            return
        if exc.errno in _SHORT_OF:
            raise ResourceExhausted(
                f"segment file {self._path_of(location[0])} could not be read ({exc.strerror}): "
                "the daemon is short of file descriptors or memory, the store is intact. Retry; "
                "raise the daemon's open-files limit (LimitNOFILE) if it recurs"
            ) from exc
        raise exc

    def _unreadable(self, location: Location, exc: OSError) -> str:
        segment, offset, _ = location
        if isinstance(exc, FileNotFoundError):
            return f"segment file {self._path_of(segment)} is missing."
        return (
            f"segment file {self._path_of(segment)} could not be read at offset {offset} "
            f"({exc.strerror}): the disk may be failing."
        )

    def _cut_short(self, location: Location) -> str:
        # a pread of a regular file returns less than asked only at the file's end
        segment, offset, length = location
        return (
            f"segment file {self._path_of(segment)} ends before the page at offset {offset} "
            f"({length} bytes): the file was cut short."
        )


def _run(locations: Sequence[Location], index: int) -> int:
    """The end of the run of neighbours in one segment from `index` (one preadv: at most
    IOV_MAX pieces and READ_RUN_BYTES)."""
    end, size = index + 1, locations[index][2]
    while end < len(locations) and end - index < IOV_MAX // 2:
        (segment, offset, length), (before_segment, before_offset, before_length) = (
            locations[end],
            locations[end - 1],
        )
        padded = block_aligned(before_length)
        if segment != before_segment or offset != before_offset + padded:
            break
        if size + padded - before_length + length > READ_RUN_BYTES:
            break
        size += padded - before_length + length
        end += 1
    return end
