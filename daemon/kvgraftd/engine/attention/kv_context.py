"""The KV of one inference context, and attention over it block by block through the tiers.

Positions [0, stored_tokens) are *stored*: whole pages that live in the
store (grafted, never copied into the context); their bytes reach attention
through the host cache and the device pool. Positions [stored_tokens, length)
are *live*: computed here or loaded from a partial page, kept in growable
host buffers [kv_heads, capacity, head_dim]. A block wholly stored is cached
in the pool under its pages' hashes, for every context that grafts them; the
block where stored pages end and live positions begin is filled from both.

A forward pass over a chunk at positions [start, start + n) first writes the
chunk's K and V into the live buffers, then attends over [0, start + n) one
block of `block_tokens` keys at a time, in block order, each block read from
a device-pool slot, merging partial results with an online softmax (running
max, sum and output) in that same order. A block's slot holds exactly the
bytes of its source, so the logits do not depend on where a block came from
or on the device budget (docs/architecture.md, contract 5); device memory is the pool's
budget whatever the context length. While one block is attended, the next
immutable one is brought into the pool on a background thread. On CPU, a
scan of stored blocks that are one page each skips the pool: each is attended
in the host cache's copy, or where it lies in the store's segment mapping
(checked as it is attended, under the store's fault guard), without a slot;
and blocks of live positions only are read in the
live buffers. How the native kernel's partials are gathered from each place is
the context's BlockGather (kvgraftd.engine.attention.block_gather), which reads
the context through the public members its GatheredContext interface names.

Pages are the unit of storage: page p of layer l holds positions
[p * page_tokens, (p + 1) * page_tokens) as K then V, each [kv_heads, t, D].
"""

from __future__ import annotations

import itertools
import warnings
from array import array
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future

import numpy as np
import torch

from kvgraft.errors import DataLoss
from kvgraftd.engine.attention.block_gather import BlockGather
from kvgraftd.engine.attention.online_softmax import OnlineSoftmax, softmax_for
from kvgraftd.engine.model.decode_attention import DecodeSoftmax, attend_live_step
from kvgraftd.engine.model.geometry import ModelGeometry
from kvgraftd.tiers.device_pool import Slot
from kvgraftd.tiers.live_buffers import GRANULE_TOKENS, round_capacity
from kvgraftd.tiers.stack import Tiers

_uids = itertools.count(1)


def _always() -> bool:
    return True


# Stored pages are attended in read-only copies (the host cache's, the store's); attention
# only reads.
warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)


class KvContext:
    """Token ids, segments and per-layer KV of one context."""

    def __init__(
        self,
        geometry: ModelGeometry,
        page_tokens: int,
        block_tokens: int,
        tiers: Tiers,
        rows: bool = False,
        live_tokens: int = 0,
    ) -> None:
        """`live_tokens`: the live positions it will hold (if known): its buffers are sized
        for them at once, instead of growing as it does."""
        if block_tokens % page_tokens:
            raise ValueError("block_tokens must be a multiple of page_tokens")
        self.rows = rows  # every row attends as a decode step at its position (RowsSoftmax)
        self.geometry = geometry
        self.page_tokens = page_tokens
        self.block_tokens = block_tokens
        self.tiers = tiers
        self._page_shape = (2, geometry.kv_heads, page_tokens, geometry.head_dim)  # K then V
        self.stored_page_bytes = 2 * geometry.kv_heads * page_tokens * geometry.head_dim * 4
        self.uid = next(_uids)
        self.token_ids = array("I")  # compact: a context may hold millions
        self.segment_ends: list[int] = []
        self.stored_tokens = 0
        self._stored_pages: list[Sequence[bytes]] = []  # per stored page: one hash per layer
        self._keys = [self._empty(0) for _ in range(geometry.num_layers)]
        self._values = [self._empty(0) for _ in range(geometry.num_layers)]
        self._chunk_start = 0
        self._live_tokens = live_tokens
        self._live_pointers: tuple[np.ndarray, np.ndarray, int] | None = None
        # whether the request computing it still wants it (false once its client left)
        self.wanted: Callable[[], bool] = _always
        self._gather = BlockGather(self)  # the native kernel's blocks, wherever they live

    def _empty(self, capacity: int) -> torch.Tensor:
        # Unspecified contents (new or recycled): only positions already written are read.
        if not capacity:
            return torch.empty(self.geometry.kv_heads, 0, self.geometry.head_dim)
        return self.tiers.live.take(self.geometry.kv_heads, capacity, self.geometry.head_dim)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def _reserve(self, tokens: int, headroom: int = 0) -> None:
        live = tokens - self.stored_tokens
        capacity = self._keys[0].shape[1]
        if live <= capacity:
            return
        # sized once where the request said how much it will hold; else grown by half again
        wanted = max(live, self._live_tokens) if self._live_tokens else live + headroom
        grown = round_capacity(max(wanted, 2 * capacity))
        self._live_pointers = None
        for buffers in (self._keys, self._values):
            for layer, old in enumerate(buffers):
                new = self._empty(grown)
                new[:, :capacity] = old
                buffers[layer] = new
                self.tiers.live.give([old])

    def __enter__(self) -> KvContext:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Forget this context's live blocks in the pool (stored ones may serve others).

        Its live buffers go back to the tiers for the next context; the
        context holds no KV afterwards.
        """
        blocks = -(-self.length // self.block_tokens)
        self.tiers.pool.forget(
            [
                self._live_key(layer, b * self.block_tokens)
                for layer in range(self.geometry.num_layers)
                for b in range(blocks)
            ]
        )
        self.tiers.live.give(self._keys + self._values)
        self._live_pointers = None
        self._keys = [self._empty(0) for _ in range(self.geometry.num_layers)]
        self._values = [self._empty(0) for _ in range(self.geometry.num_layers)]

    # ------------------------------------------------------------------
    def begin_chunk(self, start: int, token_ids: list[int]) -> None:
        """Prepare a forward pass over `token_ids` at positions [start, ...)."""
        assert start == self.length, "chunks are appended in order"
        self._reserve(start + len(token_ids))
        self._chunk_start = start

    def end_chunk(self, token_ids: list[int]) -> None:
        self.token_ids.extend(token_ids)

    def decodes_in_one_call(self, tokens: int) -> bool:
        """Whether this pass (begun, of `tokens`) is a decode step over live positions only
        that one kernel call attends: its row may go to layer_kernels.LiveRows (model), which
        writes its K, V where `attend` would and computes the same bits."""
        return tokens == 1 and self._gather.one_call_step(self.length + 1)

    def live_buffers(self) -> tuple[np.ndarray, np.ndarray, int]:
        """The addresses of the live keys and values of each layer, and the floats between
        two heads in them (valid until the buffers grow or the context closes)."""
        if self._live_pointers is None:
            keys = np.array([k.data_ptr() for k in self._keys], dtype=np.int64)
            values = np.array([v.data_ptr() for v in self._values], dtype=np.int64)
            self._live_pointers = keys, values, self._keys[0].stride(0)
        return self._live_pointers

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Store the chunk's k, v ([kv_heads, n, D]) for `layer`, then attend (q: [heads, n, D])."""
        start, n = self._chunk_start, k.shape[1]
        live = start - self.stored_tokens
        self._keys[layer][:, live : live + n] = k.to(self._keys[layer].device)
        self._values[layer][:, live : live + n] = v.to(self._values[layer].device)
        total = start + n
        geometry = self.geometry
        window, softcap = geometry.window(layer), geometry.softcap
        one_call = n == 1 and self._gather.one_call_step(total)
        if one_call and DecodeSoftmax.takes(q, geometry.kv_heads):
            keys, values = self._keys[layer], self._values[layer]
            block = self.block_tokens
            return attend_live_step(q, keys, values, total, block, scaling, window, softcap)
        softmax = softmax_for(q, geometry.kv_heads, start, scaling, self.rows, window, softcap)
        # A stored region larger than the pool is a scan: its blocks pass through
        # transient slots instead of evicting each other from the cache.
        cache = self._stored_blocks < (self.tiers.pool.capacity or 1 << 62)
        in_place = 0 if cache else self._stored_blocks_read_in_place()
        if isinstance(softmax, DecodeSoftmax):
            self._gather.decode(layer, softmax, in_place, total, cache)
        else:
            for index in range(in_place):
                self._attend_in_place(layer, index, softmax)
            for slot, needed, begin in self.block_slots(layer, in_place, total, cache):
                try:
                    softmax.add(slot.tensor[0, :, :needed], slot.tensor[1, :, :needed], begin)
                finally:
                    self.tiers.pool.release(slot)
        return softmax.result()

    def block_slots(self, layer: int, in_place: int, total: int, cache: bool, ahead: bool = True,
                    before_wait: Callable[[], None] | None = None,
                    ) -> Iterator[tuple[Slot, int, int]]:  # fmt: skip
        """(pinned slot, positions, first position) of each block after the first `in_place`
        up to `total`, in order (the next one fetched `ahead` on the prefetch thread); the
        caller releases each slot (`before_wait`: see DevicePool.acquire)."""
        blocks = range(in_place * self.block_tokens, total, self.block_tokens)
        plan = [self._block(layer, begin, total) for begin in blocks]
        pending: Future | None = None
        try:
            for step, (key, needed, fill, _) in enumerate(plan):
                index = in_place + step
                slot: Slot | None = pending.result() if pending is not None else None
                if slot is None:
                    keep = cache or index >= self._stored_blocks
                    slot = self.tiers.pool.acquire(key, needed, fill, True, keep, before_wait)
                upcoming = plan[step + 1] if step + 1 < len(plan) else None
                pending = None
                if ahead and upcoming and upcoming[3]:  # immutable: safe to fetch ahead
                    ahead_stored = index + 1 < self._stored_blocks
                    pending = self.tiers.prefetch(*upcoming[:3], cache or not ahead_stored)
                yield slot, needed, index * self.block_tokens
        finally:  # left early (an error): a block fetched ahead is not needed any more
            if pending is not None and pending.exception() is None and pending.result():
                self.tiers.pool.release(pending.result())

    def _stored_blocks_read_in_place(self) -> int:
        """How many leading blocks attention reads in the page's own copy (no slot).

        On CPU, a stored block that is one page has the layout of a slot, and
        a scan (a stored region larger than the pool) would only pass it
        through a transient slot: attending the copy the host cache holds, or
        the one the store reads and checks for it, saves a copy per block.
        Its bytes are the same, so the result is (contract 5).
        """
        one_page = self.block_tokens == self.page_tokens
        return self._stored_blocks if one_page and self.on_cpu else 0

    @property
    def on_cpu(self) -> bool:
        """Whether the pool, and so attention, is on CPU."""
        return self.tiers.pool.device.type == "cpu"

    def _attend_in_place(self, layer: int, index: int, softmax: OnlineSoftmax) -> None:
        digest = self._stored_pages[index][layer]  # block `index` is page `index`
        with self.tiers.host.verified([digest], self.cache_stored_pages()) as (page,):
            block = torch.from_numpy(page).view(torch.float32).view(self._page_shape)
            softmax.add(block[0], block[1], index * self.block_tokens)

    @property
    def _stored_blocks(self) -> int:
        """Leading blocks made only of stored pages."""
        return self.stored_tokens // self.block_tokens

    def _block(self, layer: int, begin: int, total: int):
        """(pool key, positions needed, fill, immutable) of the block starting at `begin`."""
        needed = min(self.block_tokens, total - begin)
        if begin + self.block_tokens <= self.stored_tokens:
            first = begin // self.page_tokens
            digests = self.stored_digests(layer, first, first + needed // self.page_tokens)
            return ("stored", layer, *digests), needed, self._stored_fill(digests), True
        immutable = begin + needed <= self._chunk_start  # whole, and before this chunk
        return self._live_key(layer, begin), needed, self._live_fill(layer, begin), immutable

    def stored_digests(self, layer: int, first: int, last: int) -> list[bytes]:
        """The hashes of stored pages [first, last) of `layer`."""
        return [self._stored_pages[page][layer] for page in range(first, last)]

    def live_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The live keys and values of `layer`, [kv_heads, capacity, D], position
        stored_tokens first (valid until the buffers grow or the context closes)."""
        return self._keys[layer], self._values[layer]

    def _live_key(self, layer: int, begin: int) -> tuple:
        return ("live", self.uid, layer, begin // self.block_tokens)

    def _live_fill(self, layer: int, begin: int):
        """Fill for a block of live positions, led by stored pages where the graft ends in it."""
        keys, values = self._keys[layer], self._values[layer]
        offset = begin - self.stored_tokens  # < 0 where the block starts with stored pages

        def fill(slot: torch.Tensor, start: int, end: int) -> None:
            if start < -offset:  # stored pages first
                self._copy_stored(layer, begin + start, min(end, -offset) + begin, slot, begin)
                start = -offset
            if start < end:
                live = slice(offset + start, offset + end)
                slot[0, :, start:end].copy_(keys[:, live], non_blocking=True)
                slot[1, :, start:end].copy_(values[:, live], non_blocking=True)

        return fill

    def cache_stored_pages(self) -> bool:
        """Whether stored pages read for attention go into the host cache.

        Yes when all of this context's stored pages fit in it (they will be
        read again, by the next graft of the same prefix); a larger context is
        a scan, and caching it would only evict what would have been hit.
        """
        pages = len(self._stored_pages) * self.geometry.num_layers
        return pages * self.stored_page_bytes <= self.tiers.host.budget_bytes

    def _staged(self, digests: list[bytes]) -> torch.Tensor:
        """Pages read (and checked) into this thread's staging buffer: [pages, 2, kv, t, D]."""
        size = self.stored_page_bytes
        staging = self.tiers.staging(len(digests) * size)
        views = [staging[i * size : (i + 1) * size] for i in range(len(digests))]
        self.tiers.host.read_into(digests, views, self.cache_stored_pages())
        return torch.from_numpy(staging).view(torch.float32).view(len(digests), *self._page_shape)

    def _stored_fill(self, digests: list[bytes]):
        kv_heads, dim, page = self.geometry.kv_heads, self.geometry.head_dim, self.page_tokens

        def fill(slot: torch.Tensor, start: int, end: int) -> None:
            if len(digests) == 1 and slot.device.type == "cpu":  # a page is a block:
                size = self.stored_page_bytes  # same layout
                target = slot.view(-1).view(torch.uint8).numpy()[:size]
                self.tiers.host.read_into(digests, [target], self.cache_stored_pages())
                return
            pages = self._staged(digests)
            # [pages, 2, kv_heads, page, D] -> [2, kv_heads, pages * page, D]
            slot[:, :, : len(digests) * page].view(2, kv_heads, len(digests), page, dim).copy_(
                pages.permute(1, 2, 0, 3, 4)
            )

        return fill

    # ------------------------------------------------------------------
    def attach(self, token_ids: Sequence[int], page_sha256: Sequence[bytes]) -> None:
        """Graft stored pages (page-major hashes) with the KV of `token_ids` into an empty context.

        Whole pages stay in the store and stream in when attended; where
        `token_ids` end inside the last page, its first rows (the KV of those
        tokens, whatever the page holds after them) are copied into the live
        buffers.
        """
        assert self.length == 0, "grafts start from an empty context"
        layers = self.geometry.num_layers
        pages = [
            page_sha256[p * layers : (p + 1) * layers] for p in range(len(page_sha256) // layers)
        ]
        whole = len(token_ids) // self.page_tokens
        self.stored_tokens = whole * self.page_tokens
        self._stored_pages = pages[:whole]
        self._reserve(len(token_ids), headroom=GRANULE_TOKENS)  # the continuation follows
        rows = len(token_ids) - self.stored_tokens
        if rows:
            self._load_rows(pages[whole], rows)
        self.token_ids = array("I", token_ids)

    def _load_rows(self, hashes: Sequence[bytes], rows: int) -> None:
        """Copy the first `rows` positions of a page (one hash per layer) to the start of the
        live buffers."""
        kv_heads, dim = self.geometry.kv_heads, self.geometry.head_dim
        with self.tiers.host.verified(list(hashes)) as data:
            for layer, page in enumerate(data):
                raw = page.view(np.float32).reshape(2, kv_heads, -1, dim)  # K then V
                if raw.shape[2] < rows:
                    raise DataLoss(f"a stored page holds {raw.shape[2]} positions, not {rows}")
                self._keys[layer].numpy()[:, :rows] = raw[0, :, :rows]
                self._values[layer].numpy()[:, :rows] = raw[1, :, :rows]

    def _copy_stored(self, layer: int, lo: int, hi: int, slot: torch.Tensor, at: int) -> None:
        """Copy stored positions [lo, hi) of `layer` into `slot`, whose first position is `at`."""
        page = self.page_tokens
        first, last = lo // page, -(-hi // page)
        digests = self.stored_digests(layer, first, last)
        spans = [(max(lo, p * page), min(hi, (p + 1) * page), p * page) for p in range(first, last)]
        if slot.device.type == "cpu":  # straight from where each page is checked
            target = slot.numpy()
            with self.tiers.host.verified(digests, self.cache_stored_pages()) as data:
                for (a, b, p0), data_page in zip(spans, data, strict=True):
                    raw = data_page.view(np.float32).reshape(self._page_shape)
                    target[:, :, a - at : b - at] = raw[:, :, a - p0 : b - p0]
            return
        staged = self._staged(digests)  # a device reads host memory: stage it
        for (a, b, p0), raw in zip(spans, staged, strict=True):
            slot[:, :, a - at : b - at].copy_(raw[:, :, a - p0 : b - p0])

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
