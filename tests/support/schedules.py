"""A prompt through an engine's forward under one schedule, hashed: what the exactness tests
compare (the logits at every position and every layer's KV, as SHA-256 hex digests).

* `run(engine, prompt, sizes)`: passes of `sizes(done)` tokens, one context alone.
* `run_batched(engine, prompt, other_tokens, rng, ...)`: passes of 1-`chunk` tokens, each
  shared with 1-`others` other contexts' rows (1-`other_chunk` tokens each, at their own
  positions, from `other_tokens`): the prompt's digests must be those of `run`.
* `live_kv(context, layer, tokens)`: a layer's K then V of the first `tokens` positions.
* `against_transformers(engine, prompt)`: the logits of every position, ours in one pass and
  transformers' own forward of the same model (eager attention: Gemma 2's soft caps are
  not in sdpa), compared: (the share of positions whose argmax agrees, the max |delta|).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

import torch

from kvgraftd.engine.attention.kv_context import KvContext
from kvgraftd.engine.requests.engine import Engine


def run(engine: Engine, prompt: list[int], sizes: Callable[[int], int]) -> tuple[str, str]:
    logits = hashlib.sha256()
    with engine._context() as context:
        done = 0
        while done < len(prompt):
            chunk = prompt[done : done + sizes(done)]
            context.begin_chunk(done, chunk)
            logits.update(engine.adapter.forward(chunk, done, context, every_row=True).numpy())
            context.end_chunk(chunk)
            done += len(chunk)
        return logits.hexdigest(), kv_digest(engine, context, len(prompt))


def run_batched(
    engine: Engine,
    prompt: list[int],
    other_tokens: list[int],
    rng: random.Random,
    chunk: int,
    others: int,
    other_chunk: int,
) -> tuple[str, str]:
    contexts = [engine._context() for _ in range(others)]
    logits = hashlib.sha256()
    try:
        with engine._context() as context:
            done = 0
            while done < len(prompt):
                ids = prompt[done : done + rng.randint(1, chunk)]
                parts = [(context, ids, done)]
                for other in rng.sample(contexts, rng.randint(1, others)):
                    start = other.length
                    parts.append(
                        (other, other_tokens[start : start + rng.randint(1, other_chunk)], start)
                    )
                for part_context, part_ids, start in parts:
                    part_context.begin_chunk(start, part_ids)
                rows = engine.adapter.native.forward_many(parts, every_row=True)
                for part_context, part_ids, _ in parts:
                    part_context.end_chunk(part_ids)
                logits.update(rows[0].numpy())
                done += len(ids)
            return logits.hexdigest(), kv_digest(engine, context, len(prompt))
    finally:
        for other in contexts:
            other.close()


def kv_digest(engine: Engine, context: KvContext, length: int) -> str:
    kv = hashlib.sha256()
    for layer in range(engine.adapter.geometry.num_layers):
        kv.update(live_kv(context, layer, length))
    return kv.hexdigest()


def live_kv(context: KvContext, layer: int, tokens: int) -> bytes:
    keys, values = context._keys[layer], context._values[layer]
    return keys[:, :tokens].contiguous().numpy().tobytes() + values[:, :tokens].numpy().tobytes()


def against_transformers(engine: Engine, prompt: list[int]) -> tuple[float, float]:
    adapter = engine.adapter
    with engine._context() as context:
        context.begin_chunk(0, prompt)
        ours = adapter.forward(prompt, 0, context, every_row=True)
    model = adapter.model
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation("eager")
        with torch.inference_mode():
            theirs = model(torch.tensor([prompt])).logits[0]
    finally:
        model.set_attn_implementation(previous)
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    return agree, (ours - theirs).abs().max().item()
