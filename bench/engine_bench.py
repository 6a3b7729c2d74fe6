"""Engine bench: prefill and decode speed of the row-invariant forward against the torch path
and plain transformers.

What, on the real default model (SmolLM2-135M-Instruct, float32, CPU), in one process:

* prefill: a 2,048-token prompt computed from nothing (no graft).
* decode: 128 tokens generated greedily after a 512-token prompt; the rate is
  counted from the first generated token to the last (the prompt's pass is
  not in it).

Four variants, alternated round by round (the machine is shared and noisy;
medians of the rounds are reported):

* native: the engine (kvgraftd.engine.requests.engine.Engine) on the row-invariant
  forward (kvgraftd.engine.model.native_forward: the native linear kernel, prefill
  rows attended as decode steps, passes of up to 512 tokens), with its default
  products, int8-dot (activations quantized to 8 bits, integer dot products);
* fp32: the same with --products fp32 (the dequantized weights in float FMA chains);
* torch path: the same engine with the native forward switched off (the
  transformers modules, torch's products, the fixed schedule: 64-token passes
  split at page boundaries);
* transformers: `model(ids)` in one pass for prefill and `model.generate`
  (greedy, its own KV cache, SDPA attention) for decode, on the same weights.

The decode step's time outside the kernels: 1 and 8 contexts decoding together on the
native engine (each its own prompt of --decode-prompt tokens, --decode new tokens,
greedy, from 8 threads as the daemon's requests arrive), over the steps where every
context decodes: wall time per step less the time spent inside the native libraries'
calls (each timed at its ctypes call, so the wrapper's own ~0.3 us a call counts as
outside). What is left is the interpreter, torch's small ops (the embedding, the token
choice), hand-offs between threads: `decode_overhead_ms_1`, `decode_overhead_ms_8`.

Also, where `make bench-peers` installed llama-cpp-python (optional, in .venv-peers), llama.cpp
prefilling and decoding the same GGUF with 2 threads, in a process of its own
(bench/llamacpp_peer.py), each round after the others. The fp32 and torch engine runs
are checked to generate the same tokens as transformers' greedy decode for the first
steps (a fast wrong answer is not a result; int8-dot's numbers are others:
bench/quality_bench.py measures how close).

What bounds the figures: decode streams the GGUF blocks once a token (~80 MB of Q4_1
panels and 30 MB of Q8_0 logits weights: ~3-4 ms at what two cores read) plus the
attention over the context; prefill is the products' multiply-adds (~0.28 T for 2,048
tokens: on AVX2, vpmaddubsw's 32 a cycle a core bound int8-dot; fp32 FMA's 16) and
attention's (quadratic in the prompt).

Run: .venv/bin/python bench/engine_bench.py [--rounds 2] [--prefill 2048] [--decode 128]
Last stdout line: one JSON object with prefill_vs_hf, decode_vs_hf,
prefill_vs_torch_path, decode_vs_torch_path, prefill_vs_fp32, decode_vs_fp32 (ratios of
speed: > 1 means the native engine with int8-dot is faster), decode_overhead_ms_1,
decode_overhead_ms_8, rss_bytes (this process's resident memory at the end: the
transformers model and both packings included, not the daemon's) and the raw figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch

from kvgraftd.engine.model import decode_attention, linear
from kvgraftd.engine.model.model_adapter import ModelAdapter, default_model_path
from kvgraftd.engine.requests.decoding import DecodeOptions, ResultEvent, TokenEvent
from kvgraftd.engine.requests.engine import Engine
from kvgraftd.store.artifact_store import Store

ROOT = Path(__file__).resolve().parent.parent
MODEL_CACHE = ROOT / ".cache" / "models"
PEER_PYTHON = ROOT / ".venv-peers" / "bin" / "python"  # llama-cpp-python's (make bench-peers)
CHECKED_TOKENS = 8  # greedy tokens compared with transformers'


def prompt_tokens(adapter: ModelAdapter, count: int) -> list[int]:
    text = " ".join(
        f"Record {i}: the {['north', 'south', 'east', 'west'][i % 4]} gate opened at {i % 24} "
        f"o'clock and {i * 13 % 97} carts passed."
        for i in range(count)
    )
    ids = adapter.encode(text)
    assert len(ids) >= count
    return ids[:count]


def engine_prefill(engine: Engine, prompt: list[int]) -> float:
    started = time.perf_counter()
    events = list(engine.generate(prompt, DecodeOptions(max_new_tokens=0, no_cache=True)))
    assert isinstance(events[-1], ResultEvent)
    return time.perf_counter() - started


def engine_decode(engine: Engine, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    """Tokens per second from the first generated token to the last, and the tokens."""
    first, tokens = None, []
    options = DecodeOptions(max_new_tokens=steps, no_cache=True)
    for event in engine.generate(prompt, options):
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
            if first is None:
                first = time.perf_counter()
    elapsed = time.perf_counter() - first
    return (len(tokens) - 1) / elapsed, tokens


class KernelClock:
    """Nanoseconds spent inside the native libraries' calls, on any thread: each of their
    functions replaced, on the loaded library, by one that times the call."""

    def __init__(self) -> None:
        self.nanoseconds = 0

    @contextmanager
    def timing(self):
        libraries = [linear.native_library(), decode_attention.native_library()]
        names = [
            (library, name)
            for library in libraries
            for name in dir(library)
            if name.startswith("kvg_") and callable(getattr(library, name))
        ]
        originals = [(library, name, getattr(library, name)) for library, name in names]
        for library, name, function in originals:
            setattr(library, name, self._timed(function))
        try:
            yield self
        finally:
            for library, name, function in originals:
                setattr(library, name, function)

    def _timed(self, function):
        clock = time.perf_counter_ns

        def call(*args):
            began = clock()
            try:
                return function(*args)
            finally:
                self.nanoseconds += clock() - began

        return call


def decode_overhead(engine: Engine, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """Milliseconds a decode step takes, and spends outside the native kernels,
    `len(prompts)` contexts decoding together (one thread each, as requests): measured from
    the moment the last prompt is done to the moment the first context has its last token."""
    count = len(prompts)
    tokens = [0] * count
    marks: dict[str, tuple[float, int, int]] = {}
    lock = threading.Lock()
    clock = KernelClock()

    def mark(name: str) -> None:
        marks[name] = (time.perf_counter(), clock.nanoseconds, engine.batcher.snapshot().steps)

    def one(index: int) -> None:
        options = DecodeOptions(max_new_tokens=steps, no_cache=True)
        for event in engine.generate(prompts[index], options):
            if isinstance(event, TokenEvent):
                with lock:
                    tokens[index] += 1
                    if tokens[index] == 1 and all(tokens):
                        mark("all decoding")
                    if tokens[index] == steps and "first done" not in marks:
                        mark("first done")

    with clock.timing():
        threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    (t0, k0, s0), (t1, k1, s1) = marks["all decoding"], marks["first done"]
    count = max(1, s1 - s0)
    return 1e3 * (t1 - t0) / count, 1e3 * ((t1 - t0) - (k1 - k0) / 1e9) / count


def hf_prefill(model, prompt: list[int]) -> float:
    with torch.inference_mode():
        started = time.perf_counter()
        model(torch.tensor([prompt]), use_cache=False, logits_to_keep=1)
        return time.perf_counter() - started


def hf_decode(model, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    ids = torch.tensor([prompt])

    def generate(new: int):
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )
        return time.perf_counter() - started, out[0, len(prompt) :].tolist()

    one, _ = generate(1)
    many, tokens = generate(steps)
    return (steps - 1) / (many - one), tokens


def llamacpp_peer(prefill: list[int], prompt: list[int], steps: int) -> dict | None:
    """llama.cpp on the same GGUF, 2 threads, in its own process (bench/llamacpp_peer.py with
    the peer's environment, `make bench-peers`), or None where that is not installed."""
    if not PEER_PYTHON.exists():
        return None
    job = {"model": str(default_model_path()), "prefill": prefill, "decode_prompt": prompt}
    job |= {"decode": steps, "threads": 2}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
        json.dump(job, file)
        file.flush()
        run = subprocess.run(
            [str(PEER_PYTHON), str(ROOT / "bench" / "llamacpp_peer.py"), file.name],
            capture_output=True, text=True, timeout=1200,
        )  # fmt: skip
    if run.returncode:
        print(f"llama.cpp peer failed: {run.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(run.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds (default 2)")
    parser.add_argument("--prefill", type=int, default=2048, help="prefill prompt tokens")
    parser.add_argument("--decode-prompt", type=int, default=512, help="decode's prompt tokens")
    parser.add_argument("--decode", type=int, default=128, help="tokens decoded")
    args = parser.parse_args(argv)

    adapter = ModelAdapter.load(None, MODEL_CACHE)
    if not adapter.row_invariant:
        print("engine_bench: the native kernels are not built here", file=sys.stderr)
        return 1
    fp32_adapter = adapter.with_products("fp32")
    torch_adapter = copy.copy(adapter)
    torch_adapter.native = None  # the transformers modules, on the fixed schedule
    model = adapter.model
    long_prompt = prompt_tokens(adapter, args.prefill)
    short_prompt = long_prompt[: args.decode_prompt]
    variants = ("native", "fp32", "torch", "hf")
    peer: dict[str, list[float]] = {"prefill_s": [], "decode_tokens_per_s": []}
    figures: dict[str, list[float]] = {key: [] for key in variants}
    rates: dict[str, list[float]] = {key: [] for key in variants}
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        engines = {
            "native": Engine(adapter, store, max_context_tokens=1 << 16),
            "fp32": Engine(fp32_adapter, store, max_context_tokens=1 << 16),
            "torch": Engine(torch_adapter, store, max_context_tokens=1 << 16),
        }
        hf_tokens: list[int] = []
        cores = torch.get_num_threads()
        for round_index in range(args.rounds):
            for name in variants:
                # as the daemon runs each: torch's threads off beside the native kernels
                torch.set_num_threads(1 if name in ("native", "fp32") else cores)
                if name == "hf":
                    model.set_attn_implementation("sdpa")
                    try:
                        figures[name].append(hf_prefill(model, long_prompt))
                        rate, hf_tokens = hf_decode(model, short_prompt, args.decode)
                    finally:
                        model.set_attn_implementation("kvgraft")
                else:
                    figures[name].append(engine_prefill(engines[name], long_prompt))
                    rate, tokens = engine_decode(engines[name], short_prompt, args.decode)
                    if hf_tokens and name != "native":  # int8-dot: other numbers (quality_bench)
                        assert tokens[:CHECKED_TOKENS] == hf_tokens[:CHECKED_TOKENS], name
                rates[name].append(rate)
                print(
                    f"round {round_index + 1} {name:7s} prefill {args.prefill} tokens "
                    f"{figures[name][-1]:6.2f} s   decode {rates[name][-1]:6.1f} tokens/s",
                    flush=True,
                )
            llamacpp = llamacpp_peer(long_prompt, short_prompt, args.decode)
            if llamacpp:
                for key in peer:
                    peer[key].append(llamacpp[key])
                print(
                    f"round {round_index + 1} llama.cpp prefill {llamacpp['prefill_s']:6.2f} s   "
                    f"decode {llamacpp['decode_tokens_per_s']:6.1f} tokens/s",
                    flush=True,
                )
        torch.set_num_threads(1)
        overheads: dict[int, list[float]] = {1: [], 8: []}
        step_ms: dict[int, list[float]] = {1: [], 8: []}
        for _ in range(args.rounds):
            for count in overheads:
                prompts = [long_prompt[i : i + args.decode_prompt] for i in range(0, 8 * count, 8)]
                step, outside = decode_overhead(engines["native"], prompts, args.decode)
                step_ms[count].append(step)
                overheads[count].append(outside)
                print(f"decode, {count} contexts: a step {step:.1f} ms, {outside:.2f} ms outside")
        store.close()
    prefill = {name: statistics.median(values) for name, values in figures.items()}
    decode = {name: statistics.median(values) for name, values in rates.items()}
    llamacpp = {key: statistics.median(values) for key, values in peer.items() if values}
    result = {
        "prefill_vs_hf": round(prefill["hf"] / prefill["native"], 2),
        "decode_vs_hf": round(decode["native"] / decode["hf"], 2),
        "prefill_vs_torch_path": round(prefill["torch"] / prefill["native"], 2),
        "decode_vs_torch_path": round(decode["native"] / decode["torch"], 2),
        "prefill_vs_fp32": round(prefill["fp32"] / prefill["native"], 2),
        "decode_vs_fp32": round(decode["native"] / decode["fp32"], 2),
        "decode_vs_llamacpp": (
            round(decode["native"] / llamacpp["decode_tokens_per_s"], 2) if llamacpp else None
        ),
        "prefill_vs_llamacpp": (
            round(llamacpp["prefill_s"] / prefill["native"], 2) if llamacpp else None
        ),
        "decode_overhead_ms_1": round(statistics.median(overheads[1]), 2),
        "decode_overhead_ms_8": round(statistics.median(overheads[8]), 2),
        "decode_step_ms": {c: round(statistics.median(v), 1) for c, v in step_ms.items()},
        "prefill_s": {name: round(value, 2) for name, value in prefill.items()},
        "decode_tokens_per_s": {name: round(value, 1) for name, value in decode.items()},
        "llamacpp": {key: round(value, 2) for key, value in llamacpp.items()} or None,
        "rss_bytes": psutil.Process().memory_info().rss,
        "prefill_tokens": args.prefill,
        "decode_tokens": args.decode,
        "rounds": args.rounds,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
