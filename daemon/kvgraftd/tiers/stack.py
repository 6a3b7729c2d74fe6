"""The tiers an engine's contexts share: the device pool, the host cache (and the store behind
it), the live buffers, and the threads that move and attend blocks.

Contract: one Tiers per engine; every context of the engine attends through
it. `prefetch` brings a block into the pool on the background thread (None
when prefetching is off). Decode-step attention (kvgraftd.engine.model.decode_attention)
runs on `attention_workers`, one per core, `attention_window` batches in flight
per attention; `attention_batch` sizes the batches so the
workers finish together and, for batches of pool slots, so the batches in
flight pin at most half the pool.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from kvgraft.page_checks import CHECK_THREADS
from kvgraftd.tiers.device_pool import DevicePool
from kvgraftd.tiers.host_cache import HostCache
from kvgraftd.tiers.live_buffers import LiveBuffers

MAX_BATCH = 16  # blocks per call of the kernel
BATCHES_PER_WORKER = 8  # per step, at least, when there are blocks enough


class Tiers:
    """The device pool, host cache, store and live buffers, shared by every context of an engine."""

    def __init__(self, pool: DevicePool, host: HostCache, prefetch: bool = True) -> None:
        self.pool = pool
        self.host = host
        # Live KV stays in host memory (pinned next to a GPU, for fast copies into slots).
        self.live = LiveBuffers(pinned=pool.device.type == "cuda")
        self._prefetcher = (
            ThreadPoolExecutor(1, thread_name_prefix="prefetch") if prefetch else None
        )
        # decode-step block partials, one thread per core (kvgraftd.engine.model.decode_attention)
        self.attention_workers = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="attend")
        self.attention_window = 2 * CHECK_THREADS  # batches in flight per attention
        self._staging = threading.local()  # per-thread buffer for one block of pages

    def staging(self, size: int) -> np.ndarray:
        buffer = getattr(self._staging, "buffer", None)
        if buffer is None or buffer.nbytes < size:
            buffer = self._staging.buffer = np.empty(size, np.uint8)
        return buffer[:size]

    def prefetch(self, key, needed: int, fill, cache: bool) -> Future | None:
        if self._prefetcher is None:
            return None
        return self._prefetcher.submit(self.pool.acquire, key, needed, fill, False, cache)

    def attention_batch(self, blocks: int, slots: bool = False) -> int:
        """Blocks per batch for a step over `blocks` (of pool slots, if `slots`)."""
        most = MAX_BATCH
        if slots and self.pool.capacity is not None:
            most = max(1, self.pool.capacity // (2 * (self.attention_window + 1)))
        return max(1, min(most, blocks // (BATCHES_PER_WORKER * CHECK_THREADS)))
