"""kvgraft.page_checks: per-page work split over threads, the first bad page named."""

from __future__ import annotations

import pytest

from kvgraft import page_checks

PAGE_BYTES = 98_304  # one page of the default model's geometry


def test_the_first_bad_page_is_named_whichever_run_finds_it() -> None:
    bad = {7, 150, 151}

    def work(lo: int, hi: int) -> int | None:
        return next((index for index in range(lo, hi) if index in bad), None)

    assert page_checks.split_pages(200, page_checks.PARALLEL_MIN_BYTES, work) == 7
    assert page_checks.split_pages(200, 0, work, min_parallel_bytes=1 << 40) == 7  # one run


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
