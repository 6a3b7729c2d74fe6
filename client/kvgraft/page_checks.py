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
Work handed to the pool must not itself wait on the pool. `PageHash` checks one
page whose pieces arrive one by one (kvgraft.chunks).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import xxhash

MAX_CHECK_THREADS = 4  # a few threads read memory as fast as it goes
PARALLEL_MIN_BYTES = 4 << 20  # below this a batch is checked where it was asked for
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
