"""The host tier: verified copies of stored pages in RAM, least recently used first out.

Reading a page from the store costs a lookup, a copy out of its segment and an
xxh3 check; a page kept here was checked when it came in and is handed out as
it is. The cache holds at most `budget_bytes` of page bytes (0 disables it). A
page larger than the budget, or any page while a reader streams more stored
bytes than the budget could ever hold (`admit=False`), goes straight from the
store to its destination: caching a scan larger than the cache only evicts
what would have been hit. With CUDA present, cached pages live in pinned
memory so host-to-device copies run at full speed.

Thread-safe. Pages are immutable, so a cached copy is never stale.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from kvgraft.errors import KvgraftError
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.page_records import InPlacePage
from kvgraftd.tiers.device_pool import TierCounters


class HostCache:
    def __init__(self, store: Store, budget_bytes: int) -> None:
        self.store = store
        self.budget_bytes = budget_bytes
        self.counters = TierCounters()
        self._pages: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._pinned = torch.cuda.is_available()

    @property
    def used_bytes(self) -> int:
        return self._bytes

    @property
    def holding_bytes(self) -> int:
        """The same as used_bytes: the cache allocates a copy only for a page it holds."""
        return self._bytes

    def read_into(self, digests: list[bytes], dests: list[np.ndarray], admit: bool) -> None:
        """Copy pages into `dests` (uint8), from RAM where cached, else from the store."""
        missing: list[int] = []
        with self._lock:
            for index, digest in enumerate(digests):
                cached = self._pages.get(digest)
                if cached is None:
                    missing.append(index)
                    continue
                self._pages.move_to_end(digest)
                self.counters.hits += 1
                dests[index][:] = cached
        if not missing:
            return
        self.store.read_pages_into([digests[i] for i in missing], [dests[i] for i in missing])
        with self._lock:
            self.counters.misses += len(missing)
            self.counters.bytes_streamed += sum(dests[i].nbytes for i in missing)
        if admit and self.budget_bytes:
            for index in missing:
                self._admit(digests[index], dests[index])

    @contextmanager
    def verified(self, digests: list[bytes], admit: bool = False) -> Iterator[list[np.ndarray]]:
        """Every page's bytes, verified, to read (not write) inside the `with` block.

        A cached page is its cached copy; any other is read from the store into
        a read-only array of its own (Store.verified_pages), which `admit` keeps
        as the cached copy itself (no second copy) where no pinned copy is needed.
        """
        found = self._cached(digests)
        missing = [index for index, page in enumerate(found) if page is None]
        if not missing:
            yield found
            return
        with self.store.verified_pages([digests[i] for i in missing]) as pages:
            with self._lock:
                self.counters.misses += len(missing)
                self.counters.bytes_streamed += sum(page.nbytes for page in pages)
            for index, page in zip(missing, pages, strict=True):
                found[index] = page
                if admit and self.budget_bytes:
                    self._admit(digests[index], page, owned=True)
            yield found

    @contextmanager
    def unchecked(
        self, digests: list[bytes]
    ) -> Iterator[list[tuple[np.ndarray | InPlacePage, bytes | None]]]:
        """(bytes, xxh3-128 to check them against) of every page, inside the `with` block.

        A cached page is its cached copy, checked when it came in (None); any
        other is the page where it lies in the store (InPlacePage: for guarded
        native code only) or a copy read from it, not yet checked: the caller
        checks it before using anything computed from it (raising CorruptPage
        inside the block for one that fails), and may then `admit` it.
        """
        found: list = [None if page is None else (page, None) for page in self._cached(digests)]
        missing = [index for index, page in enumerate(found) if page is None]
        if not missing:
            yield found
            return
        with self.store.pages_to_check([digests[i] for i in missing]) as pages:
            with self._lock:
                self.counters.misses += len(missing)
                self.counters.bytes_streamed += sum(page.nbytes for _, page in pages)
            for index, (checksum, page) in zip(missing, pages, strict=True):
                found[index] = (page, checksum)
            yield found

    def _cached(self, digests: list[bytes]) -> list[np.ndarray | None]:
        """Each page's cached copy (a hit, now most recent), or None."""
        found: list[np.ndarray | None] = []
        with self._lock:
            for digest in digests:
                cached = self._pages.get(digest)
                if cached is not None:
                    self._pages.move_to_end(digest)
                    self.counters.hits += 1
                found.append(cached)
        return found

    def admit(self, digest: bytes, data: np.ndarray | InPlacePage) -> None:
        """Keep a copy of a page checked by the caller (if the budget allows); one where it
        lies in the store is copied out of it (checked again: the copy is guarded)."""
        if not self.budget_bytes or data.nbytes > self.budget_bytes:
            return
        if isinstance(data, InPlacePage):
            copy = np.empty(data.nbytes, np.uint8)
            try:  # the step already has what it needs: a page gone meanwhile is not cached
                self.store.read_pages_into([digest], [copy])
            except KvgraftError:
                return
            self._admit(digest, copy, owned=True)
            return
        self._admit(digest, data)

    def _admit(self, digest: bytes, data: np.ndarray, owned: bool = False) -> None:
        """Keep `data` (`owned`: read-only, nobody else's: kept as it is where it may be)."""
        if data.nbytes > self.budget_bytes:
            return
        if owned and not self._pinned:
            copy = data
        else:
            copy = self._allocate(data.nbytes)
            copy[:] = data
        with self._lock:
            if digest in self._pages:
                return
            while self._bytes + data.nbytes > self.budget_bytes and self._pages:
                _, evicted = self._pages.popitem(last=False)
                self._bytes -= evicted.nbytes
                self.counters.evictions += 1
            self._pages[digest] = copy
            self._bytes += data.nbytes
            self.counters.peak_bytes = max(self.counters.peak_bytes, self._bytes)

    def _allocate(self, size: int) -> np.ndarray:
        if self._pinned:
            return torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()
        return np.empty(size, np.uint8)
