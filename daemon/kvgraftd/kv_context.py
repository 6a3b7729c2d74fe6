"""The KV of one inference context, and attention over it block by block through the tiers.

Positions [0, stored_tokens) are *stored*: whole attention blocks of pages
that live in the store (grafted, never copied into the context); their
bytes reach attention through the host cache and the device pool. Positions
[stored_tokens, length) are *live*: computed here or loaded from a partial
block, kept in growable host buffers [kv_heads, capacity, head_dim].

A forward pass over a chunk at positions [start, start + n) first writes the
chunk's K and V into the live buffers, then attends over [0, start + n) one
block of `block_tokens` keys at a time, in block order, each block read from
a device-pool slot, merging partial results with an online softmax (running
max, sum and output) in that same order. A block's slot holds exactly the
bytes of its source, so the logits do not depend on where a block came from
or on the device budget (DESIGN.md, contract 5); device memory is the pool's
budget whatever the context length. While one block is attended, the next
immutable one is brought into the pool on a background thread.

Pages are the unit of storage: page p of layer l holds positions
[p * page_tokens, (p + 1) * page_tokens) as K then V, each [kv_heads, t, D].
"""

from __future__ import annotations

import itertools
import threading
from array import array
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvgraftd.device_pool import DevicePool, Slot
from kvgraftd.host_cache import HostCache
from kvgraftd.model_adapter import ModelGeometry

_GROWTH_TOKENS = 1024
_uids = itertools.count(1)


class OnlineSoftmax:
    """Attention of queries q [heads, n, D] at [q_start, ...) merged over key blocks in order."""

    def __init__(self, q: torch.Tensor, kv_heads: int, q_start: int, scaling: float) -> None:
        heads, n, dim = q.shape
        group = heads // kv_heads
        self._shape = (heads, n, dim)
        self._q = q.reshape(kv_heads, group * n, dim)  # query head h reads kv head h // group
        self._q_start = q_start
        self._q_positions = torch.arange(q_start, q_start + n).repeat(group).unsqueeze(1)
        self._scaling = scaling
        self._max = torch.full((kv_heads, group * n, 1), float("-inf"), device=q.device)
        self._sum = torch.zeros(kv_heads, group * n, 1, device=q.device)
        self._acc = torch.zeros(kv_heads, group * n, dim, device=q.device)

    def add(self, keys: torch.Tensor, values: torch.Tensor, begin: int) -> None:
        """Keys and values [kv_heads, t, D] of positions [begin, begin + t)."""
        end = begin + keys.shape[1]
        scores = torch.bmm(self._q, keys.transpose(1, 2))  # [kv_heads, group * n, t]
        scores.mul_(self._scaling)
        if end > self._q_start + 1:  # some keys lie after some query: causal mask
            k_positions = torch.arange(begin, end, device=keys.device).unsqueeze(0)
            scores.masked_fill_(k_positions > self._q_positions.to(keys.device), float("-inf"))
        new_max = torch.maximum(self._max, scores.amax(dim=-1, keepdim=True))
        weights = torch.exp(scores - new_max)
        correction = torch.exp(self._max - new_max)
        self._sum = self._sum * correction + weights.sum(dim=-1, keepdim=True)
        self._acc = self._acc * correction + torch.bmm(weights, values)
        self._max = new_max

    def result(self) -> torch.Tensor:
        """[n, heads, D]."""
        return (self._acc / self._sum).reshape(self._shape).transpose(0, 1)


def blockwise_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_start: int,
    block_tokens: int,
    scaling: float,
) -> torch.Tensor:
    """Causal attention over resident keys/values [kv_heads, >= q_start + n, D] (a reference)."""
    softmax = OnlineSoftmax(q, keys.shape[0], q_start, scaling)
    for begin in range(0, q_start + q.shape[1], block_tokens):
        end = min(begin + block_tokens, q_start + q.shape[1])
        softmax.add(keys[:, begin:end], values[:, begin:end], begin)
    return softmax.result()


class Tiers:
    """The device pool, host cache and store, shared by every context of an engine."""

    def __init__(self, pool: DevicePool, host: HostCache, prefetch: bool = True) -> None:
        self.pool = pool
        self.host = host
        self._prefetcher = (
            ThreadPoolExecutor(1, thread_name_prefix="prefetch") if prefetch else None
        )
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


class KvContext:
    """Token ids, segments and per-layer KV of one context."""

    def __init__(
        self, geometry: ModelGeometry, page_tokens: int, block_tokens: int, tiers: Tiers
    ) -> None:
        if block_tokens % page_tokens:
            raise ValueError("block_tokens must be a multiple of page_tokens")
        self.geometry = geometry
        self.page_tokens = page_tokens
        self.block_tokens = block_tokens
        self.tiers = tiers
        self.uid = next(_uids)
        self.token_ids = array("I")  # compact: a context may hold millions
        self.segment_ends: list[int] = []
        self.stored_tokens = 0
        self._stored_pages: list[Sequence[bytes]] = []  # per stored page: one hash per layer
        self._keys = [self._empty(0) for _ in range(geometry.num_layers)]
        self._values = [self._empty(0) for _ in range(geometry.num_layers)]
        self._chunk_start = 0

    def _empty(self, capacity: int) -> torch.Tensor:
        # Live KV stays in host memory (pinned next to a GPU, for fast copies into slots).
        # Uninitialized: only positions already written are ever read.
        pinned = self.tiers.pool.device.type == "cuda"
        with torch.inference_mode(False):  # a normal tensor: writable on any thread
            return torch.empty(
                self.geometry.kv_heads, capacity, self.geometry.head_dim, pin_memory=pinned
            )

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def _reserve(self, tokens: int, headroom: int = 0) -> None:
        live = tokens - self.stored_tokens
        capacity = self._keys[0].shape[1]
        if live <= capacity:
            return
        grown = max(live + headroom, 2 * capacity, _GROWTH_TOKENS)
        for buffers in (self._keys, self._values):
            for layer, old in enumerate(buffers):
                new = self._empty(grown)
                new[:, :capacity] = old
                buffers[layer] = new

    def __enter__(self) -> KvContext:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Forget this context's live blocks in the pool (stored ones may serve others)."""
        blocks = -(-self.length // self.block_tokens)
        self.tiers.pool.forget(
            [
                ("live", self.uid, layer, b)
                for layer in range(self.geometry.num_layers)
                for b in range(blocks)
            ]
        )

    # ------------------------------------------------------------------
    def begin_chunk(self, start: int, token_ids: list[int]) -> None:
        """Prepare a forward pass over `token_ids` at positions [start, ...)."""
        assert start == self.length, "chunks are appended in order"
        self._reserve(start + len(token_ids))
        self._chunk_start = start

    def end_chunk(self, token_ids: list[int]) -> None:
        self.token_ids.extend(token_ids)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Store the chunk's k, v ([kv_heads, n, D]) for `layer`, then attend (q: [heads, n, D])."""
        start, n = self._chunk_start, k.shape[1]
        live = start - self.stored_tokens
        self._keys[layer][:, live : live + n] = k.to(self._keys[layer].device)
        self._values[layer][:, live : live + n] = v.to(self._values[layer].device)
        total = start + n
        softmax = OnlineSoftmax(q, self.geometry.kv_heads, start, scaling)
        plan = [self._block(layer, begin, total) for begin in range(0, total, self.block_tokens)]
        pending: Future | None = None
        # A stored region larger than the pool is a scan: its blocks pass through
        # transient slots instead of evicting each other from the cache.
        cache = self.stored_tokens // self.block_tokens < (self.tiers.pool.capacity or 1 << 62)
        for index, (key, needed, fill, _) in enumerate(plan):
            slot: Slot | None = pending.result() if pending is not None else None
            stored = index * self.block_tokens < self.stored_tokens
            if slot is None:
                slot = self.tiers.pool.acquire(key, needed, fill, cache=cache or not stored)
            upcoming = plan[index + 1] if index + 1 < len(plan) else None
            pending = None
            if upcoming and upcoming[3]:  # immutable: safe to fetch ahead
                ahead_stored = (index + 1) * self.block_tokens < self.stored_tokens
                pending = self.tiers.prefetch(*upcoming[:3], cache or not ahead_stored)
            try:
                softmax.add(
                    slot.tensor[0, :, :needed],
                    slot.tensor[1, :, :needed],
                    index * self.block_tokens,
                )
            finally:
                self.tiers.pool.release(slot)
        return softmax.result()

    def _block(self, layer: int, begin: int, total: int):
        """(pool key, positions needed, fill, immutable) of the block starting at `begin`."""
        needed = min(self.block_tokens, total - begin)
        if begin < self.stored_tokens:
            first = begin // self.page_tokens
            digests = [
                self._stored_pages[p][layer]
                for p in range(first, first + needed // self.page_tokens)
            ]
            return ("stored", layer, *digests), needed, self._stored_fill(digests), True
        keys, values = self._keys[layer], self._values[layer]
        offset = begin - self.stored_tokens

        def fill(slot: torch.Tensor, start: int, end: int) -> None:
            slot[0, :, start:end].copy_(keys[:, offset + start : offset + end], non_blocking=True)
            slot[1, :, start:end].copy_(values[:, offset + start : offset + end], non_blocking=True)

        immutable = begin + needed <= self._chunk_start  # whole, and before this chunk
        return ("live", self.uid, layer, begin // self.block_tokens), needed, fill, immutable

    def _stored_fill(self, digests: list[bytes]):
        kv_heads, dim, page = self.geometry.kv_heads, self.geometry.head_dim, self.page_tokens
        page_bytes = 2 * kv_heads * page * dim * 4

        def fill(slot: torch.Tensor, start: int, end: int) -> None:
            stored_bytes = len(self._stored_pages) * self.geometry.num_layers * page_bytes
            admit = stored_bytes <= self.tiers.host.budget_bytes  # else a scan: don't churn
            if len(digests) == 1 and slot.device.type == "cpu":  # a page is a block:
                target = slot.view(-1).view(torch.uint8).numpy()[:page_bytes]  # same layout
                self.tiers.host.read_into(digests, [target], admit)
                return
            staging = self.tiers.staging(len(digests) * page_bytes)
            dests = [staging[i * page_bytes : (i + 1) * page_bytes] for i in range(len(digests))]
            self.tiers.host.read_into(digests, dests, admit)
            pages = (
                torch.from_numpy(staging)
                .view(torch.float32)
                .view(len(digests), 2, kv_heads, page, dim)
            )
            # [pages, 2, kv_heads, page, D] -> [2, kv_heads, pages * page, D]
            slot[:, :, : len(digests) * page].view(2, kv_heads, len(digests), page, dim).copy_(
                pages.permute(1, 2, 0, 3, 4)
            )

        return fill

    # ------------------------------------------------------------------
    def attach(self, token_ids: Sequence[int], page_sha256: Sequence[bytes]) -> None:
        """Graft stored pages (page-major hashes) with the KV of `token_ids` into an empty context.

        Whole blocks stay in the store and stream in when attended; the rest is
        copied into the live buffers.
        """
        assert self.length == 0, "grafts start from an empty context"
        layers = self.geometry.num_layers
        pages = [
            page_sha256[p * layers : (p + 1) * layers] for p in range(len(page_sha256) // layers)
        ]
        self.stored_tokens = len(token_ids) // self.block_tokens * self.block_tokens
        stored_pages = self.stored_tokens // self.page_tokens
        self._stored_pages = pages[:stored_pages]
        self._load_live(token_ids, pages[stored_pages:])
        self.token_ids = array("I", token_ids)

    def _load_live(self, token_ids: Sequence[int], pages: list[Sequence[bytes]]) -> None:
        """Copy the pages after the stored blocks into the live buffers."""
        self._reserve(len(token_ids), headroom=_GROWTH_TOKENS)  # the continuation follows
        kv_heads, dim, page = self.geometry.kv_heads, self.geometry.head_dim, self.page_tokens
        live = len(token_ids) - self.stored_tokens
        whole, tail = divmod(live, page)
        page_bytes = 2 * kv_heads * page * dim * 4
        sizes = [page_bytes] * whole + ([2 * kv_heads * tail * dim * 4] if tail else [])
        staging = self.tiers.staging(sum(sizes))
        dests = [staging[i * page_bytes : i * page_bytes + size] for i, size in enumerate(sizes)]
        for layer in range(self.geometry.num_layers):
            self.tiers.host.read_into([hashes[layer] for hashes in pages], dests, admit=False)
            keys, values = self._keys[layer], self._values[layer]
            if whole:  # [pages, 2, kv_heads, page, D] -> K, V [kv_heads, pages * page, D]
                stacked = torch.from_numpy(staging[: whole * page_bytes]).view(torch.float32)
                stacked = stacked.view(whole, 2, kv_heads, page, dim).permute(1, 2, 0, 3, 4)
                keys[:, : whole * page].view(kv_heads, whole, page, dim).copy_(stacked[0])
                values[:, : whole * page].view(kv_heads, whole, page, dim).copy_(stacked[1])
            if tail:
                raw = torch.from_numpy(dests[-1]).view(torch.float32).view(2, kv_heads, tail, dim)
                keys[:, whole * page : live] = raw[0]
                values[:, whole * page : live] = raw[1]

    # ------------------------------------------------------------------
    def page_count(self) -> int:
        return -(-self.length // self.page_tokens)

    def page_bytes(self, page: int, layer: int) -> bytes:
        """Page `page` of `layer` as stored: K then V, [kv_heads, t, D] each."""
        begin = page * self.page_tokens
        end = min(begin + self.page_tokens, self.length)
        if begin < self.stored_tokens:
            data, _ = self.tiers.host.store.read_page(self._stored_pages[page][layer])
            return data
        live = begin - self.stored_tokens
        keys = self._keys[layer][:, live : live + end - begin]
        values = self._values[layer][:, live : live + end - begin]
        return torch.stack((keys, values)).contiguous().numpy().tobytes()
