"""Page buffers (kvgraft.page_buffers): block-aligned slots, and buffers reused
only once nothing can see them."""

from __future__ import annotations

import gc
import itertools

import numpy as np

from kvgraft import page_buffers
from kvgraft.page_buffers import BLOCK_BYTES, aligned_empty, page_slots


def test_slots_start_on_blocks_have_their_sizes_and_never_overlap() -> None:
    sizes = {bytes([i]) * 32: size for i, size in enumerate((1, 4095, 4096, 4097, 98_304, 7))}
    slots = page_slots(sizes)
    assert {digest: len(slot) for digest, slot in slots.items()} == sizes
    spans = sorted((s.ctypes.data, s.ctypes.data + len(s)) for s in slots.values())
    assert all(start % BLOCK_BYTES == 0 for start, _ in spans)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    for index, slot in enumerate(slots.values()):
        slot[:] = index  # every slot writable
    assert [int(s[0]) for s in slots.values()] == list(range(len(sizes)))


def test_a_buffer_is_not_handed_out_again_while_a_view_of_it_lives() -> None:
    held = memoryview(page_slots({b"k" * 32: 3 << 20})[b"k" * 32])
    np.frombuffer(held, np.uint8)[:] = 7
    gc.collect()
    for _ in range(20):  # buffers of the same size, filled with other bytes
        other = aligned_empty(3 << 20)
        other[:] = 1
        del other
    assert bytes(held) == bytes([7]) * (3 << 20)


def test_a_buffer_nothing_references_is_reused(monkeypatch) -> None:
    monkeypatch.setattr(page_buffers, "_pool", [])  # not the idle buffers of other tests
    first = aligned_empty(5 << 20)
    address = first.ctypes.data
    del first
    gc.collect()
    again = aligned_empty(5 << 20)
    assert again.ctypes.data == address  # from the pool: no fresh pages to fault in


def test_the_pool_keeps_at_most_its_budget(monkeypatch) -> None:
    monkeypatch.setattr(page_buffers, "POOL_BYTES", 8 << 20)
    monkeypatch.setattr(page_buffers, "_pool", [])
    buffers = [aligned_empty(4 << 20) for _ in range(4)]
    del buffers
    gc.collect()
    assert sum(len(mapping) for mapping in page_buffers._pool) <= 8 << 20
