"""Tiers: results do not depend on where KV lives or how much device memory there is.

Every comparison is of bytes: receipts' SHA-256 and the logits vectors.
"""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest

from kvgraft.errors import DataLoss, InvalidArgument
from kvgraftd.engine.model.model_adapter import ModelAdapter
from kvgraftd.engine.requests.decoding import DecodeOptions, ResultEvent
from kvgraftd.engine.requests.engine import Engine
from kvgraftd.store.artifact_store import Store
from kvgraftd.tiers.device_pool import DevicePool
from kvgraftd.tiers.host_cache import HostCache
from kvgraftd.tiers.stack import Tiers
from tests.support.on_disk import segment_files

PAGE, BLOCK = 8, 32


@pytest.fixture(scope="module")
def tiny() -> ModelAdapter:
    return ModelAdapter.load("tiny:0", Path("/nonexistent"))


@pytest.fixture
def store(tmp_path: Path):
    s = Store(tmp_path / "store")
    yield s
    s.close()


def _engine(adapter, store, device_budget: int, host_budget: int, page=PAGE, block=BLOCK) -> Engine:
    g = adapter.geometry
    pool = DevicePool(device_budget, (2, g.kv_heads, block, g.head_dim))
    tiers = Tiers(pool, HostCache(store, host_budget))
    return Engine(adapter, store, page_tokens=page, block_tokens=block, tiers=tiers)


def _result(events) -> ResultEvent:
    *_, last = events
    assert isinstance(last, ResultEvent)
    return last


def _same(a: ResultEvent, b: ResultEvent) -> None:
    assert a.prompt_logits == b.prompt_logits
    assert a.generated_logits == b.generated_logits
    for name in ("input_sha256", "prompt_logits_sha256", "generated_logits_sha256"):
        assert getattr(a.receipt, name) == getattr(b.receipt, name)
    assert list(a.receipt.generated_token_ids) == list(b.receipt.generated_token_ids)


def _slot_bytes(adapter, block=BLOCK) -> int:
    g = adapter.geometry
    return 2 * g.kv_heads * block * g.head_dim * 4


def test_pool_smaller_than_a_layer_gives_the_same_bytes(tiny, store) -> None:
    rng = random.Random(1)
    budget = 2 * _slot_bytes(tiny)
    small = _engine(tiny, store, budget, 0)
    large = _engine(tiny, store, 0, 0)
    prompt = [rng.randrange(512) for _ in range(10 * BLOCK + 3)]  # one layer: 10+ blocks
    options = DecodeOptions(max_new_tokens=6, return_logits=True, deposit=True)
    streamed = _result(small.generate(prompt, options))
    resident = _result(large.generate(prompt, options))
    _same(streamed, resident)
    pool = small.tiers.pool
    assert pool.counters.peak_bytes <= budget
    # (on CPU, blocks of live positions are read in the live buffers, not through the pool)
    # A graft of the stored context streams whole blocks from the store through both pools.
    continuation = [rng.randrange(512) for _ in range(5)]
    grafted_small = _result(small.graft(streamed.artifact_id, continuation, options))
    grafted_large = _result(large.graft(streamed.artifact_id, continuation, options))
    replayed = _result(
        small.graft(
            streamed.artifact_id,
            continuation,
            DecodeOptions(max_new_tokens=6, return_logits=True, no_cache=True),
        )
    )
    _same(grafted_small, grafted_large)
    _same(grafted_small, replayed)
    assert grafted_small.receipt.reused_tokens == len(prompt) + 6
    assert pool.counters.evictions > 0 and pool.counters.misses > 0
    assert pool.counters.peak_bytes <= budget


def test_small_host_cache_evicts_and_refills_exactly(tiny, store) -> None:
    """Two grafted contexts that each fit the host cache, but not both: they take turns."""
    rng = random.Random(2)
    g = tiny.geometry
    page_bytes = 2 * g.kv_heads * PAGE * g.head_dim * 4
    context_pages = 6 * BLOCK // PAGE * g.num_layers
    budget = context_pages * 5 // 4 * page_bytes
    engine = _engine(tiny, store, 2 * _slot_bytes(tiny), budget)
    reference = _engine(tiny, store, 0, 0)
    ids = []
    for _ in range(2):
        prompt = [rng.randrange(512) for _ in range(6 * BLOCK)]
        ids.append(_result(engine.generate(prompt, DecodeOptions(deposit=True))).artifact_id)
    options = DecodeOptions(max_new_tokens=3, return_logits=True)
    expected = [_result(reference.graft(aid, [5, 6], options)) for aid in ids]
    for turn in range(6):
        _same(_result(engine.graft(ids[turn % 2], [5, 6], options)), expected[turn % 2])
    host = engine.tiers.host
    assert host.counters.evictions > 0 and host.counters.hits > 0
    assert host.counters.peak_bytes <= budget


def test_concurrent_requests_share_one_pool_exactly(tiny, store) -> None:
    rng = random.Random(3)
    budget = 3 * _slot_bytes(tiny)
    shared = _engine(tiny, store, budget, 0)
    reference = _engine(tiny, store, 0, 0)
    prompts = [
        [rng.randrange(512) for _ in range(rng.randint(2 * BLOCK, 6 * BLOCK))] for _ in range(6)
    ]
    options = DecodeOptions(max_new_tokens=5, return_logits=True)
    expected = [_result(reference.generate(p, options)) for p in prompts]
    got: dict[int, ResultEvent] = {}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            got[index] = _result(shared.generate(prompts[index], options))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for index, result in enumerate(expected):
        _same(got[index], result)
    assert shared.tiers.pool.counters.peak_bytes <= budget


def test_budget_must_hold_two_blocks(tiny) -> None:
    with pytest.raises(InvalidArgument, match="fewer than 2 attention blocks"):
        DevicePool(_slot_bytes(tiny) + 1, (2, 2, BLOCK, 16))


def test_real_model_2048_tokens_with_less_device_memory_than_one_layer(real_model, store) -> None:
    """The issue's test: a 2,048-token context under a budget below one layer's KV."""
    rng = random.Random(4)
    block = 512
    slot = _slot_bytes(real_model, block)
    one_layer = 2048 * 2 * real_model.geometry.kv_heads * real_model.geometry.head_dim * 4
    budget = 2 * slot
    assert budget < one_layer
    small = _engine(real_model, store, budget, 0, page=64, block=block)
    large = _engine(real_model, store, 0, 0, page=64, block=block)
    prompt = [rng.randrange(49152) for _ in range(2048 - 4)]
    options = DecodeOptions(max_new_tokens=4, return_logits=True)
    streamed = _result(small.generate(prompt, options))
    resident = _result(large.generate(prompt, options))
    _same(streamed, resident)
    peak = small.tiers.pool.counters.peak_bytes
    print(f"device peak {peak} bytes, budget {budget}, one layer {one_layer}")
    assert small.tiers.pool.counters.peak_bytes <= budget


def test_boundary_block_pages_come_from_the_host_cache_exactly(tiny, store) -> None:
    """Stored pages in the block where a graft ends come from the host cache when it has them."""
    rng = random.Random(5)
    engine = _engine(tiny, store, 0, 1 << 30)
    reference = _engine(tiny, store, 0, 0)
    context = [rng.randrange(512) for _ in range(2 * BLOCK)]
    aid = _result(engine.generate(context, DecodeOptions(deposit=True))).artifact_id
    options = DecodeOptions(max_new_tokens=3, return_logits=True)
    _result(engine.graft(aid, [7], options))  # streams both blocks: the host cache admits them
    hits = engine.tiers.host.counters.hits
    # Reuses one stored block and two pages of the next: that block is stored pages, then live.
    prompt = context[: BLOCK + 2 * PAGE] + [rng.randrange(512) for _ in range(5)]
    grafted = _result(engine.generate(prompt, options))
    assert grafted.receipt.reused_tokens == BLOCK + 2 * PAGE
    assert engine.tiers.host.counters.hits >= hits + 2 * tiny.geometry.num_layers
    fresh = DecodeOptions(max_new_tokens=3, return_logits=True, no_cache=True)
    _same(grafted, _result(reference.generate(prompt, fresh)))


def test_recycled_live_buffers_change_no_result(tiny, store) -> None:
    """A closed context's buffers serve the next one, stale bytes and all."""
    rng = random.Random(6)
    engine = _engine(tiny, store, 0, 0)
    options = DecodeOptions(max_new_tokens=4, return_logits=True)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (3 * BLOCK + 5, 70, 2 * BLOCK)]
    results = []
    for prompt in prompts:
        results.append(_result(engine.generate(prompt, options)))
        assert engine.tiers.live.idle_bytes > 0  # given back when the context closed
    for prompt, result in zip(prompts, results, strict=True):
        _same(result, _result(_engine(tiny, store, 0, 0).generate(prompt, options)))


def test_one_page_blocks_scanned_in_place_give_the_same_bytes(tiny, store) -> None:
    """Blocks of one page in a scan are attended where the store keeps them, not copied."""
    rng = random.Random(7)
    block = PAGE * 4
    small = _engine(tiny, store, 2 * _slot_bytes(tiny, block), 0, page=block, block=block)
    large = _engine(tiny, store, 0, 0, page=block, block=block)
    prompt = [rng.randrange(512) for _ in range(6 * block + 3)]
    options = DecodeOptions(max_new_tokens=4, return_logits=True, deposit=True)
    aid = _result(large.generate(prompt, options)).artifact_id
    continuation = [rng.randrange(512) for _ in range(5)]
    options = DecodeOptions(max_new_tokens=4, return_logits=True)
    pool, host = small.tiers.pool.counters, small.tiers.host.counters
    grafted = _result(small.graft(aid, continuation, options))
    layers = tiny.geometry.num_layers
    stored_blocks = 6  # the artifact's 6 * block + 3 + 4 tokens: 6 whole pages
    assert grafted.receipt.reused_tokens == len(prompt) + 4
    # every forward pass read every stored block from the store, none through the pool
    assert host.misses >= 4 * stored_blocks * layers
    assert pool.misses < stored_blocks * layers
    _same(grafted, _result(large.graft(aid, continuation, options)))
    replay = DecodeOptions(max_new_tokens=4, return_logits=True, no_cache=True)
    _same(grafted, _result(large.graft(aid, continuation, replay)))


@pytest.mark.parametrize("continuation", [[1], [1, 2, 3]], ids=["decode step", "pass rows"])
def test_a_segment_cut_short_under_an_in_place_scan_fails_that_artifact_only(
    tiny, store, tmp_path, continuation
) -> None:
    """Regression: the kernel reads one-page blocks where they lie in the segments'
    mappings (a decode step's blocks, a pass's rows); a segment cut short under it is a
    fault inside the kernel, caught by the store's guard: DataLoss for the graft (this
    process lives on), the artifact quarantined, and the same prompt then computed
    afresh."""
    rng = random.Random(8)
    block = PAGE * 4
    small = _engine(tiny, store, 2 * _slot_bytes(tiny, block), 0, page=block, block=block)
    prompt = [rng.randrange(512) for _ in range(6 * block)]
    deposit = DecodeOptions(max_new_tokens=0, deposit=True)  # whole pages, no partial one
    aid = _result(small.generate(prompt, deposit)).artifact_id
    [segment] = segment_files(tmp_path / "store")
    os.truncate(segment, 0)  # every page: the first read of the graft is in place
    options = DecodeOptions(max_new_tokens=2, return_logits=True)
    # the batch that met the cut, or one on the other worker that then found its pages
    # dropped by that batch's quarantine
    unread = "could not be read from its segment file|found corrupt on disk and dropped"
    with pytest.raises(DataLoss, match=unread):
        _result(small.graft(aid, continuation, options))
    store.read_quarantine.settled()  # written on a thread of its own
    assert store.is_quarantined(aid)
    again = _result(small.generate([*prompt, *continuation], options))
    assert again.receipt.reused_tokens == 0
