"""The Linux file calls that Python's os module lacks, for the segment files.

Contract:
* `punch_hole(fd, offset, length)` gives the blocks of a byte range back to
  the filesystem (reads of it return zeros; the file keeps its size). On a
  filesystem that cannot punch holes it logs once and does nothing after;
  any other failure raises OSError.
* `start_writeback(fd, offset, length)` asks the kernel to start writing a
  range of the page cache to the device now (a hint: never fails).
* `opened(path, flags)`: a descriptor closed when the block ends;
  `sync_directory(path)` makes the directory's entries durable.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
_libc.sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
_SYNC_FILE_RANGE_WRITE = 0x02
_punch_refused = False


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Give `length` bytes at `offset` back to the filesystem (reads of them return zeros)."""
    global _punch_refused
    if _punch_refused or length <= 0:
        return
    mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
    if _libc.fallocate(fd, mode, offset, length) != 0:
        code = ctypes.get_errno()
        if code not in (errno.EOPNOTSUPP, errno.ENOSYS):
            raise OSError(code, os.strerror(code))
        _punch_refused = True
        log.warning("this filesystem cannot punch holes: freed page space is given back "
                    "only when a whole segment empties")  # fmt: skip


def punch_spans(path: Path, spans: list[tuple[int, int]]) -> None:
    """Punch out the (offset, length) spans of a file, neighbours as one range (one call
    per run: an eviction frees runs of pages written one after another)."""
    ranges: list[list[int]] = []
    for offset, length in sorted(spans):
        if ranges and ranges[-1][1] == offset:
            ranges[-1][1] = offset + length
        else:
            ranges.append([offset, offset + length])
    with opened(path) as fd:
        for start, end in ranges:
            punch_hole(fd, start, end - start)


def punch_gaps(path: Path, spans: list[tuple[int, int]], end: int | None) -> None:
    """Punch out what lies outside the sorted (offset, length) spans, up to `end` (None:
    the file's size)."""
    with opened(path) as fd:
        at = 0
        for offset, length in spans:
            if offset > at:
                punch_hole(fd, at, offset - at)
            at = max(at, offset + length)
        size = os.fstat(fd).st_size if end is None else end
        if size > at:
            punch_hole(fd, at, size - at)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Hand the range to the device now, not at the fdatasync (the disk works while
    the next piece is copied: about 1.5x the throughput of write-then-sync here)."""
    _libc.sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # a hint: errors ignored


@contextmanager
def opened(path: Path, flags: int = os.O_WRONLY) -> Iterator[int]:
    fd = os.open(path, flags)
    try:
        yield fd
    finally:
        os.close(fd)


def sync_directory(directory: Path) -> None:
    with opened(directory, os.O_RDONLY) as fd:
        os.fsync(fd)
