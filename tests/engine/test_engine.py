"""The graft engine on a tiny seeded Llama, in-process, over a real LMDB store.

Exactness is checked on bytes: receipts' SHA-256 and torch.equal on logits.
The real model gets the same checks through daemons in test_graft_exactness.py.
"""

from __future__ import annotations

import hashlib
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from kvgraft.artifact import page_sizes
from kvgraft.errors import DataLoss, FailedPrecondition, InvalidArgument
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.engine.attention.online_softmax import blockwise_attention
from kvgraftd.engine.model.model_adapter import ModelAdapter
from kvgraftd.engine.requests.decoding import DecodeOptions, ResultEvent, TokenEvent
from kvgraftd.engine.requests.engine import Engine
from kvgraftd.engine.scheduling.compute_thread import ComputeThread
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.chains import chain_pages
from kvgraftd.store.page_records import page_record
from tests.support.factory import random_artifact
from tests.support.on_disk import flip_stored_page

PAGE = 8
BLOCK = 32  # several blocks per context, so the online-softmax merge is exercised


@pytest.fixture(scope="module")
def adapter() -> ModelAdapter:
    return ModelAdapter.load("tiny:0", Path("/nonexistent"))


@pytest.fixture
def engine(adapter: ModelAdapter, tmp_path: Path):
    store = Store(tmp_path / "store")
    yield Engine(adapter, store, page_tokens=PAGE, block_tokens=BLOCK)
    store.close()


def _run(events) -> tuple[list[int], ResultEvent]:
    events = list(events)
    assert isinstance(events[-1], ResultEvent)
    tokens = [e.token_id for e in events if isinstance(e, TokenEvent)]
    assert tokens == list(events[-1].receipt.generated_token_ids)
    return tokens, events[-1]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(512) for _ in range(n)]


def _hashes(receipt: pb.Receipt) -> tuple[bytes, bytes, bytes, tuple[int, ...]]:
    return (
        receipt.input_sha256,
        receipt.prompt_logits_sha256,
        receipt.generated_logits_sha256,
        tuple(receipt.generated_token_ids),
    )


def test_generate_grafts_the_stored_prefix_and_matches_fresh(
    engine: Engine, rng: random.Random
) -> None:
    for _ in range(25):
        prefix = _tokens(rng, rng.randint(1, 5 * PAGE))
        suffix = _tokens(rng, rng.randint(1, 3 * PAGE))
        _run(engine.generate(prefix, DecodeOptions(deposit=True)))
        options = DecodeOptions(max_new_tokens=4, return_logits=True)
        _, grafted = _run(engine.generate(prefix + suffix, options))
        _, fresh = _run(
            engine.generate(
                prefix + suffix, DecodeOptions(**{**options.__dict__, "no_cache": True})
            )
        )
        assert _hashes(grafted.receipt) == _hashes(fresh.receipt)
        assert grafted.prompt_logits == fresh.prompt_logits
        assert grafted.generated_logits == fresh.generated_logits
        # the whole prefix, its partial tail page too, on the row-invariant forward (whole
        # pages only on the fixed schedule); never the last prompt token
        prompt = len(prefix) + len(suffix)
        expected = (
            len(prefix)
            if engine.adapter.row_invariant
            else min(len(prefix) // PAGE, (prompt - 1) // PAGE) * PAGE
        )
        assert grafted.receipt.reused_tokens == expected
        assert grafted.receipt.reused_tokens + grafted.receipt.computed_tokens == prompt + 4
        assert fresh.receipt.reused_tokens == 0


def test_receipt_hashes_are_the_logits(engine: Engine, rng: random.Random) -> None:
    _, result = _run(
        engine.generate(_tokens(rng, 13), DecodeOptions(max_new_tokens=3, return_logits=True))
    )
    receipt = result.receipt
    assert hashlib.sha256(result.prompt_logits).digest() == receipt.prompt_logits_sha256
    assert (
        hashlib.sha256(b"".join(result.generated_logits)).digest()
        == receipt.generated_logits_sha256
    )
    logits = [np.frombuffer(v, "<f4") for v in (result.prompt_logits, *result.generated_logits)]
    assert [int(v.argmax()) for v in logits[:3]] == list(receipt.generated_token_ids)


def test_graft_of_a_whole_artifact_matches_its_replay(engine: Engine, rng: random.Random) -> None:
    for _ in range(8):
        prompt = _tokens(rng, rng.randint(1, 4 * PAGE))
        _, deposited = _run(engine.generate(prompt, DecodeOptions(max_new_tokens=3, deposit=True)))
        continuation = _tokens(rng, rng.randint(1, 2 * PAGE))
        options = DecodeOptions(max_new_tokens=3, deposit=True)
        _, grafted = _run(engine.graft(deposited.artifact_id[:12], continuation, options))
        _, replayed = _run(
            engine.graft(
                deposited.artifact_id,
                continuation,
                DecodeOptions(max_new_tokens=3, deposit=True, no_cache=True),
            )
        )
        assert _hashes(grafted.receipt) == _hashes(replayed.receipt)
        assert grafted.artifact_id == replayed.artifact_id  # identical context, one id
        assert grafted.receipt.reused_tokens == len(prompt) + 3
        assert grafted.receipt.grafted_artifact_id == deposited.artifact_id
        assert engine.verify(grafted.artifact_id).ok


def test_deposit_is_idempotent_whether_grafted_or_fresh(engine: Engine, rng: random.Random) -> None:
    prompt = _tokens(rng, 3 * PAGE + 5)
    _, first = _run(engine.generate(prompt[: 2 * PAGE], DecodeOptions(deposit=True)))
    _, grafted = _run(engine.generate(prompt, DecodeOptions(deposit=True)))
    _, fresh = _run(engine.generate(prompt, DecodeOptions(deposit=True, no_cache=True)))
    assert grafted.receipt.reused_tokens == 2 * PAGE
    assert grafted.artifact_id == fresh.artifact_id != first.artifact_id
    assert engine.store.stats().artifacts == 2


def test_verify_recomputes_every_hash(engine: Engine, rng: random.Random) -> None:
    _, result = _run(
        engine.generate(_tokens(rng, 21), DecodeOptions(max_new_tokens=5, deposit=True))
    )
    response = engine.verify(result.artifact_id)
    assert response.ok and list(response.mismatches) == []
    assert _hashes(response.recomputed) == _hashes(response.stored)


def test_verify_reports_pages_this_model_did_not_compute(
    engine: Engine, rng: random.Random
) -> None:
    """An artifact claiming this model and profile, with random pages, fails Verify by page."""
    artifact = random_artifact(
        rng,
        num_layers=2,
        kv_heads=2,
        head_dim=16,
        kv_dtype=pb.KV_DTYPE_FLOAT32,
        tokens=11,
        page_tokens=PAGE,
        fingerprint=engine.fingerprint,
    )
    artifact.manifest.profile.CopyFrom(engine.profile)
    artifact.manifest.ClearField("token_ids")
    artifact.manifest.token_ids.extend(_tokens(rng, 11))
    records = {d: page_record(b) for d, b in artifact.pages.items()}
    aid = engine.store.commit_artifact(artifact.manifest, records).artifact_id
    response = engine.verify(aid)
    assert not response.ok
    expected = [f"page {p} layer {layer}" for p in range(2) for layer in range(2)]
    assert list(response.mismatches) == expected


def test_a_corrupt_page_is_never_grafted(engine: Engine, rng: random.Random) -> None:
    prompt = _tokens(rng, 3 * PAGE)
    _, result = _run(engine.generate(prompt, DecodeOptions(deposit=True)))
    manifest = engine.store.get_record(result.artifact_id).manifest()
    page = next(iter(page_sizes(manifest)))
    data, _ = engine.store.read_page(page)
    assert flip_stored_page(engine.store.path, data) == 1
    with pytest.raises(DataLoss, match="corrupt on disk"):
        _run(engine.graft(result.artifact_id, [1, 2], DecodeOptions()))
    # the read quarantined the artifact: refused by name, its prefix computed afresh
    with pytest.raises(DataLoss, match="quarantined"):
        _run(engine.graft(result.artifact_id, [1, 2], DecodeOptions()))
    _, again = _run(engine.generate([*prompt, 5], DecodeOptions()))
    assert again.receipt.reused_tokens == 0


def test_artifacts_of_another_model_or_profile_are_refused(
    engine: Engine, rng: random.Random
) -> None:
    other = random_artifact(
        rng,
        num_layers=2,
        kv_heads=2,
        head_dim=16,
        kv_dtype=pb.KV_DTYPE_FLOAT32,
        tokens=10,
        page_tokens=PAGE,
    )
    aid = engine.store.commit_artifact(
        other.manifest, {d: page_record(b) for d, b in other.pages.items()}
    )
    with pytest.raises(FailedPrecondition, match="computed by model"):
        _run(engine.graft(aid.artifact_id, [1], DecodeOptions()))
    other.manifest.model_fingerprint = engine.fingerprint
    other.manifest.profile.CopyFrom(engine.profile)
    other.manifest.profile.page_tokens = PAGE * 2
    other.manifest.ClearField("page_sha256")
    other.manifest.page_sha256.extend(
        hashlib.sha256(rng.randbytes(2 * 2 * 10 * 16 * 4)).digest() for _ in range(2)
    )
    with pytest.raises(FailedPrecondition):
        engine._check_compatible(other.manifest, "x" * 64)


def test_artifact_tokens_outside_the_vocabulary_are_refused(engine: Engine, rng) -> None:
    artifact = random_artifact(
        rng,
        num_layers=2,
        kv_heads=2,
        head_dim=16,
        kv_dtype=pb.KV_DTYPE_FLOAT32,
        tokens=5,
        page_tokens=PAGE,
        fingerprint=engine.fingerprint,
    )
    artifact.manifest.profile.CopyFrom(engine.profile)
    records = {d: page_record(b) for d, b in artifact.pages.items()}
    aid = engine.store.commit_artifact(artifact.manifest, records).artifact_id
    with pytest.raises(InvalidArgument, match="vocabulary"):
        engine.verify(aid)
    with pytest.raises(InvalidArgument, match="vocabulary"):
        _run(engine.graft(aid, [1], DecodeOptions(no_cache=True)))


def test_bad_requests_are_refused(engine: Engine) -> None:
    with pytest.raises(InvalidArgument, match="empty"):
        _run(engine.generate([], DecodeOptions()))
    with pytest.raises(InvalidArgument, match="vocabulary"):
        _run(engine.generate([512], DecodeOptions()))
    with pytest.raises(InvalidArgument, match="max_context_tokens"):
        _run(engine.generate([1], DecodeOptions(max_new_tokens=engine.max_context_tokens)))


def test_chain_eligibility_follows_segments() -> None:
    manifest = pb.Manifest(token_ids=list(range(40)), profile=pb.ComputeProfile(page_tokens=8))
    for ends, pages in (([40], 5), ([16, 40], 5), ([13, 40], 1), ([20, 21, 22], 2), ([7, 40], 0)):
        manifest.ClearField("segment_ends")
        manifest.segment_ends.extend(ends)
        assert chain_pages(manifest) == pages, ends


def test_sampling_is_seeded(engine: Engine, rng: random.Random) -> None:
    prompt = _tokens(rng, 9)
    runs = [
        _run(engine.generate(prompt, DecodeOptions(max_new_tokens=8, greedy=False, seed=s)))[0]
        for s in (1, 1, 2)
    ]
    assert runs[0] == runs[1] != runs[2]


def test_engine_is_the_model(adapter: ModelAdapter, engine: Engine, rng: random.Random) -> None:
    """Sanity: the engine's logits vs plain transformers (eager, one pass): same argmax, small Δ."""
    prompt = _tokens(rng, 3 * BLOCK + 5)
    _, result = _run(engine.generate(prompt, DecodeOptions(return_logits=True)))
    ours = torch.from_numpy(np.frombuffer(result.prompt_logits, "<f4").copy())
    model = adapter.model
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            reference = model(torch.tensor([prompt])).logits[0, -1].float()
    finally:
        model.set_attn_implementation("kvgraft")
    assert int(ours.argmax()) == int(reference.argmax())
    assert (ours - reference).abs().max().item() < 1e-4


def test_blockwise_attention_is_independent_of_buffer_capacity() -> None:
    """Streamed pages land in buffers of other shapes: the bytes of the result must not move."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 5, 16, generator=gen)
    keys = torch.randn(2, 100, 16, generator=gen)
    values = torch.randn(2, 100, 16, generator=gen)
    expected = blockwise_attention(q, keys, values, 95, 32, 0.25)
    for capacity in (128, 4096):
        k_buffer = torch.zeros(2, capacity, 16)
        v_buffer = torch.zeros(2, capacity, 16)
        k_buffer[:, :100], v_buffer[:, :100] = keys, values
        assert torch.equal(blockwise_attention(q, k_buffer, v_buffer, 95, 32, 0.25), expected)


def test_forward_passes_run_on_one_thread_whoever_asks(engine: Engine, rng: random.Random) -> None:
    """Requests arrive on many threads; their torch work runs on the compute thread only
    (a forward on another thread ran 1.5-2x slower: one OpenMP team per thread)."""
    seen: set[str] = set()
    # the batcher's steps run the row-invariant forward's batch; elsewhere the adapter's
    computes = engine.adapter.native or engine.adapter
    name = "forward_many" if engine.adapter.native else "forward"
    forward = getattr(computes, name)

    def spy(*args, **kwargs):
        seen.add(threading.current_thread().name)
        return forward(*args, **kwargs)

    setattr(computes, name, spy)
    try:
        results: list[ResultEvent] = []

        def request() -> None:
            results.append(_run(engine.generate(_tokens(rng, 3 * PAGE + 1), options))[1])

        options = DecodeOptions(max_new_tokens=2)
        threads = [threading.Thread(target=request) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        delattr(computes, name)
    assert len(results) == 3
    assert len(seen) == 1 and next(iter(seen)).startswith("compute"), seen


def test_an_error_on_the_compute_thread_reaches_the_caller() -> None:
    def fail() -> None:
        raise InvalidArgument("raised on the compute thread")

    compute = ComputeThread()
    with pytest.raises(InvalidArgument, match="compute thread"):
        compute.run(fail)
    assert compute.run(lambda: threading.current_thread().name).startswith("compute")
    # A daemon thread: a daemon told to stop while its model loads does not wait for the load.
    assert compute.run(lambda: threading.current_thread().daemon)
    assert compute.run(compute.here) and not compute.here()
