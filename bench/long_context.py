"""Long-context bench: decode-step attention over millions of stored tokens, fixed device memory.

What: synthetic KV of one layer of the default model as the engine keeps it on
CPU (3 KV heads x head dim 64, float32: 1,536 bytes per token for K and V) is
written into a real store as artifacts of 4,096-token pages (6 MiB each, one
attention block per page). A context of N stored tokens is then attended by
one new query token exactly as the engine does it (kvgraftd.engine.attention.kv_context:
stored blocks stream from the store through the host tier into a device pool
of `--device-budget` bytes, the next block is fetched on a background thread
while the current one is attended, an online softmax merges blocks in a fixed
order; on CPU a scan of one-page blocks larger than the pool is attended
where each page lies in the store's map, right after its check), for N = 32K,
256K, 1M, 4M and 10M tokens.

Reported per length: decode-step time (median of --trials after a warm-up),
bytes streamed per step, effective bandwidth, peak device-pool bytes and the
process's anonymous resident memory (RssAnon, which excludes the LMDB map's
page cache; taken after glibc's malloc_trim, so memory the previous length's
float64 reference freed is not counted). Baselines measured in the same run:

* host read bandwidth: the fastest of numpy and torch (2 threads) summing a
  1 GiB float32 buffer, 5 times each, before the steps and again after them;
  `step_vs_bandwidth_bound` = step time / (bytes per
  step / that bandwidth) at the largest length: 1.0 would be a step that only
  reads its KV once at the speed this machine reads memory.
* resident: at the largest length whose KV fits the --resident-max memory,
  the same step with every block already in an unbounded pool (nothing
  streamed): `streamed_vs_resident` = streamed step / resident step, and
  `resident_equal` says whether both outputs are the same bytes.
* a float64 reference (exact softmax attention over the same bytes, computed
  page by page) at the lengths up to --reference-max: the max |error| of the
  streamed float32 result is printed and must be small.

A PNG plot (step time and peak device bytes against context length) is
written to bench/out/long_context.png (--plot). The store needs about 1.6 GB of disk
per million tokens (--dir). Last stdout line: one JSON object with
max_context_tokens, device_budget_bytes, peak_device_ratio_10m_vs_32k,
streamed_vs_resident, step_vs_bandwidth_bound, resident_equal.

Run: .venv/bin/python bench/long_context.py [--lengths 32768,262144,1048576,4194304,10485760]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import hashlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvgraft.artifact import FORMAT_VERSION
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.engine.attention.kv_context import KvContext
from kvgraftd.engine.model.geometry import ModelGeometry
from kvgraftd.server.status import rss_anon_bytes
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.page_records import page_records_of
from kvgraftd.tiers.device_pool import DevicePool
from kvgraftd.tiers.host_cache import HostCache
from kvgraftd.tiers.stack import Tiers

ROOT = Path(__file__).resolve().parent.parent

KV_HEADS, HEAD_DIM, HEADS = 3, 64, 9
PAGE = 4096
BYTES_PER_TOKEN = 2 * KV_HEADS * HEAD_DIM * 4
PAGE_BYTES = PAGE * BYTES_PER_TOKEN
PAGES_PER_ARTIFACT = 64


def page_data(index: int) -> np.ndarray:
    """Page `index` of the synthetic context: K then V, values in [-2, 2)."""
    rng = np.random.Generator(np.random.PCG64(index))
    data = rng.random(PAGE_BYTES // 4, dtype=np.float32)
    data *= 4.0
    data -= 2.0
    return data


def write_store(store: Store, pages: int) -> list[bytes]:
    """Commit `pages` synthetic pages as artifacts; returns their hashes in order."""
    digests: list[bytes] = []
    layout = pb.KvLayout(
        num_layers=1, kv_heads=KV_HEADS, head_dim=HEAD_DIM, kv_dtype=pb.KV_DTYPE_FLOAT32
    )
    profile = pb.ComputeProfile(page_tokens=PAGE, attention="long-context bench")
    started = time.perf_counter()
    for first in range(0, pages, PAGES_PER_ARTIFACT):
        batch = [page_data(i) for i in range(first, min(first + PAGES_PER_ARTIFACT, pages))]
        hashes = [hashlib.sha256(b).digest() for b in batch]
        tokens = len(batch) * PAGE
        manifest = pb.Manifest(
            format_version=FORMAT_VERSION,
            model_fingerprint=b"\0" * 32,
            layout=layout,
            profile=profile,
            # each artifact starts with its own token, so no two share a prefix chain
            token_ids=[(first + i) % 49152 for i in range(tokens)],
            segment_ends=[tokens],
            page_sha256=hashes,
            labels={"bench": "long_context", "first_page": str(first)},
        )
        store.commit_artifact(manifest, page_records_of(dict(zip(hashes, batch, strict=True))))
        digests += hashes
        done = len(digests) * PAGE_BYTES
        print(
            f"\rwrote {done / 1e9:6.2f} GB "
            f"({done / 1e9 / (time.perf_counter() - started):.2f} GB/s)",
            end="",
            file=sys.stderr,
            flush=True,
        )
    print(file=sys.stderr)
    return digests


def read_bandwidth() -> float:
    """Bytes/s at which this machine reads memory (best of numpy and torch sums of 1 GiB)."""
    data = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    array = data.numpy()
    best = 0.0
    for fn in (lambda: array.sum(), lambda: data.sum()):
        fn()
        for _ in range(5):
            started = time.perf_counter()
            fn()
            best = max(best, data.numel() * 4 / (time.perf_counter() - started))
    return best


def live_rss_anon_bytes() -> int:
    """RssAnon once the allocator has handed freed memory back to the OS.

    Without the trim, the row after a float64 reference counted the
    reference's freed gigabytes (1.5-2.5 GB at 4M tokens; 297 MiB without
    a reference before it).
    """
    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    return rss_anon_bytes()


class Step:
    """One decode step over the first `tokens` stored tokens, as the engine runs it."""

    def __init__(self, tiers: Tiers, digests: list[bytes], tokens: int) -> None:
        geometry = ModelGeometry(
            num_layers=1, num_heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=1
        )
        self.context = KvContext(geometry, PAGE, PAGE, tiers)
        self.context.attach(range(tokens), digests[: tokens // PAGE])
        generator = torch.Generator().manual_seed(tokens)
        self.q = torch.randn(HEADS, 1, HEAD_DIM, generator=generator)
        self.k = torch.randn(KV_HEADS, 1, HEAD_DIM, generator=generator)
        self.v = torch.randn(KV_HEADS, 1, HEAD_DIM, generator=generator)
        self.tokens = tokens

    def run(self) -> torch.Tensor:
        context = self.context
        context.begin_chunk(self.tokens, [0])
        with torch.inference_mode():
            out = context.attend(0, self.q, self.k, self.v, HEAD_DIM**-0.5)
        return out  # no end_chunk: every trial attends the same context


def timed(step: Step, trials: int) -> tuple[float, torch.Tensor]:
    out = step.run()  # warm-up
    times = []
    for _ in range(trials):
        started = time.perf_counter()
        out = step.run()
        times.append(time.perf_counter() - started)
    return statistics.median(times), out


def reference(step: Step, digests: list[bytes]) -> torch.Tensor:
    """Exact attention in float64 over the same bytes (page by page, two passes)."""
    q = step.q.double().reshape(KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)  # [kv, group, D]
    scale = HEAD_DIM**-0.5
    k_new, v_new = step.k.double(), step.v.double()  # [kv, 1, D]
    scores, values = [], []
    for index in range(step.tokens // PAGE):
        page = torch.from_numpy(page_data(index)).double().view(2, KV_HEADS, PAGE, HEAD_DIM)
        scores.append(torch.einsum("kgd,ktd->kgt", q, page[0]) * scale)
        values.append(page[1])
    scores.append(torch.einsum("kgd,ktd->kgt", q, k_new) * scale)
    values.append(v_new)
    maximum = torch.stack([s.amax(dim=-1, keepdim=True) for s in scores]).amax(dim=0)
    total = sum(torch.exp(s - maximum).sum(dim=-1, keepdim=True) for s in scores)
    out = sum(
        torch.einsum("kgt,ktd->kgd", torch.exp(s - maximum), v)
        for s, v in zip(scores, values, strict=True)
    )
    return (out / total).reshape(HEADS, 1, HEAD_DIM).transpose(0, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="32768,262144,1048576,4194304,10485760")
    parser.add_argument("--device-budget", type=int, default=64 << 20)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--resident-max", type=int, default=4194304, help="tokens")
    parser.add_argument("--reference-max", type=int, default=1048576, help="tokens")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument(
        "--plot",
        default=str(ROOT / "bench" / "out" / "long_context.png"),
        help="where the PNG goes (an empty string: none)",
    )
    args = parser.parse_args()
    lengths = sorted(int(x) for x in args.lengths.split(","))
    assert all(n % PAGE == 0 for n in lengths), f"lengths must be multiples of {PAGE}"
    work = Path(tempfile.mkdtemp(prefix="long-context-", dir=args.dir))
    store = Store(work / "store", initial_map_bytes=max(lengths) * BYTES_PER_TOKEN * 5 // 4)
    rows, result = [], {}
    try:
        digests = write_store(store, max(lengths) // PAGE)
        bandwidth = read_bandwidth()
        slot_shape = (2, KV_HEADS, PAGE, HEAD_DIM)
        for tokens in lengths:
            pool = DevicePool(args.device_budget, slot_shape)
            tiers = Tiers(pool, HostCache(store, 0))
            step = Step(tiers, digests, tokens)
            seconds, out = timed(step, args.trials)
            row = {
                "tokens": tokens,
                "step_s": seconds,
                "bytes": tokens * BYTES_PER_TOKEN,
                "gbps": tokens * BYTES_PER_TOKEN / seconds / 1e9,
                "peak_device": pool.counters.peak_bytes,
                "rss_anon": live_rss_anon_bytes(),
                "error": None,
            }
            if tokens <= args.reference_max:
                row["error"] = (out.double() - reference(step, digests)).abs().max().item()
                assert row["error"] < 1e-4, row
            rows.append(row)
            print(
                f"{tokens:>10} tokens  step {seconds:7.3f} s  {row['gbps']:6.2f} GB/s  "
                f"peak device {row['peak_device'] / 2**20:6.1f} MiB  "
                f"RssAnon {row['rss_anon'] / 2**20:7.1f} MiB"
                + (f"  |err| {row['error']:.2e}" if row["error"] is not None else ""),
                flush=True,
            )
        # Measured again once the store's writeback is long over: right after
        # writing ~16 GB the kernel's flushing shares the memory bus (12.7 vs
        # 22 GB/s seen). The faster of the two is the bound.
        bandwidth = max(bandwidth, read_bandwidth())
        resident_tokens = max(n for n in lengths if n <= args.resident_max)
        streamed_tiers = Tiers(DevicePool(args.device_budget, slot_shape), HostCache(store, 0))
        resident_tiers = Tiers(DevicePool(0, slot_shape), HostCache(store, 0))
        streamed_s, streamed_out = timed(
            Step(streamed_tiers, digests, resident_tokens), args.trials
        )
        resident_s, resident_out = timed(
            Step(resident_tiers, digests, resident_tokens), args.trials
        )
        largest = rows[-1]
        result = {
            "max_context_tokens": largest["tokens"],
            "device_budget_bytes": args.device_budget,
            "peak_device_ratio_10m_vs_32k": round(
                largest["peak_device"] / rows[0]["peak_device"], 4
            ),
            "streamed_vs_resident": round(streamed_s / resident_s, 3),
            "step_vs_bandwidth_bound": round(largest["step_s"] / (largest["bytes"] / bandwidth), 3),
            "resident_equal": bool(torch.equal(streamed_out, resident_out)),
            "resident_comparison_tokens": resident_tokens,
            "read_bandwidth_gbps": round(bandwidth / 1e9, 2),
            "step_s": {str(r["tokens"]): round(r["step_s"], 4) for r in rows},
            "peak_device_bytes": {str(r["tokens"]): r["peak_device"] for r in rows},
            "rss_anon_bytes": {str(r["tokens"]): r["rss_anon"] for r in rows},
        }
        print(
            f"host read bandwidth {bandwidth / 1e9:.2f} GB/s; at {resident_tokens} tokens: "
            f"streamed {streamed_s:.3f} s vs resident {resident_s:.3f} s "
            f"(outputs equal: {result['resident_equal']})"
        )
        if args.plot:
            plot(rows, args.device_budget, Path(args.plot))
    finally:
        store.close()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    return 0


def plot(rows: list[dict], budget: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    tokens = [r["tokens"] for r in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.loglog(tokens, [r["step_s"] for r in rows], "o-")
    left.set(xlabel="context tokens", ylabel="decode step (s)", title="attention step time")
    left.grid(True, which="both", alpha=0.3)
    right.semilogx(tokens, [r["peak_device"] / 2**20 for r in rows], "o-", label="device pool peak")
    right.semilogx(tokens, [r["rss_anon"] / 2**20 for r in rows], "s--", label="process RssAnon")
    right.axhline(budget / 2**20, color="gray", linestyle=":", label="device budget")
    right.set(xlabel="context tokens", ylabel="MiB", title="memory")
    right.legend()
    right.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
