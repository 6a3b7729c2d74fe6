"""Quality bench: the integer products (int8-dot, the default) against the float ones (fp32).

What, on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF, CPU), in one process:

* perplexity of a held text, bench/data/held_text.txt (1,286 words written for this
  bench in this repository, never fetched: a story, a technical passage, a dialogue and a
  notice), computed as one context in one pass, every position's logits, under each
  products; `perplexity_ratio` = int8-dot's / fp32's (the issue's bound: <= 1.01);
* greedy continuations of 32 tokens for 20 chat prompts under each: how many agree token
  for token (`continuations_equal_32`), and the mean length of their common prefix.

Both run the same weights (the GGUF file's blocks); only the arithmetic of the products
differs: fp32 multiplies the dequantized weights in float (transformers' numbers to
~1e-4), int8-dot quantizes each activation row to 8 bits a block of 32 first, as
llama.cpp does. What bounds the figures: the 8-bit activations' rounding (about 0.5 % of
a product's magnitude), and on the continuations, how near the top two logits come (one
flip changes the rest of a greedy continuation).

Run: .venv/bin/python bench/quality_bench.py [--tokens 32]
Last stdout line: one JSON object with perplexity_ratio, perplexity_int8, perplexity_fp32,
continuations_equal_32, prompts, mean_common_prefix.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import tempfile
from pathlib import Path

import torch

from kvgraftd.engine.model.model_adapter import ModelAdapter
from kvgraftd.engine.requests.decoding import DecodeOptions, TokenEvent
from kvgraftd.engine.requests.engine import Engine
from kvgraftd.store.artifact_store import Store

ROOT = Path(__file__).resolve().parent.parent
MODEL_CACHE = ROOT / ".cache" / "models"
HELD_TEXT = ROOT / "bench" / "data" / "held_text.txt"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "How many legs does a spider have?",
    "Give me three tips for learning to cook.",
    "What is 17 times 3?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Name a famous painting by Leonardo da Vinci.",
    "What does a lighthouse keeper do?",
    "Summarize the plot of Romeo and Juliet.",
    "What is the boiling point of water at sea level?",
    "Suggest a name for a small bakery.",
    "What is a prime number?",
    "Describe a rainy afternoon in two sentences.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Write the first line of a mystery novel.",
    "What is the difference between weather and climate?",
    "List three animals that live in the Arctic.",
]


def perplexity(engine: Engine, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:] given what precedes each."""
    with engine._context() as context:
        context.begin_chunk(0, ids)
        logits = engine.adapter.forward(ids, 0, context, every_row=True)
        context.end_chunk(ids)
    log_probs = torch.log_softmax(logits[:-1].double(), dim=-1)
    targets = torch.tensor(ids[1:])
    return math.exp(-log_probs[torch.arange(len(targets)), targets].mean().item())


def continuation(engine: Engine, prompt: list[int], tokens: int) -> list[int]:
    options = DecodeOptions(max_new_tokens=tokens, no_cache=True)
    events = engine.generate(prompt, options)
    return [event.token_id for event in events if isinstance(event, TokenEvent)]


def common_prefix(first: list[int], second: list[int]) -> int:
    """How many leading tokens the two continuations share."""
    pairs = zip(first, second, strict=False)
    return sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], pairs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32, help="tokens a continuation")
    args = parser.parse_args(argv)

    integer = ModelAdapter.load(None, MODEL_CACHE, products="int8-dot")
    if not integer.row_invariant:
        print("quality_bench: the native kernels are not built here", file=sys.stderr)
        return 1
    adapters = {"int8": integer, "fp32": integer.with_products("fp32")}
    ids = integer.encode(HELD_TEXT.read_text())
    prompts = [integer.encode(prompt, chat=True) for prompt in PROMPTS]
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        engines = {
            name: Engine(adapter, store, max_context_tokens=1 << 14)
            for name, adapter in adapters.items()
        }
        ppl = {name: perplexity(engine, ids) for name, engine in engines.items()}
        print(f"perplexity over {len(ids)} tokens: {ppl}", flush=True)
        prefixes = []
        for index, prompt in enumerate(prompts):
            first, second = (continuation(e, prompt, args.tokens) for e in engines.values())
            prefixes.append(common_prefix(first, second))
            print(f"prompt {index + 1:2d}: common prefix {prefixes[-1]} of {args.tokens}")
        store.close()
    result = {
        "perplexity_ratio": round(ppl["int8"] / ppl["fp32"], 4),
        "perplexity_int8": round(ppl["int8"], 3),
        "perplexity_fp32": round(ppl["fp32"], 3),
        "held_text_tokens": len(ids),
        f"continuations_equal_{args.tokens}": sum(p >= args.tokens for p in prefixes),
        "prompts": len(prompts),
        "mean_common_prefix": round(sum(prefixes) / len(prefixes), 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
