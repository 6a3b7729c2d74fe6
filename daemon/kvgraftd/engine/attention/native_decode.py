"""How a step's native-kernel partials are gathered, block by block, wherever each block lives.

`NativeDecode` is the part of KvContext (kvgraftd.engine.attention.kv_context) that feeds the
native attention kernel (kvgraftd.engine.model.decode_attention: DecodeSoftmax for a decode
step, RowsSoftmax for a pass's rows) and merges its partials in block order:

* stored one-page blocks read from the host cache, or copied out of the store batch by
  batch on the worker that attends them, each checked as it is attended (a corrupt page
  is DataLoss, and the store quarantines what holds it);
* blocks through device-pool slots, in batches filled while the workers attend the last;
* on CPU, blocks of live positions read in the live buffers; a decode step over live
  positions only, few enough blocks to attend inline, in one kernel call.

Every path hands the kernel the same bytes in the same block order, so the result does
not depend on which one ran (docs/architecture.md, contract 5). The batches run on the
tiers' attention workers, or inline when a step is one batch. It reads the context's
state (tiers, block and page sizes, stored pages, live buffers) and owns none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvgraft.errors import DataLoss
from kvgraftd.engine.model.decode_attention import (
    Block,
    CorruptBlock,
    DecodeSoftmax,
    InlinePartials,
    OrderedPartials,
    Partials,
)
from kvgraftd.store.page_records import CorruptPage

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvgraftd.tiers.device_pool import Slot


class NativeDecode:
    def _inline(self, total: int) -> bool:
        """Whether a step over `total` positions is one batch of blocks: computed on the
        calling thread (more are split between the attention workers)."""
        blocks = -(-total // self.block_tokens)
        return blocks <= self.tiers.attention_batch(blocks, slots=True)

    def _ordered_partials(self, merge: Callable[[Partials], None], total: int) -> OrderedPartials:
        """Block partials on the tiers' attention workers, merged in block order; computed
        on this thread when the step over `total` positions is one batch."""
        if self._inline(total):
            return InlinePartials(merge)
        return OrderedPartials(self.tiers.attention_workers, self.tiers.attention_window, merge)

    def _decode_slots(self, layer: int, in_place: int, total: int, cache: bool,
                      softmax: DecodeSoftmax, partials: OrderedPartials) -> None:  # fmt: skip
        """The blocks after the first `in_place`, in batches of slots that this thread fills
        while the workers attend the last ones (no fetch ahead, no waiting on itself)."""
        size = self.tiers.attention_batch(-(-total // self.block_tokens) - in_place, slots=True)
        batch: list[tuple[Slot, int, int]] = []

        def submit() -> None:  # handed over before submit can raise an earlier batch's error
            if batch:
                handed = batch.copy()
                batch.clear()
                partials.submit(self._slots_partial, softmax, handed)

        try:
            for slot, needed, begin in self._slots(layer, in_place, total, cache, False, submit):
                batch.append((slot, needed, begin))
                if len(batch) == size:
                    submit()
            submit()
        finally:  # an error: the slots of a batch not handed over are let go here
            for slot, _, _ in batch:
                self.tiers.pool.release(slot)

    def _one_call_step(self, total: int) -> bool:
        """Whether a decode step over `total` positions is one kernel call: every position
        live on CPU, and few enough blocks that they would be attended inline anyway."""
        return not self.stored_tokens and self._on_cpu and self._inline(total)

    def _live_blocks_read_in_place_from(self, total: int) -> int:
        """The first block from which attention reads the live buffers where they are.

        On CPU, a block of live positions only would be copied into a pool slot that
        holds the same bytes (one token more each decode step): reading them in place
        gives the same partials (contract 5) without the copy and the slot's
        bookkeeping. Elsewhere the pool holds what the device attends: no block."""
        if not self._on_cpu:
            return -(-total // self.block_tokens)
        return -(-self.stored_tokens // self.block_tokens)

    def _decode_live_blocks(
        self, layer: int, first: int, total: int, softmax: DecodeSoftmax, partials: OrderedPartials
    ) -> None:
        """Blocks from `first` to `total`, all live positions, read in the live buffers."""
        keys, values = self._keys[layer], self._values[layer]
        assert keys.is_contiguous() and values.is_contiguous(), "live buffers are contiguous"
        row = keys.stride(1) * keys.element_size()  # bytes a position
        begins = range(first * self.block_tokens, total, self.block_tokens)
        blocks = []
        for begin in begins:
            offset = (begin - self.stored_tokens) * row
            tokens = min(self.block_tokens, total - begin)
            address = keys.data_ptr() + offset, values.data_ptr() + offset
            blocks.append(Block(*address, keys.stride(0), tokens, None, begin))
        size = self.tiers.attention_batch(len(blocks))
        for batch in range(0, len(blocks), size):
            partials.submit(softmax.partials, blocks[batch : batch + size])

    def _slots_partial(
        self, softmax: DecodeSoftmax, batch: list[tuple[Slot, int, int]]
    ) -> Partials:
        try:
            return softmax.partials([softmax.slot_block(s.tensor, n, b) for s, n, b in batch])
        finally:
            for slot, _, _ in batch:
                self.tiers.pool.release(slot)

    def _decode_in_place(
        self, layer: int, blocks: int, softmax: DecodeSoftmax, partials: OrderedPartials
    ) -> None:
        """The first `blocks` one-page stored blocks, in batches, checked as they are read."""
        if not blocks:
            return
        digests = [self._stored_pages[index][layer] for index in range(blocks)]
        admit = self._cache_stored_pages()
        size = self.tiers.attention_batch(blocks)
        try:
            for first in range(0, blocks, size):
                part = digests[first : first + size]
                partials.submit(self._pages_partial, softmax, first, part, admit)
            partials.drain()
        finally:  # an earlier batch's error, raised while handing over a later one
            partials.settle()

    def _pages_partial(
        self, softmax: DecodeSoftmax, first: int, digests: list[bytes], admit: bool
    ) -> Partials:
        """Partials of the one-page blocks from block `first`, each checked as it is read.
        Each batch reads its own pages (copies out of the store, on the worker that attends
        them), so a step holds the batches in flight, not the layer's stored pages."""
        with self.tiers.host.unchecked(digests) as pages:
            for digest, (page, _) in zip(digests, pages, strict=True):
                if page.nbytes != self._stored_page_bytes:
                    raise DataLoss(f"page {digest.hex()[:16]} has the wrong size in the store")
            try:
                blocks = [
                    softmax.page_block(page, checksum, (first + i) * self.block_tokens)
                    for i, (page, checksum) in enumerate(pages)
                ]
                partials = softmax.partials(blocks)
            except CorruptBlock as corrupt:  # the store quarantines what holds it
                raise CorruptPage(digests[corrupt.index]) from None
            for digest, (page, checksum) in zip(digests, pages, strict=True):
                if admit and checksum is not None:
                    self.tiers.host.admit(digest, page)
        return partials
