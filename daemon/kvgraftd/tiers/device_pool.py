"""The device tier: a fixed byte budget of attention-block slots on the accelerator.

Attention reads KV one block at a time (`block_tokens` positions of one
layer); a slot holds one block, K then V: [2, kv_heads, block_tokens,
head_dim]. A bounded pool allocates its `budget_bytes // slot_bytes` slots
up front and never more: the pool's own byte count is the device memory
attention uses, whatever the context length. An unbounded pool (budget 0)
allocates as it goes: everything stays resident. On CPU the same code runs
with CPU tensors.

A slot is cached under a key (a stored block's page hashes, or a context's
live block) with the number of leading positions it holds, so a block that
grows by one token per decode step is topped up, not refilled. `acquire`
pins a slot (never evicted while pinned), fills what is missing with the
caller's `fill(tensor, start, end)`, and returns it; `release` unpins it.
Least recently used unpinned slots are reused first. When every slot is
pinned, acquire waits: callers pin at most a few slots each and release them
without waiting for more (a caller filling a batch of slots hands the batch on
in `before_wait` first), so a pool of two slots always makes progress.

Fill functions copy bytes; they never convert them. What a slot holds is
what its source holds, so the tier a block came from cannot change the
result of attention (docs/architecture.md, contract 5).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from kvgraft.errors import InvalidArgument

Fill = Callable[[torch.Tensor, int, int], None]  # fill(slot, start, end): positions [start, end)


@dataclass
class Slot:
    tensor: torch.Tensor  # [2, kv_heads, block_tokens, head_dim]
    key: Hashable | None = None
    valid: int = 0  # leading positions it holds
    pins: int = 0
    filling: threading.Event = field(default_factory=threading.Event)


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_streamed: int = 0
    peak_bytes: int = 0


class DevicePool:
    def __init__(
        self,
        budget_bytes: int,
        slot_shape: tuple[int, int, int, int],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.slot_shape = slot_shape
        self.device = torch.device(device)
        self.dtype = dtype
        self.slot_bytes = (
            torch.Size(slot_shape).numel() * torch.tensor([], dtype=dtype).element_size()
        )
        self.capacity = budget_bytes // self.slot_bytes if budget_bytes else 0  # 0: unbounded
        if budget_bytes and self.capacity < 2:
            raise InvalidArgument(
                f"device budget {budget_bytes} bytes holds fewer than 2 attention blocks of "
                f"{self.slot_bytes} bytes; raise --device-budget or lower --block-tokens"
            )
        self.budget_bytes = budget_bytes
        self.counters = TierCounters()
        self._slots: OrderedDict[Hashable, Slot] = OrderedDict()  # cached, in LRU order
        self._free: list[Slot] = []  # allocated, holding nothing
        self._allocated = 0
        self._cond = threading.Condition()
        # A bounded pool is allocated whole up front: its device memory is fixed,
        # the same for a short context as for ten million tokens.
        for _ in range(self.capacity):
            self._free.append(self._new_slot())

    def _new_slot(self) -> Slot:
        self._allocated += 1
        self.counters.peak_bytes = max(self.counters.peak_bytes, self.used_bytes)
        with torch.inference_mode(False):  # a normal tensor: writable on any thread
            return Slot(torch.empty(self.slot_shape, dtype=self.dtype, device=self.device))

    @property
    def used_bytes(self) -> int:
        """Bytes allocated: the whole budget of a bounded pool, from the start."""
        return self._allocated * self.slot_bytes

    @property
    def holding_bytes(self) -> int:
        """Bytes of the slots that hold a block or are pinned now (the rest are free)."""
        return (self._allocated - len(self._free)) * self.slot_bytes

    # ------------------------------------------------------------------
    def acquire(
        self, key: Hashable, needed: int, fill: Fill, wait: bool = True, cache: bool = True,
        before_wait: Callable[[], None] | None = None,
    ) -> Slot | None:  # fmt: skip
        """A pinned slot holding the block's first `needed` positions.

        With wait=False (prefetch), None instead of waiting for a slot to free up.
        `before_wait` runs, without the pool's lock, before waiting: a caller
        holding pins of its own hands them on there, so it never waits on itself.
        With cache=False (a scan of more blocks than the pool holds, where
        caching only evicts what would have been hit), the slot goes back to
        the free list on release; the free list is last in, first out, so a
        scan keeps reusing the same few slots while they are warm in the CPU cache.
        """
        if before_wait is not None:
            slot = self.acquire(key, needed, fill, False, cache)
            if slot is not None:
                return slot
            before_wait()
        if not cache:
            with self._cond:
                slot = self._take_slot(wait)
                if slot is None:
                    return None
                slot.key, slot.valid, slot.pins = None, 0, 1
                slot.filling.clear()
            self._top_up(slot, needed, fill)
            return slot
        with self._cond:
            slot = self._slots.get(key)
            if slot is not None:
                slot.pins += 1
                self._slots.move_to_end(key)
                while not slot.filling.is_set():
                    self._cond.wait()
            else:
                slot = self._take_slot(wait)
                if slot is None:
                    return None
                slot.key, slot.valid, slot.pins = key, 0, 1
                slot.filling.clear()
                self._slots[key] = slot
        self._top_up(slot, needed, fill)
        return slot

    def _top_up(self, slot: Slot, needed: int, fill: Fill) -> None:
        try:
            if slot.valid < needed:
                fill(slot.tensor, slot.valid, needed)
                streamed = (needed - slot.valid) * self.slot_bytes // self.slot_shape[2]
                with self._cond:
                    self.counters.misses += 1
                    self.counters.bytes_streamed += streamed
                slot.valid = needed
            else:
                with self._cond:
                    self.counters.hits += 1
        except BaseException:
            with self._cond:  # a failed fill leaves nothing cached
                if slot.key is not None:
                    self._slots.pop(slot.key, None)
                slot.key, slot.valid = None, 0
                slot.pins -= 1
                self._free.append(slot)
                slot.filling.set()
                self._cond.notify_all()
            raise
        with self._cond:
            slot.filling.set()
            self._cond.notify_all()

    def _take_slot(self, wait: bool) -> Slot | None:
        """A slot to fill: a free one, a new one within budget, or the LRU unpinned one."""
        while True:
            if self._free:
                return self._free.pop()
            if not self.capacity:
                return self._new_slot()
            for key, slot in self._slots.items():
                if not slot.pins:
                    del self._slots[key]
                    self.counters.evictions += 1
                    return slot
            if not wait:
                return None
            self._cond.wait()

    def release(self, slot: Slot) -> None:
        with self._cond:
            assert slot.pins > 0, "a slot released more often than it was acquired"
            slot.pins -= 1
            if slot.key is None and not slot.pins:  # a transient slot
                slot.valid = 0
                self._free.append(slot)
            self._cond.notify_all()

    def forget(self, keys: list[Hashable]) -> None:
        """Drop cached blocks nobody will ask for again (a finished context's live blocks)."""
        with self._cond:
            for key in keys:
                slot = self._slots.get(key)
                if slot is not None and not slot.pins:
                    del self._slots[key]
                    slot.key, slot.valid = None, 0
                    self._free.append(slot)
            self._cond.notify_all()
