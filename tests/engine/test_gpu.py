"""CUDA only (marked `gpu`, skipped without a device): the exactness contract on a GPU.

A grafted run equals a fresh one, and a run streamed through a two-block
device pool equals a resident one, byte for byte, with KV in device slots
and pinned host buffers. `bench/gpu_check.sh` measures the speeds.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvgraftd.engine.model.model_adapter import ModelAdapter
from kvgraftd.engine.requests.decoding import DecodeOptions, ResultEvent
from kvgraftd.engine.requests.engine import Engine
from kvgraftd.store.artifact_store import Store
from kvgraftd.tiers.device_pool import DevicePool
from kvgraftd.tiers.host_cache import HostCache
from kvgraftd.tiers.stack import Tiers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_graft_and_streaming_are_exact_on_cuda(tmp_path: Path) -> None:
    adapter = ModelAdapter.load("tiny:0", tmp_path / "models", device="cuda")
    store = Store(tmp_path / "store")
    g = adapter.geometry
    slot = (2, g.kv_heads, 32, g.head_dim)

    def engine(budget: int) -> Engine:
        tiers = Tiers(DevicePool(budget, slot, device="cuda"), HostCache(store, 1 << 20))
        return Engine(adapter, store, page_tokens=8, block_tokens=32, tiers=tiers)

    def run(e: Engine, prompt: list[int], **options) -> ResultEvent:
        *_, last = e.generate(
            prompt, DecodeOptions(max_new_tokens=6, return_logits=True, **options)
        )
        return last

    try:
        rng = random.Random(0)
        prompt = [rng.randrange(512) for _ in range(200)]
        resident, streamed = engine(0), engine(2 * 2 * g.kv_heads * 32 * g.head_dim * 4)
        fresh = run(resident, prompt, deposit=True)
        assert fresh.receipt.profile.device_kind == "cuda"
        for result in (run(resident, [*prompt, 3]), run(streamed, [*prompt, 3])):
            assert result.receipt.reused_tokens > 0
        assert run(resident, prompt).prompt_logits == fresh.prompt_logits
        assert run(streamed, prompt).generated_logits == fresh.generated_logits
        assert streamed.tiers.pool.counters.peak_bytes <= streamed.tiers.pool.budget_bytes
    finally:
        store.close()
