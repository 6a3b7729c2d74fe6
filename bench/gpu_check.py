"""GPU check: the tiers and exactness on a CUDA device (run by bench/gpu_check.sh, <= 5 min).

Three measurements, each against a baseline taken in the same run:

* page copy: stored pages of the default model's geometry (98,304 bytes)
  copied host-to-device through the host tier (pinned) into device-pool
  slots, against the pinned peak (one 256 MiB pinned copy): `h2d_vs_pinned_peak`.
* decode step: attention of one query over 1M stored tokens at a 64 MiB
  device budget (blocks streamed from LMDB through the host tier), against
  its bound (bytes per step / the pinned peak): `step_vs_bound`.
* exactness: on the tiny seeded model, a grafted Generate equals a fresh one
  and a streamed run (small pool) equals a resident one, byte for byte.

Last stdout line: one JSON object. Exits 2 without CUDA.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _sync_time(fn) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def pinned_peak() -> float:
    host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    device.copy_(host, non_blocking=True)
    return max(
        host.numel() / _sync_time(lambda: device.copy_(host, non_blocking=True)) for _ in range(5)
    )


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    import long_context as lc

    from kvgraftd.engine.model.model_adapter import ModelAdapter
    from kvgraftd.engine.requests.decoding import DecodeOptions, ResultEvent
    from kvgraftd.engine.requests.engine import Engine
    from kvgraftd.store.artifact_store import Store
    from kvgraftd.tiers.device_pool import DevicePool
    from kvgraftd.tiers.host_cache import HostCache
    from kvgraftd.tiers.stack import Tiers

    result: dict[str, object] = {"device": torch.cuda.get_device_name(0)}
    peak = pinned_peak()
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    store = Store(work / "store", initial_map_bytes=4 << 30)
    tokens = 1 << 20
    digests = lc.write_store(store, tokens // lc.PAGE)
    slot_shape = (2, lc.KV_HEADS, lc.PAGE, lc.HEAD_DIM)
    # page copy: host tier (pinned, warm) -> slots
    host = HostCache(store, 8 << 30)
    pool = DevicePool(256 << 20, slot_shape, device="cuda")
    tiers = Tiers(pool, host)
    step = lc.Step(tiers, digests, tokens)
    step.run()  # fills the host tier (admitted: it fits) and warms up
    copy_s = statistics.median(_sync_time(step.run) for _ in range(3))
    result["h2d_vs_pinned_peak"] = round(tokens * lc.BYTES_PER_TOKEN / copy_s / peak, 3)
    # decode step streamed from LMDB at 64 MiB
    streamed = lc.Step(
        Tiers(DevicePool(64 << 20, slot_shape, device="cuda"), HostCache(store, 0)), digests, tokens
    )
    streamed.run()
    step_s = statistics.median(_sync_time(streamed.run) for _ in range(3))
    result["step_s"] = round(step_s, 4)
    result["step_vs_bound"] = round(step_s / (tokens * lc.BYTES_PER_TOKEN / peak), 3)
    result["peak_device_max_allocated"] = torch.cuda.max_memory_allocated()
    # exactness on CUDA
    adapter = ModelAdapter.load("tiny:0", work / "models", device="cuda")
    rng = random.Random(0)
    prompt = [rng.randrange(512) for _ in range(300)]

    def engine(budget: int) -> Engine:
        g = adapter.geometry
        tiers = Tiers(
            DevicePool(budget, (2, g.kv_heads, 32, g.head_dim), device="cuda"), HostCache(store, 0)
        )
        return Engine(adapter, store, page_tokens=8, block_tokens=32, tiers=tiers)

    def run(e: Engine, options: DecodeOptions) -> ResultEvent:
        *_, last = e.generate(prompt, options)
        return last

    small, large = engine(2 * 2 * 2 * 32 * 16 * 4), engine(0)
    options = DecodeOptions(max_new_tokens=8, return_logits=True)
    fresh = run(large, DecodeOptions(max_new_tokens=8, return_logits=True, deposit=True))
    grafted = run(large, options)
    streamed_run = run(small, options)
    result["cuda_graft_equal"] = grafted.prompt_logits == fresh.prompt_logits and (
        grafted.generated_logits == fresh.generated_logits
    )
    result["cuda_streamed_equal"] = streamed_run.prompt_logits == grafted.prompt_logits
    result["pinned_peak_gbps"] = round(peak / 1e9, 2)
    store.close()
    print(json.dumps(result))
    return 0 if result["cuda_graft_equal"] and result["cuda_streamed_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
