"""Page buffers: the pages of an artifact in one block-aligned allocation.

Where pages are received or made (Client.get_artifact, the daemon's gRPC
intake and its engine's deposits), each gets a slot of one buffer per
artifact, every slot starting on a 4 KiB block:

* the daemon writes a page that starts on a block to disk from where it
  lies, with direct I/O (kvgraftd.direct_io), instead of copying it through
  the page cache;
* one large allocation is faulted in by huge pages (NumPy advises them for
  large arrays), where a buffer per page or per message costs a fault per
  4 KiB page and is handed back to the kernel when freed, to be faulted in
  again by the next (store_bench: about half the time of a GetArtifact).

Contract: `aligned_empty(nbytes)` is a writable uint8 array whose data starts
on a `BLOCK_BYTES` boundary (contents undefined); `page_slots(sizes)` maps
each page (SHA-256 -> size) to its own uint8 array of that size, all in one
allocation, each starting on a block. Slots stay valid while any is referenced.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

BLOCK_BYTES = 4096  # >= the logical block size of every filesystem the daemon writes to


def aligned_empty(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + BLOCK_BYTES, np.uint8)
    skip = -raw.ctypes.data % BLOCK_BYTES
    return raw[skip : skip + nbytes]


def block_aligned(count: int) -> int:
    return -(-count // BLOCK_BYTES) * BLOCK_BYTES


def page_slots(sizes: Mapping[bytes, int]) -> dict[bytes, np.ndarray]:
    buffer = aligned_empty(sum(block_aligned(size) for size in sizes.values()))
    slots, at = {}, 0
    for digest, size in sizes.items():
        slots[digest] = buffer[at : at + size]
        at += block_aligned(size)
    return slots
