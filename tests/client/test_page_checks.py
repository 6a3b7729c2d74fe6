"""kvgraft.page_checks: the first bad page of a batch, found on one thread or several."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvgraft import page_checks

PAGE_BYTES = 98_304  # one page of the default model's geometry


def _pages(count: int, seed: int = 0) -> tuple[list[np.ndarray], list[bytes]]:
    data = np.random.default_rng(seed).integers(0, 256, count * PAGE_BYTES, dtype=np.uint8)
    pages = [data[i * PAGE_BYTES : (i + 1) * PAGE_BYTES] for i in range(count)]
    return pages, [xxhash.xxh3_128_digest(page) for page in pages]


@pytest.mark.parametrize("count", [1, 3, 200])  # 200 pages: past PARALLEL_MIN_BYTES
def test_intact_pages_have_no_mismatch(count: int) -> None:
    pages, checksums = _pages(count)
    assert page_checks.first_mismatch(pages, checksums) is None


@pytest.mark.parametrize("bad", [[0], [199], [150, 7], [100, 101]])
def test_the_first_bad_page_is_named_whichever_run_finds_it(bad: list[int]) -> None:
    pages, checksums = _pages(200)
    assert 200 * PAGE_BYTES >= page_checks.PARALLEL_MIN_BYTES  # the batch is split
    for index in bad:
        pages[index][PAGE_BYTES // 2] ^= 1
    assert page_checks.first_mismatch(pages, checksums) == min(bad)


def test_split_pages_covers_every_page_once() -> None:
    seen: list[int] = []

    def work(lo: int, hi: int) -> None:
        seen.extend(range(lo, hi))

    assert page_checks.split_pages(1001, page_checks.PARALLEL_MIN_BYTES, work) is None
    assert sorted(seen) == list(range(1001))


def test_a_failing_run_still_waits_for_the_others() -> None:
    finished: list[int] = []

    def work(lo: int, hi: int) -> int | None:
        if lo == 0:
            raise RuntimeError("the calling thread's run failed")
        finished.append(lo)
        return None

    with pytest.raises(RuntimeError):
        page_checks.split_pages(100, page_checks.PARALLEL_MIN_BYTES, work)
    assert len(finished) == min(page_checks.CHECK_THREADS, 100) - 1


def test_counts_must_agree() -> None:
    pages, checksums = _pages(2)
    with pytest.raises(ValueError, match="expected checksums"):
        page_checks.first_mismatch(pages, checksums[:1])
