"""Direct I/O: page bytes handed to the device from their own buffers, past the page cache.

A buffered append copies every page into the page cache and the kernel
writes the cache out later; with O_DIRECT the device reads the caller's
buffer itself, so a durable append costs one pass over the bytes (their
checksum) and no cache pages to allocate, fill and reclaim (store_bench:
the device takes ~3.5 GB/s this way against 1.3-2.5 buffered here, and the
buffered figure swings with the VM's page reporting, bench/README.md).

O_DIRECT wants every buffer address, file offset and length aligned to the
filesystem's block. Segments keep every page at a `BLOCK_BYTES`-aligned
offset already; a page whose buffer starts on a block boundary is written
from where it lies, and only its last partial block (if any) is copied into
a zero-padded block. Producers that can (the engine's deposits, the gRPC
intake) put pages in block-aligned slots for this (kvgraft.page_buffers).

Contract:
* `is_aligned(view)`: whether a page can be written from where it lies.
* `open_direct(path)`: a write descriptor with O_DIRECT, or None where the
  filesystem refuses it (tmpfs): the caller then writes buffered.
* `direct_pieces(page, tails)`: the block-aligned pieces that write `page`
  followed by zeros up to the next block (its tail copied into `tails`).
* `pwritev_all(fd, pieces, offset)`: every piece written, whatever the
  short writes (buffered or direct).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from kvgraft.page_buffers import BLOCK_BYTES


def is_aligned(view: memoryview) -> bool:
    return np.frombuffer(view, np.uint8).ctypes.data % BLOCK_BYTES == 0


def open_direct(path: Path) -> int | None:
    try:
        return os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError:  # EINVAL: this filesystem does not do direct I/O
        return None


class TailBlocks:
    """Zero-padded blocks for the last partial block of each page of one append."""

    def __init__(self, count: int) -> None:
        self._arena = memoryview(mmap.mmap(-1, max(count, 1) * BLOCK_BYTES))  # zeros, aligned
        self._used = 0

    def take(self, data: memoryview) -> memoryview:
        block = self._arena[self._used : self._used + BLOCK_BYTES]
        self._used += BLOCK_BYTES
        block[: len(data)] = data
        return block


def direct_pieces(page: memoryview, tails: TailBlocks) -> list[memoryview]:
    """`page` as pieces O_DIRECT can write: its whole blocks in place, its tail padded."""
    whole = len(page) - len(page) % BLOCK_BYTES
    pieces = [page[:whole]] if whole else []
    if whole < len(page):
        pieces.append(tails.take(page[whole:]))
    return pieces


def pwritev_all(fd: int, pieces: list[memoryview], offset: int) -> None:
    """os.pwritev of every piece, again for whatever a short write left."""
    while pieces:
        written = os.pwritev(fd, pieces, offset)
        offset += written
        while pieces and written >= len(pieces[0]):
            written -= len(pieces[0])
            pieces = pieces[1:]
        if pieces and written:
            pieces = [pieces[0][written:], *pieces[1:]]
