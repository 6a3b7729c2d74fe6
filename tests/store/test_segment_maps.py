"""Reads through guarded mappings (kvgraftd.store.segment_maps and its native module): the
same bytes, checks and errors as reads by pread, every build alike, and a fault caught only
where a guarded copy met it."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvgraft.errors import DataLoss
from kvgraftd.store import segment_maps
from kvgraftd.store.segment_maps import MAP_ALIGN, MappedSegmentReads
from kvgraftd.store.segment_reads import SegmentReads, UnreadPage
from kvgraftd.store.segments import Location, SegmentFiles, Tail
from tests.support import native_kernels

native = segment_maps._mapped_pages
if native is None:
    native_kernels.missing(
        "the store's guarded mappings (kvgraftd.store._mapped_pages) are not built"
    )
SIZES = (1, 63, 64, 4095, 16_391, 98_304, 200_001)  # in and past the 16 KiB pieces


def _pages(seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(size) for size in SIZES]


def test_every_build_copies_and_checks_the_same_bytes(tmp_path: Path) -> None:
    """Portable, AVX2 and AVX-512 (those this CPU runs), into destinations on and off the
    streamed stores' alignment: the copies are the pages, a right checksum passes, the
    first wrong one is named (every page before it copied whole), and no checksums only
    copies."""
    pages = _pages(1)
    path = tmp_path / "file"
    path.write_bytes(b"".join(pages))
    fd = os.open(path, os.O_RDONLY)
    address = native.map(fd, path.stat().st_size)
    sources, at = [], 0
    for page in pages:
        sources.append(address + at)
        at += len(page)
    sums = [xxhash.xxh3_128_digest(page) for page in pages]
    wrong = list(sums)
    wrong[4] = bytes(16)
    best = native.builds()[-1]
    try:
        for build in native.builds():
            native.select(build)
            for skew in (0, 1, 33):
                backing = bytearray(sum(len(p) + 64 for p in pages) + skew)
                dests, at = [], skew
                for page in pages:
                    dests.append(memoryview(backing)[at : at + len(page)])
                    at += len(page) + 64
                lengths = [len(page) for page in pages]
                assert native.copy_pages(sources, dests, lengths, b"".join(sums)) == (-1, 0)
                assert [bytes(dest) for dest in dests] == pages, (build, skew)
                for dest in dests:
                    dest[:] = bytes(len(dest))
                assert native.copy_pages(sources, dests, lengths, b"".join(wrong)) == (
                    4,
                    native.MISMATCH,
                )
                assert [bytes(dest) for dest in dests[:4]] == pages[:4]
                assert native.copy_pages(sources, dests, lengths, None) == (-1, 0)
                assert [bytes(dest) for dest in dests] == pages
        with pytest.raises(ValueError, match="shorter than its page"):
            native.copy_pages([sources[0]], [bytearray(0)], [1], None)
        with pytest.raises(BufferError):
            native.copy_pages([sources[0]], [b"x"], [1], None)  # not writable
    finally:
        native.select(best)
        native.unmap(address, path.stat().st_size)
        os.close(fd)


@pytest.mark.parametrize("reader", [SegmentReads, MappedSegmentReads])
def test_both_readers_read_check_and_fail_alike(tmp_path: Path, reader) -> None:
    """The pread reader and the mapped one: the same copies, the first page failing its
    checksum returned, a page past a cut named by UnreadPage with the pages before it
    whole, and a removed file still read through what was opened before."""
    files = SegmentFiles(tmp_path / "segments", segment_bytes=1 << 16)
    files.open(Tail(1, 0), [])
    pages = _pages(2)
    locations = files.append([memoryview(page) for page in pages])
    files.commit()
    files.close()
    reads = (
        reader(files._path)
        if reader is SegmentReads
        else MappedSegmentReads(files._path, map_bytes=1 << 16)
    )
    try:
        sums = [xxhash.xxh3_128_digest(page) for page in pages]
        copies = [np.zeros(len(page), np.uint8) for page in pages]
        assert reads.read(locations, copies, sums) is None
        assert [copy.tobytes() for copy in copies] == pages
        assert reads.read(locations, copies, [*sums[:3], bytes(16), *sums[4:]]) == 3
        assert reads.read_bytes(locations[5]) == pages[5]

        os.truncate(files._path(1), locations[5].offset + 10)
        copies = [np.zeros(len(page), np.uint8) for page in pages]
        with pytest.raises(UnreadPage, match="cut short") as lost:
            reads.read(locations, copies, sums)
        assert lost.value.index == 5
        assert [copy.tobytes() for copy in copies[:5]] == pages[:5]
        with pytest.raises(DataLoss, match="cut short"):
            reads.read_bytes(locations[6])
        os.unlink(files._path(1))
        assert reads.read_bytes(locations[2]) == pages[2]
        reads.forget(1)
        with pytest.raises(UnreadPage, match="missing"):
            reads.read(locations[:1], copies[:1])
    finally:
        reads.close()


def test_a_segment_read_past_its_mapping_is_mapped_again(tmp_path: Path) -> None:
    """A segment that grows past the mapping made at its first read (the active one) is
    mapped again, longer; the pages read through the first mapping still read."""
    path = tmp_path / "00000001.seg"
    first = random.Random(3).randbytes(4096)
    path.write_bytes(first)
    reads = MappedSegmentReads(lambda segment: path, map_bytes=MAP_ALIGN)
    try:
        assert reads.read_bytes(Location(1, 0, 4096)) == first
        later = random.Random(4).randbytes(MAP_ALIGN)
        with open(path, "ab") as file:
            file.write(later)
        assert reads.read_bytes(Location(1, 4096, MAP_ALIGN)) == later
        assert reads.read_bytes(Location(1, 0, 4096)) == first
    finally:
        reads.close()


SIGBUS_ELSEWHERE = """
import os, signal, sys
from kvgraftd.store.segment_maps import MappedSegmentReads
from kvgraftd.store.segments import Location
path = sys.argv[1]
reads = MappedSegmentReads(lambda segment: path, map_bytes=0)
assert reads.read_bytes(Location(1, 0, 4)) == b"page"  # the guard's handler is installed
print("read", flush=True)
os.kill(os.getpid(), signal.SIGBUS)
print("survived", flush=True)
"""


@pytest.mark.parametrize("faulthandler", [False, True])
def test_a_bus_error_outside_a_guarded_copy_still_ends_the_process(
    tmp_path: Path, faulthandler: bool
) -> None:
    """The guard catches only a fault of its own copy: any other SIGBUS goes to the handler
    that was there before (Python's faulthandler, which prints, or the default action)."""
    path = tmp_path / "00000001.seg"
    path.write_bytes(b"page")
    flags = ["-X", "faulthandler"] if faulthandler else []
    done = subprocess.run(
        [sys.executable, *flags, "-c", SIGBUS_ELSEWHERE, str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.stdout == "read\n" and done.returncode == -signal.SIGBUS, done
    assert ("Bus error" in done.stderr) is faulthandler, done.stderr


def test_a_read_copies_the_pages_before_one_whose_segment_is_missing(tmp_path: Path) -> None:
    """Regression (review): the mapped reader mapped every page's segment before copying
    any, so a missing second segment left the first page unread, against the contract
    that the pages before the one named are whole."""
    first = random.Random(5).randbytes(5000)
    (tmp_path / "00000001.seg").write_bytes(first)
    reads = MappedSegmentReads(lambda segment: tmp_path / f"{segment:08d}.seg", map_bytes=0)
    try:
        copies = [bytearray(5000), bytearray(10)]
        with pytest.raises(UnreadPage, match="missing") as lost:
            reads.read([Location(1, 0, 5000), Location(2, 0, 10)], copies)
        assert lost.value.index == 1 and bytes(copies[0]) == first
    finally:
        reads.close()
