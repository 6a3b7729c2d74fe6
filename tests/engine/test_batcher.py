"""Continuous batching (kvgraftd.engine.scheduling.batcher): many requests share forward
passes, and each gets the receipt and tokens it gets alone.

The exactness test runs the real default model in-process: eight concurrent generate calls
(prompt lengths 5-300, some grafting a stored prefix, some without the cache, greedy and
seeded sampling, other token budgets) against the same requests run one at a time. The
isolation tests (a client that leaves, a corrupt page, a flood) run a tiny seeded Llama.
"""

from __future__ import annotations

import contextlib
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvgraft.artifact import page_sizes
from kvgraft.errors import Cancelled, DataLoss, ResourceExhausted
from kvgraftd.config import PRODUCTS, DaemonConfig
from kvgraftd.engine.model import linear
from kvgraftd.engine.model.model_adapter import ModelAdapter
from kvgraftd.engine.requests.decoding import DecodeOptions, ProgressEvent, ResultEvent, TokenEvent
from kvgraftd.engine.requests.engine import Engine
from kvgraftd.engine.requests.passes import Passes
from kvgraftd.engine.scheduling.admission import Admission
from kvgraftd.engine.scheduling.batcher import Batcher
from kvgraftd.store.artifact_store import Store
from tests.support import native_kernels
from tests.support.on_disk import flip_stored_page

if not linear.available():
    native_kernels.missing("the native kernels are not built")


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


@pytest.fixture(scope="module", params=PRODUCTS)
def real_engine(request, real_model, tmp_path_factory):
    """The default model's engine, in each products (int8-dot, fp32)."""
    if not real_model.row_invariant:
        native_kernels.missing("the default model does not run on the row-invariant forward here")
    adapter = request.getfixturevalue("real_model_fp32") if request.param == "fp32" else real_model
    store = Store(tmp_path_factory.mktemp("store"))
    try:
        yield Engine(adapter, store, page_tokens=64, block_tokens=256)
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
    before = real_engine.batcher.counters.steps, real_engine.batcher.counters.contexts
    start = threading.Barrier(len(requests))

    def run(request):
        start.wait()
        return outcome(real_engine.generate(*request))

    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(run, requests))
    assert together == alone
    steps = real_engine.batcher.counters.steps - before[0]
    contexts = real_engine.batcher.counters.contexts - before[1]
    assert contexts > steps, "passes shared steps"


@pytest.fixture(scope="module")
def tiny() -> ModelAdapter:
    adapter = ModelAdapter.load("tiny:3", Path("/nonexistent"))
    if not adapter.row_invariant:
        native_kernels.missing("the tiny model does not run on the row-invariant forward here")
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


def test_a_request_whose_result_is_out_holds_no_place(tiny, tmp_path) -> None:
    """Regression: the result was handed out while the request still held its place, so a
    client that saw its stream end and called again at once (nothing may wait) was refused
    (the HTTP API's 429 right after a [DONE])."""
    engine = tiny_engine(tiny, tmp_path, max_running_contexts=1, max_queued_requests=0)
    try:
        for request in ("graft", "generate"):
            if request == "graft":
                options = DecodeOptions(max_new_tokens=0, deposit=True)
                stored = list(engine.generate([1, 2, 3, 4], options))[-1].artifact_id
                events = engine.graft(stored, [5, 6], DecodeOptions(max_new_tokens=2))
            else:
                events = engine.generate([1, 2, 3], DecodeOptions(max_new_tokens=3))
            result = next(event for event in events if isinstance(event, ResultEvent))
            assert engine.admission.running == 0, request  # the generator not yet closed
            assert outcome(engine.generate([4, 5], DecodeOptions(max_new_tokens=2)))[0]
            assert result.receipt.generated_token_ids
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


class Steps:
    """A stand-in for the forward (the batcher only schedules): records each step's parts
    and answers each with its context's name; a step holding `failing` raises `error`."""

    def __init__(self, failing: object = None, error: BaseException | None = None) -> None:
        self.seen: list[list[tuple[object, list[int]]]] = []
        self.failing, self.error = failing, error
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()

    def __call__(self, parts):
        self.entered.set()
        self.release.wait(30)
        self.seen.append([(context, list(chunk)) for context, chunk in parts])
        if self.error is not None and any(context is self.failing for context, _ in parts):
            raise self.error
        return [f"logits of {context}" for context, _ in parts]


def test_a_step_that_dies_fails_its_passes_and_the_batcher_goes_on() -> None:
    """Regression: a BaseException out of a step killed the batcher's thread, and every
    request waited for ever."""
    steps = Steps(failing="b", error=SystemExit("stop"))
    batcher = Batcher(steps, max_batch_tokens=64, max_batch_rows=8)
    with ThreadPoolExecutor(2) as pool:
        steps.release.clear()
        first = pool.submit(batcher.forward, "a", [1, 2])
        second = pool.submit(batcher.forward, "b", [3])
        while batcher.counters.waiting < 2:
            threading.Event().wait(0.005)
        steps.release.set()
        with pytest.raises(SystemExit):
            second.result(timeout=30)
        with contextlib.suppress(SystemExit):  # it shared the dying step
            first.result(timeout=30)
    assert batcher.forward("c", [4, 5, 6]) == "logits of c"


def test_no_prompt_starves_behind_decoding_contexts() -> None:
    """More decoding contexts than a step has rows: a waiting prompt still gets a row and
    half the tokens in every step, and the decoders left out lead the next one."""
    steps = Steps()
    batcher = Batcher(steps, max_batch_tokens=8, max_batch_rows=3)
    steps.release.clear()
    with ThreadPoolExecutor(6) as pool:
        passes = {"x": pool.submit(batcher.forward, "x", [9])}
        assert steps.entered.wait(30)  # a step holds: the rest wait, in this order
        for name, tokens in [("d0", [0]), ("d1", [1]), ("d2", [2]), ("d3", [3])]:
            passes[name] = pool.submit(batcher.forward, name, tokens)
            while batcher.counters.waiting < len(passes):
                threading.Event().wait(0.002)
        passes["p"] = pool.submit(batcher.forward, "p", list(range(10)))
        while batcher.counters.waiting < len(passes):
            threading.Event().wait(0.002)
        steps.release.set()
        assert {name: f.result(timeout=30) for name, f in passes.items()} == {
            name: f"logits of {name}" for name in passes
        }
    # two decoders (a row kept for the prompt), the prompt with the 6 tokens they left
    assert steps.seen[1] == [("d0", [0]), ("d1", [1]), ("p", list(range(6)))]
    assert steps.seen[2] == [("d2", [2]), ("d3", [3]), ("p", list(range(6, 10)))]


def test_a_queued_request_whose_client_left_gives_up() -> None:
    admission = Admission(max_running=1, max_queued=1)
    leaving = admission.admitted(is_active=lambda: False)
    with admission.admitted(), pytest.raises(Cancelled, match="cancelled while queued"), leaving:
        pass
    assert admission.running == 0 and admission.queued == 0


@pytest.mark.parametrize(
    ("workers", "running", "queued", "expected"),
    [(32, 16, 8, (16, 8)), (3, 16, 8, (1, 1)), (10, 16, 8, (5, 4)), (1, 4, 4, (1, 0))],
)
def test_engine_requests_leave_workers_for_the_store(workers, running, queued, expected) -> None:
    """Each running or queued engine request holds a gRPC worker: the running ones take at
    most half, the queue what is left but one (regression: 64 + 256 with 16 workers)."""
    config = DaemonConfig(
        data=Path("/nonexistent"),
        workers=workers,
        max_concurrent_rpcs=max(64, workers),
        max_running_contexts=running,
        max_queued_requests=queued,
    )
    assert config.engine_limits() == expected


def test_a_pass_whose_client_left_stops_before_its_next_step() -> None:
    """Regression: a long prompt whose client had cancelled was computed to its end (two
    minutes of CPU), and the requests behind it waited."""
    steps = Steps()
    batcher = Batcher(steps, max_batch_tokens=8, max_batch_rows=4)
    wanted = threading.Event()
    wanted.set()
    steps.release.clear()
    with ThreadPoolExecutor(2) as pool:
        prompt = pool.submit(batcher.forward, "long", list(range(100)), wanted.is_set)
        assert steps.entered.wait(30)  # its first step holds
        wanted.clear()  # the client leaves meanwhile
        steps.release.set()
        with pytest.raises(Cancelled, match="went away"):
            prompt.result(timeout=30)
    assert steps.seen == [[("long", list(range(8)))]]
    assert batcher.counters.abandoned == 1
    assert batcher.forward("next", [1, 2]) == "logits of next"  # the batcher goes on


def test_a_prompt_closed_mid_step_outlives_that_step_and_computes_nothing_more() -> None:
    """Regression: a prompt reporting progress, closed between two reports (its client went
    away) while a batcher step computed its pass, returned at once: its request gave the
    context's live buffers back (another request could take them) while the step still
    wrote them, and the rest of its tokens were computed for no one."""
    steps = Steps()
    batcher = Batcher(steps, max_batch_tokens=8, max_batch_rows=4)
    context = SimpleNamespace(wanted=lambda: True, segment_ends=[])
    steps.release.clear()
    # a batcher of Steps (no model): the prompt's pass only, no request admitted, no context made
    passes = Passes(batcher, Admission(1, 1), new_context=None, live_bytes_per_token=0)
    prompt = passes.prompt(context, list(range(100)), DecodeOptions(progress=True), reused=0)
    assert next(prompt) == ProgressEvent(0, 100, 0)
    assert next(prompt) == ProgressEvent(0, 100, 0)  # a report while its first step holds
    assert steps.entered.is_set()
    with ThreadPoolExecutor(1) as pool:
        closing = pool.submit(prompt.close)
        with pytest.raises(FutureTimeout):
            closing.result(timeout=0.3)  # the step in flight still writes the context
        steps.release.set()
        closing.result(timeout=30)
    assert steps.seen == [[(context, list(range(8)))]]
    assert batcher.counters.abandoned == 1
    assert batcher.forward("next", [1, 2]) == "logits of next"  # the batcher goes on


def test_an_engine_request_whose_client_left_computes_nothing_more(tiny, tmp_path) -> None:
    engine = tiny_engine(tiny, tmp_path)
    try:
        before = engine.batcher.snapshot().tokens
        gone = engine.generate(list(range(1, 500)), DecodeOptions(), is_active=lambda: False)
        with pytest.raises(Cancelled):
            list(gone)
        assert engine.batcher.snapshot().tokens == before
        assert engine.admission.running == 0
        tokens, _ = outcome(engine.generate([5, 6, 7], DecodeOptions(max_new_tokens=2)))
        assert len(tokens) == 2
    finally:
        engine.store.close()


def test_live_kv_is_bounded_across_requests() -> None:
    """Requests reserve their live KV when admitted: one that alone exceeds the budget is
    refused at once, one that does not fit beside the running ones waits its turn."""
    admission = Admission(max_running=8, max_queued=4, max_live_kv_bytes=100)
    refused = pytest.raises(ResourceExhausted, match=r"max_live_kv_bytes=.*shorten it")
    with refused, admission.admitted(kv_bytes=101):
        pass
    entered = threading.Event()

    def second() -> int:
        with admission.admitted(kv_bytes=50):
            entered.set()
            return admission.live_kv_bytes

    with ThreadPoolExecutor(1) as pool, admission.admitted(kv_bytes=60):
        waiting = pool.submit(second)
        while admission.queued < 1:
            threading.Event().wait(0.005)
        assert not entered.is_set() and admission.live_kv_bytes == 60
    assert waiting.result(timeout=30) == 50
    assert admission.live_kv_bytes == 0 and admission.running == 0


def test_a_request_holds_the_live_kv_it_reserved(tiny, tmp_path) -> None:
    """The live buffers are sized once for the prompt and max_new_tokens (no doubling past
    what admission reserved), and a request too large for max_live_kv_bytes is refused."""
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, layers, kv heads, head dim, float32
    engine = tiny_engine(tiny, tmp_path, max_live_kv_bytes=4096 * per_token)
    try:
        tokens, _ = outcome(
            engine.generate([t % 500 for t in range(3000)], DecodeOptions(max_new_tokens=2))
        )
        assert len(tokens) == 2
        idle = engine.tiers.live.idle_bytes  # the buffers it held, given back for the next
        assert idle == 2 * 2 * (2 * 3072 * 16 * 4)  # K and V of 2 layers, 3072 positions
        with pytest.raises(ResourceExhausted, match="max_live_kv_bytes"):
            list(engine.generate([t % 500 for t in range(4000)], DecodeOptions(max_new_tokens=200)))
    finally:
        engine.store.close()
