"""Serve bench: many clients of one daemon, batched in shared forward passes, receipts intact.

What, on the real default model (SmolLM2-135M-Instruct, CPU), each daemon in its own
process: 1, 2, 4, 8 and 16 concurrent clients, each one Generate of a 200-token prompt
(its own tokens) and 64 new tokens, greedy, without the cache. For each count:
aggregate tokens/s (all generated tokens over the wall time from the first request to
the last token), p50 / p99 time to first token and inter-token latency.

Baselines, measured in the same run: the same daemon with batching off
(`--max-batch-rows 1`: one context per forward pass, the oldest waiting pass first), and
plain transformers `generate` with the same eight
prompts batched (its KV cache, SDPA; the prompts are the same length, so no padding).

Every receipt and token list is checked against the same request run alone on the
batching daemon (a fast wrong answer is not a result).

The batching daemon's resident memory (VmRSS of its process) is reported twice: idle, once
its model is ready, and after one Generate of a 4,032-token prompt and 64 new tokens
(4,096 positions) at the end.

What bounds the aggregate: a step reads every weight once for all its rows (about
110 MB of GGUF blocks), so rows come nearly free until the products' FLOPs (about 0.27
GFLOP a row) and attention over each context's own KV take over; the interpreter's
work per step and per context is the rest.

Run: .venv/bin/python bench/serve_bench.py [--clients 1,2,4,8,16] [--plot bench/serve_bench.png]
Last stdout line: one JSON object with aggregate_vs_single_8, aggregate_vs_serial_8,
aggregate_vs_hf_batched_8, p99_itl_ms_8, receipts_equal, rss_idle_bytes,
rss_after_4096_bytes and the raw figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from kvgraft import Client
from kvgraftd.testing.daemon_process import DaemonProcess, wait_model_ready

ROOT = Path(__file__).resolve().parent.parent
MODEL_CACHE = ROOT / ".cache" / "models"
PROMPT_TOKENS = 200
NEW_TOKENS = 64
LONG_POSITIONS = 4096  # the generate after which the daemon's memory is taken
VOCAB = range(100, 40000)


def one_client(address: str, prompt: list[int], start: threading.Barrier) -> dict:
    """One Generate, timed from the barrier: first-token and inter-token times, receipt."""
    with Client(address, timeout_s=600, transfer_timeout_s=1200) as client:
        start.wait()
        began = time.perf_counter()
        stream = client.generate_stream(token_ids=prompt, max_new_tokens=NEW_TOKENS, no_cache=True)
        arrivals = []
        for _ in stream:
            arrivals.append(time.perf_counter())
        result = stream.result()
    receipt = result.receipt
    return {
        "began": began,
        "arrivals": arrivals,
        "tokens": list(receipt.generated_token_ids),
        "hashes": (receipt.prompt_logits_sha256, receipt.generated_logits_sha256),
    }


def run_clients(address: str, prompts: list[list[int]]) -> list[dict]:
    start = threading.Barrier(len(prompts))
    results: list[dict | None] = [None] * len(prompts)

    def run(index: int) -> None:
        results[index] = one_client(address, prompts[index], start)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results  # type: ignore[return-value]


def figures(results: list[dict]) -> dict:
    began = min(r["began"] for r in results)
    ended = max(r["arrivals"][-1] for r in results)
    tokens = sum(len(r["arrivals"]) for r in results)
    ttft = sorted(r["arrivals"][0] - r["began"] for r in results)
    gaps = sorted(b - a for r in results for a, b in itertools.pairwise(r["arrivals"]))
    return {
        "tokens_per_s": tokens / (ended - began),
        "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
        "itl_p50_ms": 1e3 * statistics.median(gaps),
        "itl_p99_ms": 1e3 * percentile(gaps, 0.99),
    }


def percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def hf_batched(prompts: list[list[int]]) -> float:
    """transformers generate, the prompts batched: generated tokens per second."""
    import torch

    from kvgraftd.engine.model.model_adapter import ModelAdapter

    torch.set_num_threads(len(__import__("os").sched_getaffinity(0)))
    model = ModelAdapter.load(None, MODEL_CACHE).model
    model.set_attn_implementation("sdpa")
    ids = torch.tensor(prompts)

    def generate(new: int) -> float:
        began = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )
        return time.perf_counter() - began

    generate(2)  # warm-up
    return len(prompts) * NEW_TOKENS / generate(NEW_TOKENS)


def daemon(work: Path, name: str, extra: list[str]) -> DaemonProcess:
    args = ["--model", "", "--model-cache", str(MODEL_CACHE), *extra]
    process = DaemonProcess.start(work / name, args)
    wait_model_ready(process.address, 600)
    return process


def plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, by_count in rows.items():
        counts = sorted(by_count)
        left.plot(counts, [by_count[c]["tokens_per_s"] for c in counts], "o-", label=name)
        right.plot(counts, [by_count[c]["itl_p99_ms"] for c in counts], "o-", label=name)
    left.set(xlabel="concurrent clients", ylabel="tokens/s, all clients", xscale="log", xticks=[])
    right.set(xlabel="concurrent clients", ylabel="p99 inter-token latency, ms", xscale="log")
    for axis in (left, right):
        counts = sorted(next(iter(rows.values())))
        axis.set_xticks(counts, [str(c) for c in counts])
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle("kvgraftd, default model, 2 cores: 200-token prompts, 64 new tokens each")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,2,4,8,16", help="client counts")
    parser.add_argument("--plot", type=Path, default=ROOT / "bench" / "serve_bench.png")
    parser.add_argument(
        "--daemon-args",
        default="",
        help="more flags for both daemons, e.g. '--max-batch-tokens 256'",
    )
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",")]
    rng = random.Random(0)
    prompts = [[rng.choice(VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(max(counts))]
    work = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    rows: dict[str, dict[int, dict]] = {"batched": {}, "serial (max_batch_rows 1)": {}}
    receipts_equal = True
    extra = args.daemon_args.split()
    batched = daemon(work, "batched", extra)
    try:
        resident = psutil.Process(batched.proc.pid)
        rss = {"idle": resident.memory_info().rss}
        alone = [run_clients(batched.address, [p])[0] for p in prompts]  # also warms up
        for count in counts:
            results = run_clients(batched.address, prompts[:count])
            for result, lone in zip(results, alone, strict=False):
                same = (result["tokens"], result["hashes"]) == (lone["tokens"], lone["hashes"])
                receipts_equal &= same
            rows["batched"][count] = figures(results)
            print(f"batched {count:>3} clients: {rows['batched'][count]}", flush=True)
        long_prompt = [rng.choice(VOCAB) for _ in range(LONG_POSITIONS - NEW_TOKENS)]
        run_clients(batched.address, [long_prompt])
        rss["after_4096"] = resident.memory_info().rss
        print(f"daemon resident: {rss['idle'] >> 20} MiB idle, {rss['after_4096'] >> 20} MiB "
              f"after a {LONG_POSITIONS}-position generate", flush=True)  # fmt: skip
    finally:
        batched.stop()
    serial = daemon(work, "serial", [*extra, "--max-batch-rows", "1"])
    try:
        run_clients(serial.address, prompts[:1])  # warm-up
        for count in counts:
            results = run_clients(serial.address, prompts[:count])
            rows["serial (max_batch_rows 1)"][count] = figures(results)
            print(f"serial  {count:>3} clients: {rows['serial (max_batch_rows 1)'][count]}")
    finally:
        serial.stop()
    eight = 8 if 8 in counts else max(counts)
    hf = hf_batched(prompts[:eight])
    print(f"transformers generate, {eight} prompts batched: {hf:.1f} tokens/s")
    plot(rows, args.plot)
    b, s = rows["batched"], rows["serial (max_batch_rows 1)"]
    result = {
        f"aggregate_vs_single_{eight}": round(b[eight]["tokens_per_s"] / b[1]["tokens_per_s"], 2)
        if 1 in b
        else None,
        f"aggregate_vs_serial_{eight}": round(
            b[eight]["tokens_per_s"] / s[eight]["tokens_per_s"], 2
        ),
        f"aggregate_vs_hf_batched_{eight}": round(b[eight]["tokens_per_s"] / hf, 2),
        f"p99_itl_ms_{eight}": round(b[eight]["itl_p99_ms"], 1),
        "receipts_equal": receipts_equal,
        "rss_idle_bytes": rss["idle"],
        "rss_after_4096_bytes": rss["after_4096"],
        "hf_batched_tokens_per_s": round(hf, 1),
        "batched": {c: {k: round(v, 1) for k, v in f.items()} for c, f in b.items()},
        "serial": {c: {k: round(v, 1) for k, v in f.items()} for c, f in s.items()},
        "plot": str(args.plot),
    }
    print(json.dumps(result))
    return 0 if receipts_equal else 1


if __name__ == "__main__":
    sys.exit(main())
