"""Tenant bench: does bob's Lookup take longer for a prompt alice holds than for one nobody holds?

A shared prefix index answers "how much of this prompt does someone hold", and its
timing can answer it too (a prefix-cache hit is a timing side channel: vLLM
CVE-2025-46570). With tenants, bob's Lookup must cost the same whoever holds what.

What, on the real default model (SmolLM2-135M-Instruct, CPU), one daemon in its own
process with tenants alice and bob (a fresh store): alice deposits --documents texts
(~500 tokens each, chat-wrapped); for each, prompt A is its token ids (alice holds all
of it) and prompt B the same ids with the first one changed (nobody holds any of it:
same length, same work to hash). Then bob calls Lookup (token ids: no tokenizing) on A
and B, --samples pairs over the documents in turn, the order within each pair drawn at
random, after --warmup pairs not counted; each call timed around the client call
(time.perf_counter_ns). Reported: both medians, `lookup_timing_ratio` = median(A) /
median(B) (target 0.9-1.1), and the two-sample Kolmogorov-Smirnov statistic D between the
two sets of times with its p-value (target: not separated at p < 0.01).

A control shows the test can see a difference where there is one: alice's own Lookup of
A (her pages: the chain walked page by page) against B, timed the same way
(`control_ratio`, `control_ks_p_value`).

What bounds the figures: a Lookup is one gRPC round trip (~0.3-1 ms here) around a few
LMDB reads and SHA-256s of the prompt's first page: bob's walk looks up the first page's
chain key under his root and under the shared one, misses both, and stops, whether alice
holds the prompt or not (her pages hang under her own root, keys he never asks for). The
noise is the machine's (2 shared cores): the pairs alternate so that drift hits both.

Run: .venv/bin/python bench/tenant_bench.py [--samples 2000] [--documents 8] [--quick]
Last stdout line: one JSON object with lookup_timing_ratio, ks_statistic, ks_p_value,
separated_at_p01, the medians in microseconds, the control figures and the machine's load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from kvgraft import Client
from kvgraftd.testing.daemon_process import DaemonProcess, wait_model_ready
from kvgraftd.testing.tenants import write_tenants

ROOT = Path(__file__).resolve().parent.parent
MODEL_CACHE = ROOT / ".cache" / "models"
TOPICS = ["tides", "glaciers", "bridges", "ferns", "comets", "looms", "lanterns", "canals"]


def document(topic: str, index: int) -> str:
    """~500 tokens of text about `topic`, different for every document."""
    sentences = [
        f"Note {index}.{n} on {topic}: observation {n * 7 + index} was recorded at station "
        f"{(n * 13 + index) % 97} and compared with the previous season's figures."
        for n in range(18)
    ]
    return " ".join(sentences)


def ks_two_sample(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """The Kolmogorov-Smirnov statistic D of two samples and its asymptotic p-value
    (Kolmogorov's distribution at sqrt(n_e) * D, Stephens' small-sample correction)."""
    a, b = np.sort(a), np.sort(b)
    pooled = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, pooled, side="right") / len(a)
    cdf_b = np.searchsorted(b, pooled, side="right") / len(b)
    d = float(np.max(np.abs(cdf_a - cdf_b)))
    n_e = len(a) * len(b) / (len(a) + len(b))
    return d, kolmogorov_survival((math.sqrt(n_e) + 0.12 + 0.11 / math.sqrt(n_e)) * d)


def kolmogorov_survival(lam: float) -> float:
    """P(K > lam) for Kolmogorov's K. The alternating series 2 sum (-1)^(k-1) exp(-2 k^2 lam^2)
    converges slowly for small lam (100 terms give 0.40 at lam = 0.005, where the answer is
    1), so below 1.18 the equivalent theta form 1 - sqrt(2 pi) / lam sum exp(-(2k-1)^2 pi^2 /
    (8 lam^2)) is summed instead; each needs a handful of terms on its side."""
    if lam <= 0.0:
        return 1.0
    if lam < 1.18:
        tail = sum(
            math.exp(-((2 * k - 1) ** 2) * math.pi**2 / (8 * lam * lam)) for k in range(1, 20)
        )
        return min(1.0, max(0.0, 1.0 - math.sqrt(2 * math.pi) / lam * tail))
    series = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 20))
    return min(1.0, max(0.0, series))


def timed_pairs(
    client: Client, prompts: list[tuple[list[int], list[int]]], pairs: int, warmup: int, seed: int
) -> tuple[np.ndarray, np.ndarray, dict[str, set[int]]]:
    """Lookup of A and of B, pair after pair over the prompts, each pair in a random order;
    (times of A in ns, times of B, {"A": the matched_tokens answered for A, "B": for B})."""
    rng = random.Random(seed)
    times: dict[str, list[int]] = {"A": [], "B": []}
    matched: dict[str, set[int]] = {"A": set(), "B": set()}
    for n in range(warmup + pairs):
        held, nobodys = prompts[n % len(prompts)]
        order = [("A", held), ("B", nobodys)]
        rng.shuffle(order)
        for which, ids in order:
            start = time.perf_counter_ns()
            answer = client.lookup(ids)
            elapsed = time.perf_counter_ns() - start
            matched[which].add(answer.matched_tokens)
            if n >= warmup:
                times[which].append(elapsed)
    return np.array(times["A"]), np.array(times["B"]), matched


def summary(a: np.ndarray, b: np.ndarray) -> dict:
    d, p = ks_two_sample(a, b)
    return {
        "median_a_us": round(float(np.median(a)) / 1000, 1),
        "median_b_us": round(float(np.median(b)) / 1000, 1),
        "ratio": round(float(np.median(a) / np.median(b)), 4),
        "ks_statistic": round(d, 4),
        "ks_p_value": p,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--samples", type=int, default=2000, help="timed pairs (one A, one B) of bob's Lookups"
    )
    parser.add_argument("--warmup", type=int, default=100, help="pairs run first, not counted")
    parser.add_argument("--documents", type=int, default=8, help="documents alice deposits")
    parser.add_argument("--quick", action="store_true", help="300 pairs, 3 documents")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.samples, args.warmup, args.documents = 300, 20, 3
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="tenant-bench-") as scratch:
        config, tokens = write_tenants(Path(scratch), {"alice": {}, "bob": {}})
        daemon = DaemonProcess.start(
            Path(scratch) / "data",
            ["--config", str(config), "--model", "", "--model-cache", str(MODEL_CACHE)],
        )
        try:
            alice = Client(daemon.address, token_file=tokens["alice"])
            bob = Client(daemon.address, token_file=tokens["bob"])
            wait_model_ready(daemon.address, token_file=tokens["alice"])
            vocab_top = 49151  # SmolLM2's last id: a changed first token stays in the vocabulary
            prompts = []
            for index in range(args.documents):
                text = document(TOPICS[index % len(TOPICS)], index)
                stored = alice.deposit(text, chat=True)
                held = list(
                    alice.stat(stored.artifact_id, include_manifest=True).manifest.token_ids
                )
                nobodys = [held[0] + 1 if held[0] < vocab_top else held[0] - 1, *held[1:]]
                prompts.append((held, nobodys))
            print(
                f"alice deposited {len(prompts)} prompts of {len(prompts[0][0])} tokens", flush=True
            )
            bob_a, bob_b, bob_matched = timed_pairs(
                bob, prompts, args.samples, args.warmup, args.seed
            )
            own_a, own_b, own_matched = timed_pairs(
                alice, prompts, args.samples // 2, args.warmup, args.seed + 1
            )
            alice.close()
            bob.close()
        finally:
            daemon.stop()
    assert bob_matched == {"A": {0}, "B": {0}}, f"bob was told alice holds something: {bob_matched}"
    assert min(own_matched["A"]) > 0, f"alice's Lookup missed her own prompts: {own_matched}"
    assert own_matched["B"] == {0}, f"a prompt nobody holds matched: {own_matched}"
    tenant, control = summary(bob_a, bob_b), summary(own_a, own_b)
    print(
        f"bob's Lookup: held by alice {tenant['median_a_us']} us, held by nobody "
        f"{tenant['median_b_us']} us (median), ratio {tenant['ratio']}, KS D "
        f"{tenant['ks_statistic']} p {tenant['ks_p_value']:.3g}"
    )
    print(
        f"control, alice's own Lookup: hers {control['median_a_us']} us, nobody's "
        f"{control['median_b_us']} us, ratio {control['ratio']}, KS p {control['ks_p_value']:.3g}"
    )
    result = {
        "bench": "tenant_bench",
        "lookup_timing_ratio": tenant["ratio"],
        "ks_statistic": tenant["ks_statistic"],
        "ks_p_value": tenant["ks_p_value"],
        "separated_at_p01": tenant["ks_p_value"] < 0.01,
        "medians_us": {
            "held_by_alice": tenant["median_a_us"],
            "held_by_nobody": tenant["median_b_us"],
        },
        "samples": args.samples,
        "control_samples": args.samples // 2,
        "prompt_tokens": len(prompts[0][0]),
        "control_ratio": control["ratio"],
        "control_ks_statistic": control["ks_statistic"],
        "control_ks_p_value": control["ks_p_value"],
        "control_matched_tokens": min(own_matched["A"]),
        "stdev_us": {
            "held_by_alice": round(statistics.pstdev(bob_a.tolist()) / 1000, 1),
            "held_by_nobody": round(statistics.pstdev(bob_b.tolist()) / 1000, 1),
        },
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
