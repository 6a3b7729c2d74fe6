"""Family bench: what each model family costs on the row-invariant forward, against the Llama
of the same shape and against transformers on the same weights.

Each family of kvgraftd.engine.model.tiny_models, built at the default model's shape
(SmolLM2-135M: 30 layers, 576 values a row, 9 query heads and 3 KV heads of 64, an MLP of
1,536, 49,152 tokens; random float32 weights, no download), with its own features: Qwen
2's biases, Qwen 3's head norms, Gemma's norms, GELU and scaled embedding, Gemma 2's soft
caps, sliding windows of --window positions (Mistral, Qwen 2's upper layers, Gemma 2 and
3; a Mistral's GGUF is read as a Llama, windowless), Qwen 3's heads of 128, Gemma 3's local
rotary table, Phi-3's fused weights. By default float32 weights: every family's products
are the float FMA chains (`row-invariant-fma`), so the figures compare the families'
layers, not their weights' formats. With --gguf, each model is written as a GGUF of Q8_0
and Q4_1 blocks (tiny_models.write_gguf) and served from it with the integer products,
as the default model is: transformers runs the same file, dequantized.

Per family, alternated round by round (the machine is shared and noisy; medians):
* prefill: a --prompt-token prompt through the engine, from nothing;
* decode: --decode tokens generated greedily after it (rate from the first generated
  token to the last);
* transformers: `model(ids)` for the prefill and `model.generate` (greedy, its own cache,
  eager attention: Gemma 2's soft caps need it) for the decode, on the same weights.

What bounds the figures: decode streams the weights once a token (~540 MB in float32,
~150 MB of GGUF blocks: what two cores read), the same in every family but Qwen 3 (its
heads of 128: twice the attention's products); every family runs each layer in fused
native calls and a decode step in one, its extra work (biases, norms, GELU, soft caps)
row-wise; windowed layers attend at most --window keys a position, the others the whole
prompt.

Run: .venv/bin/python bench/family_bench.py [--rounds 2] [--prompt 768] [--decode 48] [--gguf]
Last stdout line: one JSON object: per family `decode_tps`, `prefill_s`, `decode_vs_llama`,
`prefill_vs_llama` (> 1: faster than the Llama of the same shape), `decode_vs_hf`,
`prefill_vs_hf` (> 1: faster than transformers), and whether its first tokens equal
transformers' greedy ones (`tokens_equal_hf`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from kvgraftd.engine.model import tiny_models
from kvgraftd.engine.model.model_adapter import ModelAdapter
from kvgraftd.engine.requests.decoding import DecodeOptions, TokenEvent
from kvgraftd.engine.requests.engine import Engine
from kvgraftd.store.artifact_store import Store

SHAPE = {
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30,
    "head_dim": 64, "max_position_embeddings": 8192,
    "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
}  # fmt: skip
CHECKED_TOKENS = 8  # greedy tokens compared with transformers'


def build(family: str, window: int):
    class_name, extra = tiny_models.FAMILIES[family]
    # the default model's heads of 64, but Qwen 3's own 128 (its GGUF cannot say another)
    dropped = ("num_hidden_layers",) if family == "qwen3" else ("num_hidden_layers", "head_dim")
    extra = {k: v for k, v in extra.items() if k not in dropped}
    if "sliding_window" in extra:
        extra["sliding_window"] = window
    if "layer_types" in extra:  # Gemma 3: five local layers to a global one
        extra["layer_types"] = [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
            for i in range(SHAPE["num_hidden_layers"])
        ]
    config = getattr(transformers, class_name)(**{**SHAPE, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.set_attn_implementation("eager")  # Gemma 2's soft caps: not in sdpa
    return model


def engine_run(engine: Engine, prompt: list[int], decode: int) -> tuple[float, float, list[int]]:
    """(prefill seconds, decode tokens/s, the tokens)"""
    options = DecodeOptions(max_new_tokens=1, no_cache=True)
    started = time.perf_counter()
    list(engine.generate(prompt, options))
    prefill = time.perf_counter() - started
    times, tokens = [], []
    for event in engine.generate(prompt, DecodeOptions(max_new_tokens=decode, no_cache=True)):
        if isinstance(event, TokenEvent):
            times.append(time.perf_counter())
            tokens.append(event.token_id)
    return prefill, (len(times) - 1) / (times[-1] - times[0]), tokens


def hf_run(model, prompt: list[int], decode: int) -> tuple[float, float, list[int]]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        started = time.perf_counter()
        model(ids)
        prefill = time.perf_counter() - started
        started = time.perf_counter()
        out = model.generate(ids, max_new_tokens=decode, do_sample=False, min_new_tokens=decode)
        total = time.perf_counter() - started
    # the rate after the first token (its prefill taken out, as the engine's)
    return prefill, (decode - 1) / max(total - prefill, 1e-9), out[0, len(prompt) :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=768)
    parser.add_argument("--decode", type=int, default=48)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--families", default=",".join(tiny_models.FAMILIES))
    parser.add_argument("--gguf", action="store_true", help="serve Q8_0/Q4_1 GGUF files")
    args = parser.parse_args()
    torch.set_num_threads(2)
    families = args.families.split(",")
    prompt = [(7 * i + 3) % 49000 for i in range(args.prompt)]
    figures: dict[str, dict[str, list[float]]] = {f: {} for f in families}
    checked: dict[str, bool] = {}
    with tempfile.TemporaryDirectory() as scratch:
        store = Store(Path(scratch) / "store")
        for round_index in range(args.rounds):
            for family in families:
                model = build(family, args.window)
                source = Path(scratch) / (f"{family}.gguf" if args.gguf else family)
                if not source.exists():  # loaded as a user's model is
                    if args.gguf:
                        tiny_models.write_gguf(model, family, source)
                    else:
                        model.save_pretrained(source)
                cache = Path(scratch) / "cache"
                adapter = ModelAdapter.load(str(source), cache)
                if args.gguf:  # transformers runs the file's weights, as the engine does
                    model = transformers.AutoModelForCausalLM.from_pretrained(
                        cache / next(p.name for p in cache.iterdir() if p.name.startswith(family)),
                        dtype=torch.float32,
                    ).eval()
                    model.set_attn_implementation("eager")
                hf = hf_run(model, prompt, args.decode)
                engine = Engine(adapter, store)  # the daemon's pages and blocks
                native = engine_run(engine, prompt, args.decode)
                checked[family] = native[2][:CHECKED_TOKENS] == hf[2][:CHECKED_TOKENS]
                for name, value in (
                    ("prefill_s", native[0]),
                    ("decode_tps", native[1]),
                    ("hf_prefill_s", hf[0]),
                    ("hf_decode_tps", hf[1]),
                ):
                    figures[family].setdefault(name, []).append(value)
                print(f"round {round_index} {family}: prefill {native[0]:.2f} s (hf {hf[0]:.2f}), "
                      f"decode {native[1]:.1f} tokens/s (hf {hf[1]:.1f}), "
                      f"tokens equal: {checked[family]}", flush=True)  # fmt: skip
                del engine, adapter, model
        store.close()
    medians = {f: {k: statistics.median(v) for k, v in figures[f].items()} for f in families}
    llama = medians.get("llama")
    result = {}
    for family, m in medians.items():
        result[family] = {
            "decode_tps": round(m["decode_tps"], 1), "prefill_s": round(m["prefill_s"], 3),
            "decode_vs_hf": round(m["decode_tps"] / m["hf_decode_tps"], 2),
            "prefill_vs_hf": round(m["hf_prefill_s"] / m["prefill_s"], 2),
            "tokens_equal_hf": checked[family],
        }  # fmt: skip
        if llama:
            result[family]["decode_vs_llama"] = round(m["decode_tps"] / llama["decode_tps"], 2)
            result[family]["prefill_vs_llama"] = round(llama["prefill_s"] / m["prefill_s"], 2)
    print(json.dumps({"bench": "family_bench", "prompt": args.prompt, "window": args.window,
                      "families": result}))  # fmt: skip


if __name__ == "__main__":
    main()
