"""Continuous batching (kvgraftd.engine.batcher): many requests share forward passes, and each
gets the receipt and tokens it gets alone.

The exactness test runs the real default model in-process: eight concurrent generate calls
(prompt lengths 5-300, some grafting a stored prefix, some without the cache, greedy and
seeded sampling, other token budgets) against the same requests run one at a time. The
isolation tests (a client that leaves, a corrupt page, a flood) run a tiny seeded Llama.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvgraft.artifact import page_sizes
from kvgraft.errors import DataLoss, ResourceExhausted
from kvgraftd.engine import linear
from kvgraftd.engine.decoding import DecodeOptions, ResultEvent, TokenEvent
from kvgraftd.engine.engine import Engine
from kvgraftd.engine.model_adapter import ModelAdapter
from kvgraftd.store.artifact_store import Store
from tests.support.on_disk import flip_stored_page

pytestmark = pytest.mark.skipif(not linear.available(), reason="the native kernels are not built")


def outcome(events) -> tuple[list[int], tuple]:
    """The tokens and every hash of the receipt."""
    events = list(events)
    result = events[-1]
    assert isinstance(result, ResultEvent)
    receipt = result.receipt
    hashes = (
        receipt.input_sha256,
        receipt.prompt_logits_sha256,
        receipt.generated_logits_sha256,
        receipt.reused_tokens,
        receipt.computed_tokens,
    )
    return [e.token_id for e in events if isinstance(e, TokenEvent)], hashes


@pytest.fixture(scope="module")
def real_engine(real_model, tmp_path_factory):
    if not real_model.row_invariant:
        pytest.skip("the default model does not run on the row-invariant forward here")
    store = Store(tmp_path_factory.mktemp("store"))
    try:
        yield Engine(real_model, store, page_tokens=64, block_tokens=256)
    finally:
        store.close()


def test_concurrent_requests_get_the_receipts_they_get_alone(real_engine, rng) -> None:
    vocab = range(100, 40000)
    stored = [rng.choice(vocab) for _ in range(200)]
    list(real_engine.generate(stored, DecodeOptions(max_new_tokens=0, deposit=True)))
    requests = []
    for index, length in enumerate([5, 40, 70, 130, 200, 260, 300, 90]):
        # three extend the stored prefix (grafted); the rest are fresh prompts
        prompt = stored[: length - 10] + [rng.choice(vocab) for _ in range(10)]
        if index % 3:
            prompt = [rng.choice(vocab) for _ in range(length)]
        options = DecodeOptions(
            max_new_tokens=4 + 3 * index,
            no_cache=index == 5,
            greedy=index % 2 == 0,  # the others sample, seeded
            temperature=0.8,
            seed=index,
        )
        requests.append((prompt, options))
    alone = [outcome(real_engine.generate(*request)) for request in requests]
    assert sum(hashes[3] for _, hashes in alone) > 0, "some requests graft the stored prefix"
    before = real_engine.batcher.counters.steps, real_engine.batcher.counters.rows
    start = threading.Barrier(len(requests))

    def run(request):
        start.wait()
        return outcome(real_engine.generate(*request))

    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(run, requests))
    assert together == alone
    steps = real_engine.batcher.counters.steps - before[0]
    rows = real_engine.batcher.counters.rows - before[1]
    assert rows > steps, "passes shared steps"
    print(f"{rows} passes in {steps} steps")


@pytest.fixture(scope="module")
def tiny() -> ModelAdapter:
    adapter = ModelAdapter.load("tiny:3", Path("/nonexistent"))
    if not adapter.row_invariant:
        pytest.skip("the tiny model does not run on the row-invariant forward here")
    return adapter


def tiny_engine(tiny, tmp_path, **limits) -> Engine:
    return Engine(tiny, Store(tmp_path / "store"), page_tokens=8, block_tokens=32, **limits)


def test_a_request_that_leaves_frees_its_place(tiny, tmp_path) -> None:
    engine = tiny_engine(tiny, tmp_path, max_running_contexts=1, max_queued_requests=1)
    try:
        stream = engine.generate(list(range(1, 40)), DecodeOptions(max_new_tokens=50))
        next(stream)  # running: holds the one place
        waiting = ThreadPoolExecutor(1).submit(
            lambda: outcome(engine.generate([7, 8, 9], DecodeOptions(max_new_tokens=3)))
        )
        stream.close()  # the client went away mid-decode
        tokens, _ = waiting.result(timeout=60)
        assert len(tokens) == 3
        assert engine.admission.running == 0 and engine.admission.queued == 0
    finally:
        engine.store.close()


def test_a_flood_beyond_the_queue_is_refused_at_once(tiny, tmp_path) -> None:
    engine = tiny_engine(tiny, tmp_path, max_running_contexts=1, max_queued_requests=2)
    try:
        holder = engine.generate([1, 2, 3], DecodeOptions(max_new_tokens=5))
        next(holder)
        with ThreadPoolExecutor(2) as pool:
            options = DecodeOptions(max_new_tokens=2)
            queued = [
                pool.submit(lambda: outcome(engine.generate([4, 5], options))) for _ in range(2)
            ]
            while engine.admission.queued < 2:
                threading.Event().wait(0.01)
            with pytest.raises(ResourceExhausted, match="max_queued_requests=2"):
                next(engine.generate([6], DecodeOptions(max_new_tokens=1)))
            holder.close()
            assert all(len(f.result(timeout=60)[0]) == 2 for f in queued)
    finally:
        engine.store.close()


def test_a_corrupt_page_fails_its_request_alone(tiny, tmp_path) -> None:
    rng = random.Random(5)
    engine = tiny_engine(tiny, tmp_path)
    try:
        stored = [rng.randrange(512) for _ in range(64)]
        events = list(engine.generate(stored, DecodeOptions(max_new_tokens=0, deposit=True)))
        manifest = engine.store.get_record(events[-1].artifact_id).manifest()
        data, _ = engine.store.read_page(next(iter(page_sizes(manifest))))
        healthy = [([rng.randrange(512) for _ in range(30)], DecodeOptions(max_new_tokens=6))]
        healthy *= 4
        alone = [outcome(engine.generate(*request)) for request in healthy]
        assert flip_stored_page(engine.store.path, data) == 1
        start = threading.Barrier(len(healthy) + 1)

        def run(request):
            start.wait()
            return outcome(engine.generate(*request))

        with ThreadPoolExecutor(len(healthy) + 1) as pool:
            corrupt = pool.submit(run, ([*stored, 3, 4], DecodeOptions(max_new_tokens=6)))
            together = list(pool.map(run, healthy))
            with pytest.raises(DataLoss):
                corrupt.result(timeout=60)
        assert together == alone
    finally:
        engine.store.close()
