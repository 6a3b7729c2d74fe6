"""Page buffers: the pages of an artifact in one block-aligned allocation.

Where pages are received or made (Client.get_artifact, the daemon's gRPC
intake and its engine's deposits), each gets a slot of one buffer per
artifact (or message), every slot starting on a 4 KiB block:

* the daemon writes a page that starts on a block to disk from where it
  lies, with direct I/O (kvgraftd.store.direct_io), instead of copying it through
  the page cache;
* buffers are anonymous mappings advised to use huge pages, and a buffer
  nothing references any more goes back to a small pool (`POOL_BYTES`) for
  the next artifact: fresh memory costs a fault and a zeroing of every page
  (the kernel's clear_page was a fifth of a GetArtifact's CPU in a perf
  profile), reused memory neither.

Contract: `aligned_empty(nbytes)` is a writable uint8 array whose data starts
on a `BLOCK_BYTES` boundary (contents undefined: a reused buffer holds old
bytes); `page_slots(sizes)` maps each page (SHA-256 -> size) to its own uint8
array of that size, all in one such buffer, each starting on a block, and
`slot_copies(pages)` fills such slots with copies of the pages. A buffer is
reused only once no slot or view of it is referenced. Thread-safe.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections.abc import Hashable, Mapping
from typing import TypeVar

import numpy as np

BLOCK_BYTES = 4096  # >= the logical block size of every filesystem the daemon writes to
HUGE_PAGE_BYTES = 2 << 20  # buffers are sized in huge pages
POOL_BYTES = 256 << 20  # idle buffers kept for reuse, at most

Key = TypeVar("Key", bound=Hashable)  # what names a page: its SHA-256, or its index
_pool: list[mmap.mmap] = []  # idle buffers, smallest first
_pool_lock = threading.Lock()


def aligned_empty(nbytes: int) -> np.ndarray:
    mapping = _take(-(-max(nbytes, 1) // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES)
    array = np.frombuffer(mapping, np.uint8)  # mmap memory starts on a page
    # views of `array` keep it alive: this runs once the last one is gone
    weakref.finalize(array, _give_back, mapping).atexit = False
    return array[:nbytes]


def block_aligned(count: int) -> int:
    return -(-count // BLOCK_BYTES) * BLOCK_BYTES


def page_slots(sizes: Mapping[Key, int]) -> dict[Key, np.ndarray]:
    buffer = aligned_empty(sum(block_aligned(size) for size in sizes.values()))
    slots, at = {}, 0
    for digest, size in sizes.items():
        slots[digest] = buffer[at : at + size]
        at += block_aligned(size)
    return slots


def slot_copies(pages: Mapping[bytes, bytes | memoryview | np.ndarray]) -> dict[bytes, np.ndarray]:
    """Each page copied into its slot (`page_slots` of their sizes)."""
    views = {digest: memoryview(data).cast("B") for digest, data in pages.items()}
    slots = page_slots({digest: len(view) for digest, view in views.items()})
    for digest, slot in slots.items():
        slot[:] = np.frombuffer(views[digest], np.uint8)
    return slots


def _take(nbytes: int) -> mmap.mmap:
    with _pool_lock:
        for index, mapping in enumerate(_pool):
            if nbytes <= len(mapping) <= 2 * nbytes:
                return _pool.pop(index)
    mapping = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return mapping


def _give_back(mapping: mmap.mmap) -> None:
    with _pool_lock:
        _pool.append(mapping)
        _pool.sort(key=len)
        while sum(len(m) for m in _pool) > POOL_BYTES:
            # the largest first; unmapped once the dying array's export is released
            _pool.pop()
