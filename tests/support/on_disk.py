"""What a store keeps on disk, for tests that look at or damage it directly.

A store (format 2) is an LMDB index (`data.mdb`) and segment files
(`segments/*.seg`) holding the page bytes; see kvgraftd.store.segments.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path


def segment_files(store_dir: Path) -> list[Path]:
    return sorted((store_dir / "segments").glob("*.seg"))


def flip_stored_page(store_dir: Path, page: bytes, at: int = 7) -> int:
    """Flip one bit of every stored copy of `page`, in place on disk; returns the copies."""
    probe = bytes(page[len(page) // 2 : len(page) // 2 + 64])
    flipped = 0
    for path in segment_files(store_dir):
        if not path.stat().st_size:
            continue
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            offsets, start = [], view.find(probe)
            while start != -1:
                offsets.append(start)
                start = view.find(probe, start + 1)
        fd = os.open(path, os.O_RDWR)
        try:
            for offset in offsets:
                byte = os.pread(fd, 1, offset + at)
                os.pwrite(fd, bytes([byte[0] ^ 0x40]), offset + at)
        finally:
            os.close(fd)
        flipped += len(offsets)
    return flipped
