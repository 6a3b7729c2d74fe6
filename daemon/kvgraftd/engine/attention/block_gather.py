"""How the native kernel's partials are gathered, block by block, wherever each block lives.

A KvContext (kvgraftd.engine.attention.kv_context) holds one `BlockGather`, built over it,
and calls it for a step the native attention kernel takes (kvgraftd.engine.model.
decode_attention: DecodeSoftmax for a decode step, RowsSoftmax for a pass's rows). The
gather feeds the kernel and merges its partials in block order:

* stored one-page blocks read from the host cache, or where they lie in the store's
  segment mappings (copied out of it where reads are not mapped) batch by batch on the
  worker that attends them, each checked as it is attended and read under the store's
  fault guard (a corrupt or unreadable page is DataLoss, and the store quarantines what
  holds it);
* blocks through device-pool slots, in batches filled while the workers attend the last;
* on CPU, blocks of live positions read in the live buffers; a decode step over live
  positions only, few enough blocks to attend inline, in one kernel call.

Every path hands the kernel the same bytes in the same block order, so the result does
not depend on which one ran (docs/architecture.md, contract 5). The batches run on the
tiers' attention workers, or inline when a step is one batch. What the gather reads of
its context is `GatheredContext`, read at each call (the context's pages and buffers
change as it grows); it owns no state of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvgraft.errors import DataLoss
from kvgraftd.engine.attention.ordered_partials import InlinePartials, OrderedPartials
from kvgraftd.engine.model.decode_attention import (
    Block,
    CorruptBlock,
    DecodeSoftmax,
    Partials,
    UnreadBlock,
)
from kvgraftd.store.page_records import CorruptPage, unreadable_page

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import torch

    from kvgraftd.tiers.device_pool import Slot
    from kvgraftd.tiers.stack import Tiers


class GatheredContext(Protocol):
    """What a BlockGather reads of the context it gathers for (KvContext implements it)."""

    tiers: Tiers
    block_tokens: int  # keys a block
    stored_tokens: int  # positions [0, stored_tokens) are stored pages
    stored_page_bytes: int  # bytes of one stored page of one layer

    @property
    def on_cpu(self) -> bool: ...

    def stored_digests(self, layer: int, first: int, last: int) -> list[bytes]:
        """The hashes of stored pages [first, last) of `layer`."""
        ...

    def live_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The live keys and values of `layer`, [kv_heads, capacity, D], from stored_tokens."""
        ...

    def cache_stored_pages(self) -> bool:
        """Whether stored pages read for attention go into the host cache."""
        ...

    def block_slots(self, layer: int, in_place: int, total: int, cache: bool,
                    ahead: bool = True, before_wait: Callable[[], None] | None = None,
                    ) -> Iterator[tuple[Slot, int, int]]:  # fmt: skip
        """(pinned slot, positions, first position) of each block after the first `in_place`
        up to `total`, in order; the caller releases each slot."""
        ...


class BlockGather:
    """Gathers a decode step's blocks for the native kernel from wherever the context keeps them."""

    def __init__(self, context: GatheredContext) -> None:
        self._context = context

    def one_call_step(self, total: int) -> bool:
        """Whether a decode step over `total` positions is one kernel call: every position
        live on CPU, and few enough blocks that they would be attended inline anyway."""
        context = self._context
        return not context.stored_tokens and context.on_cpu and self._inline(total)

    def decode(
        self, layer: int, softmax: DecodeSoftmax, in_place: int, total: int, cache: bool
    ) -> None:
        """Merge into `softmax` the partials of every block of `layer` up to `total` that
        its rows see (a sliding window's rows none before its first block), in block order:
        the first `in_place` stored one-page blocks read where they are, then blocks through
        pool slots (`cache`: whether stored ones stay cached there), then, on CPU, blocks of
        live positions only read in the live buffers."""
        block_tokens = self._context.block_tokens
        first = softmax.first_block(block_tokens)
        live_from = max(first, self._live_blocks_read_in_place_from(total))
        slots_end = min(total, live_from * block_tokens)
        with self._ordered_partials(softmax.merge, total) as partials:
            self._decode_in_place(layer, first, in_place, softmax, partials)
            self._decode_slots(layer, max(first, in_place), slots_end, cache, softmax, partials)
            self._decode_live_blocks(layer, live_from, total, softmax, partials)

    def _inline(self, total: int) -> bool:
        """Whether a step over `total` positions is one batch of blocks: computed on the
        calling thread (more are split between the attention workers)."""
        blocks = -(-total // self._context.block_tokens)
        return blocks <= self._context.tiers.attention_batch(blocks, slots=True)

    def _ordered_partials(self, merge: Callable[[Partials], None], total: int) -> OrderedPartials:
        """Block partials on the tiers' attention workers, merged in block order; computed
        on this thread when the step over `total` positions is one batch."""
        if self._inline(total):
            return InlinePartials(merge)
        tiers = self._context.tiers
        return OrderedPartials(tiers.attention_workers, tiers.attention_window, merge)

    def _decode_slots(self, layer: int, in_place: int, total: int, cache: bool,
                      softmax: DecodeSoftmax, partials: OrderedPartials) -> None:  # fmt: skip
        """The blocks after the first `in_place`, in batches of slots that this thread fills
        while the workers attend the last ones (no fetch ahead, no waiting on itself)."""
        context = self._context
        blocks = -(-total // context.block_tokens) - in_place
        size = context.tiers.attention_batch(blocks, slots=True)
        batch: list[tuple[Slot, int, int]] = []

        def submit() -> None:  # handed over before submit can raise an earlier batch's error
            if batch:
                handed = batch.copy()
                batch.clear()
                partials.submit(self._slots_partial, softmax, handed)

        try:
            for block in context.block_slots(layer, in_place, total, cache, False, submit):
                batch.append(block)
                if len(batch) == size:
                    submit()
            submit()
        finally:  # an error: the slots of a batch not handed over are let go here
            for slot, _, _ in batch:
                context.tiers.pool.release(slot)

    def _live_blocks_read_in_place_from(self, total: int) -> int:
        """The first block from which attention reads the live buffers where they are.

        On CPU, a block of live positions only would be copied into a pool slot that
        holds the same bytes (one token more each decode step): reading them in place
        gives the same partials (contract 5) without the copy and the slot's
        bookkeeping. Elsewhere the pool holds what the device attends: no block."""
        context = self._context
        if not context.on_cpu:
            return -(-total // context.block_tokens)
        return -(-context.stored_tokens // context.block_tokens)

    def _decode_live_blocks(
        self, layer: int, first: int, total: int, softmax: DecodeSoftmax, partials: OrderedPartials
    ) -> None:
        """Blocks from `first` to `total`, all live positions, read in the live buffers."""
        context = self._context
        block_tokens, stored_tokens = context.block_tokens, context.stored_tokens
        keys, values = context.live_kv(layer)
        assert keys.is_contiguous() and values.is_contiguous(), "live buffers are contiguous"
        row = keys.stride(1) * keys.element_size()  # bytes a position
        blocks = []
        for begin in range(first * block_tokens, total, block_tokens):
            offset = (begin - stored_tokens) * row
            tokens = min(block_tokens, total - begin)
            address = keys.data_ptr() + offset, values.data_ptr() + offset
            blocks.append(Block(*address, keys.stride(0), tokens, None, begin))
        size = context.tiers.attention_batch(len(blocks))
        for batch in range(0, len(blocks), size):
            partials.submit(softmax.partials, blocks[batch : batch + size])

    def _slots_partial(
        self, softmax: DecodeSoftmax, batch: list[tuple[Slot, int, int]]
    ) -> Partials:
        try:
            return softmax.partials([softmax.slot_block(s.tensor, n, b) for s, n, b in batch])
        finally:
            for slot, _, _ in batch:
                self._context.tiers.pool.release(slot)

    def _decode_in_place(
        self, layer: int, start: int, end: int, softmax: DecodeSoftmax, partials: OrderedPartials
    ) -> None:
        """The one-page stored blocks [start, end), in batches, checked as they are read."""
        if start >= end:
            return
        context = self._context
        digests = context.stored_digests(layer, start, end)
        admit = context.cache_stored_pages()
        size = context.tiers.attention_batch(end - start)
        try:
            for offset in range(0, end - start, size):
                part = digests[offset : offset + size]
                partials.submit(self._pages_partial, softmax, start + offset, part, admit)
            partials.drain()
        finally:  # an earlier batch's error, raised while handing over a later one
            partials.settle()

    def _pages_partial(
        self, softmax: DecodeSoftmax, first: int, digests: list[bytes], admit: bool
    ) -> Partials:
        """Partials of the one-page blocks from block `first`, each checked as it is read.
        Each batch reads its own pages (where they lie in the store, or copies where reads
        are not mapped, on the worker that attends them), so a step holds the batches in
        flight, not the layer's stored pages."""
        context = self._context
        host = context.tiers.host
        with host.unchecked(digests) as pages:
            for digest, (page, _) in zip(digests, pages, strict=True):
                if page.nbytes != context.stored_page_bytes:
                    raise DataLoss(f"page {digest.hex()[:16]} has the wrong size in the store")
            try:
                blocks = [
                    softmax.page_block(page, checksum, (first + i) * context.block_tokens)
                    for i, (page, checksum) in enumerate(pages)
                ]
                partials = softmax.partials(blocks)
            except CorruptBlock as corrupt:  # the store quarantines what holds it
                raise CorruptPage(digests[corrupt.index]) from None
            except UnreadBlock as unread:  # its segment was cut short, or the disk failed
                raise unreadable_page(digests[unread.index]) from None
            for digest, (page, checksum) in zip(digests, pages, strict=True):
                if admit and checksum is not None:
                    host.admit(digest, page)
        return partials
