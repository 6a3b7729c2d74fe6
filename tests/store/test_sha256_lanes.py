"""kvgraftd.store.sha256_lanes: every digest is hashlib's, whatever the lengths, counts and
buffers."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import numpy as np
import pytest

from kvgraftd.store import sha256_lanes
from kvgraftd.store.sha256_lanes import LANES, sha256_digests

# Lengths around the padding's edges (55/56: one tail block or two) and a page.
LENGTHS = [1, 3, 55, 56, 57, 63, 64, 65, 119, 120, 127, 128, 129, 1000, 4096, 98_304]


def _cpu_has_avx512() -> bool:
    """What the kernels' AVX-512 build needs (engine/native/cpu_features.h), asked of Linux."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return {"avx512f", "avx512dq", "avx512bw", "avx512vl", "fma", "bmi2"} <= flags


@pytest.fixture
def every_group_native(monkeypatch):
    """Send every group of equal lengths to the kernel, even a group of one."""
    if not sha256_lanes.available():
        pytest.skip("the 16-lane kernel does not run here")
    monkeypatch.setattr(sha256_lanes, "MIN_LANES_USED", 1)


def test_the_kernel_runs_where_the_cpu_has_avx512() -> None:
    """A capable machine must not fall back to hashlib silently (a failed build would)."""
    if not _cpu_has_avx512():
        pytest.skip("this CPU has no AVX-512")
    assert sha256_lanes.available()


@pytest.mark.parametrize("length", LENGTHS)
def test_each_length_in_every_lane_count(length: int, every_group_native) -> None:
    rng = random.Random(length)
    pages = [rng.randbytes(length) for _ in range(LANES + 1)]
    expected = [hashlib.sha256(page).digest() for page in pages]
    for count in range(1, LANES + 2):
        assert sha256_digests(pages[:count]) == expected[:count], count


def test_mixed_lengths_and_buffers_keep_their_order(every_group_native) -> None:
    """Groups form by length; digests come back in the caller's order, for any buffer type."""
    rng = random.Random(7)
    pages: list[object] = []
    for index in range(60):
        data = rng.randbytes(rng.choice([64, 100, 98_304]))
        kind = index % 4
        if kind == 1:
            data = memoryview(data)
        elif kind == 2:
            data = np.frombuffer(data, np.uint8)
        elif kind == 3:  # an unaligned view into a larger array
            backing = np.frombuffer(b"\x00" + data + b"\x00", np.uint8)
            data = backing[1:-1]
        pages.append(data)
    assert sha256_digests(pages) == [hashlib.sha256(page).digest() for page in pages]


def test_a_flipped_byte_changes_its_own_lane_only(every_group_native) -> None:
    rng = random.Random(3)
    pages = [bytearray(rng.randbytes(98_304)) for _ in range(LANES)]
    before = sha256_digests(pages)
    pages[9][50_000] ^= 0x10
    after = sha256_digests(pages)
    assert [i for i in range(LANES) if before[i] != after[i]] == [9]
    assert after[9] == hashlib.sha256(pages[9]).digest()


@pytest.mark.parametrize("native", [True, False])
def test_copies_hold_the_bytes_hashed(native: bool, monkeypatch) -> None:
    """With copies, each page lands in its own array, in the kernel and in the fallback."""
    if native and not sha256_lanes.available():
        pytest.skip("the 16-lane kernel does not run here")
    monkeypatch.setattr(sha256_lanes, "MIN_LANES_USED", 1 if native else LANES + 1)
    rng = random.Random(11)
    pages = [rng.randbytes(length) for length in [98_304] * 13 + [100, 100, 7]]
    copies = [np.full(len(page), 0xEE, np.uint8) for page in pages]
    digests = sha256_digests(pages, copies)
    assert digests == [hashlib.sha256(page).digest() for page in pages]
    assert [bytes(copy) for copy in copies] == pages


def test_copies_must_fit_and_be_writable() -> None:
    page = b"x" * 64
    with pytest.raises(ValueError, match="writable contiguous"):
        sha256_digests([page], [np.empty(63, np.uint8)])
    with pytest.raises(ValueError, match="writable contiguous"):
        sha256_digests([page], [np.frombuffer(bytes(64), np.uint8)])  # read-only


def test_empty_pages_and_small_groups_go_to_hashlib() -> None:
    """Every path, native or not, gives hashlib's digests (the default threshold here)."""
    rng = random.Random(5)
    pages = [b"", *(rng.randbytes(4096) for _ in range(LANES + 3)), b""]
    assert sha256_digests(pages) == [hashlib.sha256(page).digest() for page in pages]
