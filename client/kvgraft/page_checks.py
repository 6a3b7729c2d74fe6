"""Page checks on every core: per-page work on many pages at once, the first bad one named.

A verified read is bounded by its hash, not by memory: xxh3-128 reads RAM at
about 10 GB/s on one core, just short of a memcpy. python-xxhash releases the
GIL while it hashes a buffer, so a batch of pages is split into contiguous
runs handled side by side on a small process-wide pool (one thread per core,
at most `MAX_CHECK_THREADS`); the calling thread takes the first run itself.
A batch under `PARALLEL_MIN_BYTES` is handled on the calling thread, where a
hand-off would cost more than it saves.

Contract: `split_pages` runs per-page work (a read or a copy then its xxh3-128
check; SHA-256, for which hashlib releases the GIL too) over runs of pages and
returns the first page any run reports, or None; it never raises for a bad
page, so the caller decides what a bad page means and what it must withhold.
`pipelined_pages` does the same where each piece of pages needs a step only
the calling thread can take first (the store's index lookups), overlapping it
with the pool's work on the pieces before.
Work handed to the pool must not itself wait on the pool. `PageHash` checks one
page whose pieces arrive one by one (kvgraft.chunks).
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import xxhash

MAX_CHECK_THREADS = 4  # a few threads read memory as fast as it goes
PARALLEL_MIN_BYTES = 4 << 20  # below this a batch is checked where it was asked for
PIPELINE_PIECE_BYTES = 4 << 20  # pipelined_pages hands the pool pieces of this size
CHECK_THREADS = max(1, min(MAX_CHECK_THREADS, len(os.sched_getaffinity(0))))

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


xxh3_128 = xxhash.xxh3_128_digest  # the page checksum (a name, not a wrapper: a hot path)


def split_pages(
    count: int,
    nbytes: int,
    work: Callable[[int, int], int | None],
    min_parallel_bytes: int = PARALLEL_MIN_BYTES,
) -> int | None:
    """work(lo, hi) over contiguous runs of [0, count), side by side from `min_parallel_bytes`.

    Returns the smallest non-None result of the runs (each run reports the
    first page in it that failed), or None. Every run has ended when it returns.
    """
    runs = min(CHECK_THREADS if nbytes >= min_parallel_bytes else 1, count)
    if runs <= 1:
        return work(0, count)
    bounds = [count * i // runs for i in range(runs + 1)]
    futures = [_executor().submit(work, bounds[i], bounds[i + 1]) for i in range(1, runs)]
    try:
        first = work(bounds[0], bounds[1])
    finally:  # the runs read the caller's pages: none may outlive this call
        found = [future.result() for future in futures]
    return next((index for index in [first, *found] if index is not None), None)


def pipelined_pages(
    count: int,
    page_bytes: int,
    prepare: Callable[[int, int], object],
    work: Callable[[int, int], int | None],
) -> int | None:
    """prepare(lo, hi) on the calling thread piece by piece, each piece's work(lo, hi) taken
    up by the pool as soon as it is prepared, and by the caller too once it has prepared
    them all (`split_pages` where the work needs something only the caller can do first,
    e.g. lookups in its transaction: they overlap the work on the pieces before, and no
    more threads run than there are cores). `page_bytes`: about how large a page is.

    Returns the smallest non-None result of the pieces' work, or None; every piece has
    ended when it returns (or raises what `prepare` or a `work` raised).
    """
    if count * page_bytes < PARALLEL_MIN_BYTES or CHECK_THREADS == 1:
        prepare(0, count)
        return work(0, count)
    step = max(1, PIPELINE_PIECE_BYTES // max(1, page_bytes))
    ready: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
    found: list[int] = []

    def take() -> None:
        while (piece := ready.get()) is not None:
            index = work(*piece)
            if index is not None:
                found.append(index)
        ready.put(None)  # the end, for the next taker

    helpers = [_executor().submit(take) for _ in range(CHECK_THREADS - 1)]
    try:
        for lo in range(0, count, step):
            prepare(lo, min(count, lo + step))
            ready.put((lo, min(count, lo + step)))
    finally:  # the pieces read the caller's pages: none may outlive this call
        ready.put(None)
        try:
            take()
        finally:
            wait(helpers)
    for helper in helpers:
        helper.result()  # raises what its work raised
    return min(found, default=None)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="page-check")
        return _pool


class PageHash:
    """One page hashed as its pieces pass: against the xxh3-128 its sender gave, and
    against its SHA-256 (its identity) when the sender gave none or `also_sha256`."""

    def __init__(self, sha256: bytes, xxh3: bytes = b"", *, also_sha256: bool = False) -> None:
        self._sha256 = sha256
        self._xxh3 = xxh3
        self._fast = xxhash.xxh3_128() if xxh3 else None
        self._identity = hashlib.sha256() if also_sha256 or not xxh3 else None

    def update(self, data) -> None:
        if self._fast is not None:
            self._fast.update(data)
        if self._identity is not None:
            self._identity.update(data)

    def intact(self) -> bool:
        if self._fast is not None and self._fast.digest() != self._xxh3:
            return False
        return self._identity is None or self._identity.digest() == self._sha256
