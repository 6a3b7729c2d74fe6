"""Every family the exact forward takes, on its tiny random model: a position's bits depend on
the tokens up to it alone, grafts equal fresh runs, and the logits are transformers'.

Each family (kvgraftd.engine.model.tiny_models: Llama, Mistral, Qwen 2 and 3, Gemma 2 and
3, Phi-3) runs as three models: its safetensors directory (tiny:FAMILY:1, float32
weights: the family as defined there, sliding windows of 8 positions, Gemma 2's soft
caps) and its GGUF file (Q8_0 and Q4_1 blocks, as transformers reads the file) with the
integer products and with the float ones. Prompts of 96 tokens cross three blocks of 32
keys and many windows. For each:

* the logits at every position and every layer's KV are SHA-256-equal across one pass,
  random chunkings, token by token, and rows batched with other contexts;
* a prefix deposited at a random token offset, grafted by a longer prompt, gives the
  receipt hashes of a fresh run;
* against transformers' own forward of the same model (eager attention, its masks): the
  float products' argmax at every position (the max |delta| printed: `pytest -s`), the
  integer products' within what 8-bit activations move.
"""

from __future__ import annotations

import contextlib
import math
import random

import pytest
import transformers

from kvgraft.errors import FailedPrecondition
from kvgraftd.engine.model import linear, native_forward, tiny_models
from kvgraftd.engine.model.fingerprint import computed_beyond_config, model_fingerprint
from kvgraftd.engine.model.model_adapter import ModelAdapter
from kvgraftd.engine.requests.decoding import DecodeOptions
from kvgraftd.engine.requests.engine import Engine
from kvgraftd.store.artifact_store import Store
from kvgraftd.tiers.device_pool import DevicePool
from kvgraftd.tiers.host_cache import HostCache
from kvgraftd.tiers.stack import Tiers
from tests.support import native_kernels
from tests.support.schedules import against_transformers, run, run_batched

PROMPT_TOKENS = 96
PAGE, BLOCK = 16, 32
VARIANTS = [
    (family, loader, products)
    for family in tiny_models.FAMILIES
    for loader, products in (("safetensors", "fp32"), ("gguf", "int8-dot"), ("gguf", "fp32"))
]

if not linear.available():
    native_kernels.missing("the native kernels are not built")


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: "-".join(v))
def variant(request) -> tuple[str, str, str]:
    """(family, loader, products)"""
    return request.param


@pytest.fixture(scope="module")
def engine(variant, model_cache, tmp_path_factory):
    family, loader, products = variant
    source = f"tiny:{family}:1"
    if loader == "gguf":
        source = str(tiny_models.tiny_files(family, 1, model_cache)[1])
    adapter = ModelAdapter.load(source, model_cache, products=products)
    store = Store(tmp_path_factory.mktemp("store"))
    try:
        yield Engine(adapter, store, page_tokens=PAGE, block_tokens=BLOCK)
    finally:
        store.close()


def tokens(seed: int, count: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(500) for _ in range(count)]


def test_the_family_runs_on_the_exact_forward(engine, variant) -> None:
    adapter = engine.adapter
    family, loader, products = variant
    # a Mistral's GGUF is read by transformers as the Llama it is (gguf-py names no Mistral)
    expected = "llama" if (family, loader) == ("mistral", "gguf") else family
    assert adapter.family.name == expected
    assert adapter.row_invariant and adapter.schedule == "any"
    formats = adapter.native.weight_formats
    if loader == "gguf":  # every product streams the file's blocks
        assert "f32" not in formats and formats
        suffix = "_i8" if products == "int8-dot" else ""
        assert all(name.endswith(suffix) for name in formats)
    else:
        assert set(formats) == {"f32"}
    windows = adapter.geometry.windows
    if loader == "safetensors" and family in ("mistral", "qwen2", "gemma2", "gemma3"):
        assert tiny_models.WINDOW in windows  # the window is exercised, not defaulted away


def test_every_schedule_gives_the_same_bits(engine) -> None:
    prompt = tokens(1)
    one_pass = run(engine, prompt, lambda done: len(prompt))
    assert run(engine, prompt, lambda done: 1) == one_pass
    rng = random.Random(23)
    for _ in range(2):
        assert run(engine, prompt, lambda done: rng.randint(1, 40)) == one_pass


def test_rows_batched_with_other_contexts_keep_their_bits(engine) -> None:
    prompt, other_tokens = tokens(2), tokens(3, 4 * PROMPT_TOKENS)
    alone = run(engine, prompt, lambda done: len(prompt))
    assert run_batched(engine, prompt, other_tokens, random.Random(5), 20, 5, 6) == alone


@pytest.mark.parametrize("block", [BLOCK, PAGE])
def test_grafts_at_random_offsets_equal_fresh_runs(engine, block, tmp_path) -> None:
    """Blocks of two pages (the stored ones through pool slots) and of one with a pool of two
    slots (a scan: stored pages read in place): a window's blocks before it are skipped either
    way."""
    with contextlib.ExitStack() as stack:
        if block != BLOCK:
            store = Store(tmp_path / "store")
            stack.callback(store.close)
            geometry = engine.adapter.geometry
            slot = (2, geometry.kv_heads, block, geometry.head_dim)
            scan = Tiers(DevicePool(2 * 4 * math.prod(slot), slot), HostCache(store, 0))
            engine = Engine(engine.adapter, store, page_tokens=PAGE, block_tokens=block, tiers=scan)
        rng = random.Random(11)
        for offset in (rng.randint(3, PAGE - 1), PAGE * 2, rng.randint(PAGE * 2 + 1, 70)):
            prompt = tokens(100 + offset, offset + 20)
            assert generated(engine, prompt[:offset], 0, deposit=True).artifact_id
            grafted, fresh = generated(engine, prompt), generated(engine, prompt, no_cache=True)
            assert grafted.receipt.reused_tokens == offset
            assert fresh.receipt.reused_tokens == 0
            for name in ("input_sha256", "prompt_logits_sha256", "generated_logits_sha256"):
                assert getattr(grafted.receipt, name) == getattr(fresh.receipt, name), name


def generated(engine: Engine, ids: list[int], new_tokens: int = 4, **options):
    """A generate's result event."""
    return list(engine.generate(ids, DecodeOptions(max_new_tokens=new_tokens, **options)))[-1]


def test_the_logits_agree_with_transformers(engine, variant) -> None:
    prompt = tokens(4)
    adapter = engine.adapter
    agree, delta = against_transformers(engine, prompt)
    family, loader, products = variant
    print(f"{family} {loader} {products}: max |logit delta| vs transformers {delta:.2e}, "
          f"argmax equal at {agree:.1%} of {len(prompt)} positions")  # fmt: skip
    if adapter.products.startswith(native_forward.INTEGER_PRODUCTS):
        assert agree >= 0.85 and delta < 0.5  # 8-bit activations against float32 ones
    else:
        assert agree == 1.0
        assert delta < 1e-4


def test_a_model_the_exact_forward_cannot_take_is_refused_or_served_on_the_fixed_schedule(
    model_cache, tmp_path
) -> None:
    """A rotary scaling that moves with the length: a Llama runs on torch's fixed schedule and
    says why; a Gemma 2 (sliding windows, soft caps: only the exact forward has them) is
    refused with what is missing named, and so is a model of another architecture with a
    sliding window."""
    for family, expect_refusal in (("llama", False), ("gemma2", True)):
        model = tiny_models.build(family, 1)
        model.config.rope_parameters = {
            "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0,
        }  # fmt: skip
        model.save_pretrained(tmp_path / family)
        if expect_refusal:
            with pytest.raises(FailedPrecondition, match="rotary scaling 'dynamic'"):
                ModelAdapter.load(str(tmp_path / family), model_cache)
        else:
            adapter = ModelAdapter.load(str(tmp_path / family), model_cache)
            assert not adapter.row_invariant
            assert adapter.schedule == "fixed (the rotary scaling 'dynamic')"
    # an architecture of no family here, with a sliding window torch's schedule would leave out
    config = transformers.Starcoder2Config(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=512, sliding_window=8, bos_token_id=None,
        eos_token_id=None,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "other")
    with pytest.raises(FailedPrecondition, match="here it lacks the 'starcoder2' architecture"):
        ModelAdapter.load(str(tmp_path / "other"), model_cache)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2", "gemma3"])
def test_windows_over_several_blocks(family, model_cache, tmp_path) -> None:
    """Blocks of 4 keys under windows of 8: a row's window over two or three blocks, those
    before it skipped. Every schedule gives the same bits, and the logits are transformers'."""
    adapter = ModelAdapter.load(f"tiny:{family}:1", model_cache, products="fp32")
    assert_exact(adapter, tmp_path, block=4)


def test_a_llama_with_biases_on_every_product(model_cache, tmp_path) -> None:
    """attention_bias and mlp_bias (q, k, v, o, gate, up and down biases): the exact forward
    takes it, every schedule the same bits, transformers' logits."""
    tiny_models.build("llama", 2, attention_bias=True, mlp_bias=True).save_pretrained(
        tmp_path / "biased"
    )
    adapter = ModelAdapter.load(str(tmp_path / "biased"), model_cache)
    assert adapter.family.biases and adapter.schedule == "any"
    assert_exact(adapter, tmp_path, block=BLOCK)


def assert_exact(adapter: ModelAdapter, tmp_path, block: int) -> None:
    store = Store(tmp_path / "store")
    try:
        engine = Engine(adapter, store, page_tokens=4, block_tokens=block)
        prompt = tokens(6, 60)
        one_pass = run(engine, prompt, lambda done: len(prompt))
        assert run(engine, prompt, lambda done: 1) == one_pass
        rng = random.Random(7)
        assert run(engine, prompt, lambda done: rng.randint(1, 13)) == one_pass
        agree, delta = against_transformers(engine, prompt)
        assert agree == 1.0 and delta < 1e-4, (agree, delta)
    finally:
        store.close()


def test_the_fingerprint_names_what_the_family_computes() -> None:
    """Two models of the same weights whose windows or soft caps differ compute different KV:
    their fingerprints differ (a Llama's names nothing more than before)."""
    fingerprints = {
        model_fingerprint(tiny_models.build("gemma2", 1, **overrides), None)
        for overrides in ({}, {"sliding_window": 16}, {"final_logit_softcapping": 7.0},
                          {"attn_logit_softcapping": 3.0}, {"query_pre_attn_scalar": 64})
    }  # fmt: skip
    assert len(fingerprints) == 5
    assert computed_beyond_config(tiny_models.build("llama", 1)) == {}
