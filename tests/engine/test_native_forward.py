"""The row-invariant forward on the real model: a position's bits depend on the tokens up to it,
not on how the passes were cut, in both products (int8-dot, the default, and fp32).

A prompt of the default model (SmolLM2-135M-Instruct, float32, CPU) runs through
kvgraftd's own forward (kvgraftd.engine.model.native_forward) under several schedules:
one pass, 64-token chunks, random chunkings (1-300 tokens a pass), token by token,
and with 1 and 2 threads for the products. The logits at every position and the
bytes of every KV page must be SHA-256-equal across them all. Separately, the fp32
products' logits agree with a plain transformers forward (same argmax; the small
difference, another summation order, is reported), and the integer products' stay close
to them (bench/quality_bench.py measures how close: perplexity, continuations).
"""

from __future__ import annotations

import hashlib
import random
import tempfile
from pathlib import Path

import pytest
import torch

from kvgraft.errors import FailedPrecondition
from kvgraftd.config import PRODUCTS
from kvgraftd.engine.model import linear, native_forward
from kvgraftd.engine.model.gguf_weights import GgufWeights
from kvgraftd.engine.model.model_adapter import default_model_path
from kvgraftd.engine.requests.engine import Engine
from kvgraftd.store.artifact_store import Store
from tests.support import native_kernels
from tests.support.schedules import against_transformers, live_kv, run, run_batched

PROMPT_TOKENS = 1000
RANDOM_CHUNKINGS = 4  # of 1-300 tokens a pass, with the one pass and 64-token pages: 6 schedules
PAGE = 64

if not linear.available():
    native_kernels.missing("the native kernels are not built")


@pytest.fixture(scope="module", params=PRODUCTS)
def engine(request, real_model, tmp_path_factory):
    if not real_model.row_invariant:
        native_kernels.missing("the default model does not run on the row-invariant forward here")
    fixture = "real_model" if request.param == "int8-dot" else "real_model_fp32"
    store = Store(tmp_path_factory.mktemp("store"))
    try:
        yield Engine(request.getfixturevalue(fixture), store, page_tokens=PAGE, block_tokens=256)
    finally:
        store.close()


@pytest.fixture(scope="module")
def prompt(real_model) -> list[int]:
    text = " ".join(
        f"Item {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7 % 13} stones."
        for i in range(200)
    )
    ids = real_model.encode(text)
    assert len(ids) >= PROMPT_TOKENS
    return ids[:PROMPT_TOKENS]


def test_every_schedule_gives_the_same_bits(engine, prompt) -> None:
    one_pass = run(engine, prompt, lambda done: len(prompt))
    assert run(engine, prompt, lambda done: PAGE) == one_pass
    rng = random.Random(23)
    for _ in range(RANDOM_CHUNKINGS):
        assert run(engine, prompt, lambda done: rng.randint(1, 300)) == one_pass


def test_token_by_token_and_threads_give_the_same_bits(engine, prompt, monkeypatch) -> None:
    short = prompt[:300]
    one_pass = run(engine, short, lambda done: len(short))
    assert run(engine, short, lambda done: 1) == one_pass
    monkeypatch.setattr(linear, "THREADS", 1)
    assert run(engine, short, lambda done: 37) == one_pass


def test_rows_batched_with_other_contexts_keep_their_bits(engine, prompt) -> None:
    """The prompt's rows in passes shared with 1-7 other contexts at other positions (each
    with its own KV): the same logits and KV as the prompt alone in one pass."""
    short = prompt[:300]
    alone = run(engine, short, lambda done: len(short))
    batched = run_batched(engine, short, prompt[300:], random.Random(5), 40, 7, 9)
    assert batched == alone


def test_the_logits_agree_with_transformers(engine, prompt) -> None:
    """fp32 products: transformers' argmax at every position. int8-dot: its logits within
    what 8-bit activations move them, the argmax at nearly every position."""
    adapter = engine.adapter
    agree, delta = against_transformers(engine, prompt[:200])
    print(f"{adapter.products}: max |logit delta| vs transformers {delta:.2e}, argmax {agree:.1%}")
    if adapter.products.startswith(native_forward.INTEGER_PRODUCTS):
        assert agree >= 0.95 and delta < 2.0
    else:
        assert agree == 1.0
        assert delta < 1e-2  # another summation order; the argmax above is what must hold


def test_a_short_deposit_is_grafted_by_a_prompt_that_extends_it(engine, prompt) -> None:
    """14 tokens deposited (less than a page) are reused by a later generate that extends them,
    and the result is byte-identical to a fresh run."""
    from kvgraftd.engine.requests.decoding import DecodeOptions, ResultEvent

    def result(ids, new_tokens=3, **options) -> ResultEvent:
        events = list(engine.generate(ids, DecodeOptions(max_new_tokens=new_tokens, **options)))
        return events[-1]

    short = prompt[:14]
    deposited = result(short, new_tokens=0, deposit=True)
    assert deposited.artifact_id
    longer = prompt[:14] + prompt[500:540]
    grafted, fresh = result(longer), result(longer, no_cache=True)
    assert grafted.receipt.reused_tokens == 14
    assert fresh.receipt.reused_tokens == 0
    for name in ("input_sha256", "prompt_logits_sha256", "generated_logits_sha256"):
        assert getattr(grafted.receipt, name) == getattr(fresh.receipt, name), name


def test_the_gguf_blocks_give_the_bits_of_the_float32_weights(real_model_fp32, prompt) -> None:
    """The default model's products stream its GGUF file's Q4_1 / Q8_0 blocks; a forward
    over float32 copies of the same weights gives the same logits and KV, byte for byte."""
    assert real_model_fp32.native.weight_formats == {"q4_1": 4 * 30, "q8_0": 1}
    ids = prompt[:300]
    float32 = native_forward.NativeForward(real_model_fp32.model)  # no GGUF file: float32 packs
    assert float32.weight_formats == {"f32": 4 * 30 + 1}
    assert float32.products_profile == native_forward.FLOAT_PRODUCTS
    store = Store(Path(tempfile.mkdtemp()))
    engine = Engine(real_model_fp32, store, page_tokens=PAGE, block_tokens=256)
    results = []
    try:
        for forward in (real_model_fp32.native, float32):
            with engine._context() as context:
                context.begin_chunk(0, ids)
                logits = forward.forward(ids, 0, context, every_row=True)
                kv = live_kv(context, 29, len(ids))
                results.append((hashlib.sha256(logits.numpy().tobytes()).hexdigest(), kv))
    finally:
        store.close()
    assert results[0] == results[1]


def test_the_integer_products_stream_the_same_blocks(real_model) -> None:
    """int8-dot multiplies by the same GGUF blocks, laid out for integer dot products."""
    assert real_model.native.weight_formats == {"q4_1_i8": 4 * 30, "q8_0_i8": 1}
    assert real_model.products.startswith(native_forward.INTEGER_PRODUCTS)


def test_the_embedding_is_read_from_the_tied_output_blocks(real_model) -> None:
    """The default model's embedding is its output product's (tied, Q8_0 blocks): a lookup
    from the blocks gives the model's float32 rows bit for bit, so a daemon frees the table;
    an id outside the vocabulary is refused, not read."""
    native = real_model.native
    blocks = native._embedding_blocks
    assert blocks is native.logits and blocks.format == "q8_0_i8"
    table = real_model.model.model.embed_tokens.weight
    ids = torch.tensor([0, 1, 2, 17, 4095, table.shape[0] - 1, 17])
    assert torch.equal(native._embedding(ids.tolist()), table[ids])
    with pytest.raises(ValueError, match="outside"):
        blocks.rows(torch.tensor([table.shape[0]]))


def test_a_gguf_tensor_unequal_to_the_models_weight_is_not_used(real_model) -> None:
    """Only blocks proven equal to the model's weights replace them: one changed float and
    the product keeps the float32 weights."""
    weights = GgufWeights.open(default_model_path(), real_model.model)
    name = "model.layers.3.mlp.down_proj.weight"
    assert weights.packed([name]).format == "q4_1"
    parameter = real_model.model.get_parameter(name)
    saved = parameter.data[5, 7].item()
    try:
        parameter.data[5, 7] = saved + 1e-3
        assert weights.packed([name]) is None
    finally:
        parameter.data[5, 7] = saved


def test_verify_recomputes_an_artifact_in_full_passes(engine, prompt, monkeypatch) -> None:
    """A deposit of a prompt and generated tokens (a segment each) is verified in passes of
    max_batch_tokens, whatever its segments (not a decode step per generated token), logits
    taken at the segments' ends only: every hash still equal."""
    from kvgraftd.engine.requests.decoding import DecodeOptions

    options = DecodeOptions(max_new_tokens=6, deposit=True, no_cache=True)
    result = list(engine.generate(prompt[:150], options))[-1]
    native = engine.adapter.native
    passes = []
    original = native.forward_many

    def counted(parts, *args, **kwargs):
        passes.append(sum(len(ids) for _, ids, _ in parts))
        return original(parts, *args, **kwargs)

    monkeypatch.setattr(native, "forward_many", counted)
    verified = engine.verify(result.artifact_id)
    assert verified.ok, list(verified.mismatches)
    budget = engine.batcher.max_batch_tokens
    assert passes == [budget, 150 + 6 - budget]  # the prompt and every generated token


def test_the_profile_names_the_products_and_no_c_library(engine) -> None:
    """The products are part of the arithmetic (artifacts computed under others are another
    profile: refused, not grafted); the exp, sin and cos are the kernels' own, so the
    profile names no C library and a receipt re-checks under any."""
    products = engine.adapter.native.products_profile
    assert products in (native_forward.INTEGER_PRODUCTS, native_forward.FLOAT_PRODUCTS)
    assert engine.profile.products == products
    assert "libc" not in str(engine.profile)
    assert engine.profile.attention.startswith("kvgraft-blockwise-online-softmax/2 ")


def test_a_step_of_decode_rows_in_one_call_has_the_bits_of_the_layer_by_layer_path(
    engine: Engine, prompt: list[int]
) -> None:
    """A step whose rows are all decode steps over live positions runs every layer in one
    native call (kvg_decode_layers, its attention split between the threads); a step that
    also holds a prompt's rows goes layer by layer. Three contexts' next tokens in both
    kinds of step: their logits and the K, V written must be SHA-256-equal."""
    step = engine.batcher._run_step
    outcomes = []
    for mixed in (False, True):
        contexts = [engine._context() for _ in range(4)]
        try:
            for index, context in enumerate(contexts[:3]):  # three decoding contexts
                step([(context, prompt[index * 50 : index * 50 + 100 + index])])
            items = [(context, [prompt[500 + i]]) for i, context in enumerate(contexts[:3])]
            if mixed:  # and a prompt's chunk in the same step
                items.append((contexts[3], prompt[600:640]))
            logits = step(items)[:3]
            kv = hashlib.sha256()
            for context in contexts[:3]:
                for layer in range(engine.adapter.geometry.num_layers):
                    kv.update(live_kv(context, layer, context.length))
            outcomes.append(([hashlib.sha256(row.numpy()).hexdigest() for row in logits], kv))
        finally:
            for context in contexts:
                context.close()
    (alone, kv_alone), (mixed, kv_mixed) = outcomes
    assert alone == mixed
    assert kv_alone.hexdigest() == kv_mixed.hexdigest()


def test_an_artifact_of_the_other_products_is_refused_and_recomputed(
    real_model, real_model_fp32, prompt, tmp_path
) -> None:
    """A deposit computed with fp32 products, grafted where int8-dot runs: refused, saying how
    to recompute; a generate of the same prompt there recomputes instead of reusing it."""
    from kvgraftd.engine.requests.decoding import DecodeOptions

    store = Store(tmp_path / "store")
    try:
        fp32 = Engine(real_model_fp32, store, page_tokens=PAGE, block_tokens=256)
        options = DecodeOptions(max_new_tokens=0, deposit=True)
        deposited = list(fp32.generate(prompt[:80], options))[-1]
        integer = Engine(real_model, store, page_tokens=PAGE, block_tokens=256)
        with pytest.raises(FailedPrecondition, match="--products fp32"):
            list(integer.graft(deposited.artifact_id, prompt[80:90], DecodeOptions()))
        result = list(integer.generate(prompt[:90], DecodeOptions(max_new_tokens=2)))[-1]
        assert result.receipt.reused_tokens == 0
        again = list(fp32.generate(prompt[:90], DecodeOptions(max_new_tokens=2)))[-1]
        assert again.receipt.reused_tokens == 80
        # regression: an artifact of an earlier version's products (the int8 profile before
        # it dropped libc) was told to go to a --products fp32 daemon, where it fails too
        old = store.get_record(deposited.artifact_id).manifest()
        old.profile.products = "int8-dot/1 row-invariant-fma rowwise=1 libc=glibc-2.36"
        with pytest.raises(FailedPrecondition, match=r"deposit\)$"):
            integer._check_compatible(old, deposited.artifact_id)
    finally:
        store.close()
