"""kvgraft.hf: a stored artifact as a transformers DynamicCache, byte for byte, and back."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from kvgraft import Client
from kvgraft.hf import from_kv, layer_tensors, to_dynamic_cache
from kvgraftd.engine.model.model_adapter import ModelAdapter
from kvgraftd.testing.daemon_process import wait_model_ready

PAGE = 8


def test_dynamic_cache_holds_the_stored_bytes_and_continues(start_daemon, tmp_path: Path) -> None:
    daemon = start_daemon(
        extra_args=["--model", "tiny:0", "--page-tokens", str(PAGE), "--block-tokens", "32"]
    )
    wait_model_ready(daemon.address)
    prompt = list(range(3, 3 + 3 * PAGE + 5))  # a partial tail page
    with Client(daemon.address) as client:
        deposited = client.deposit(token_ids=prompt)
        artifact = client.get_artifact(deposited.artifact_id)
        engine_next = client.graft(deposited.artifact_id, token_ids=[7], max_new_tokens=1)
    cache = to_dynamic_cache(artifact)
    layout = artifact.manifest.layout
    for layer, (keys, values) in enumerate(layer_tensors(artifact)):
        assert keys.shape == values.shape == (1, layout.kv_heads, len(prompt), layout.head_dim)
        assert torch.equal(cache.layers[layer].keys, keys)
        for page in range(-(-len(prompt) // PAGE)):
            span = slice(page * PAGE, min((page + 1) * PAGE, len(prompt)))
            both = torch.stack((keys[0, :, span], values[0, :, span])).contiguous()
            stored = bytes(artifact.page(page, layer))
            assert both.view(torch.uint8).numpy().tobytes() == stored
    # A transformers user continues from the cache with the same weights (tiny:0):
    # another attention implementation, so not the same bits, but the same argmax.
    model = ModelAdapter.load("tiny:0", tmp_path).model
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        out = model(torch.tensor([[7]]), position_ids=torch.tensor([[len(prompt)]]), cache=cache)
    assert int(out.logits[0, -1].argmax()) == engine_next.receipt.generated_token_ids[0]


def test_from_kv_cuts_pages_and_round_trips(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    kv = [
        (
            torch.randn(1, 2, 21, 16, generator=generator),
            torch.randn(1, 2, 21, 16, generator=generator),
        )
        for _ in range(3)
    ]
    from kvgraft.v1 import kvgraft_pb2 as pb

    artifact = from_kv(
        kv,
        list(range(21)),
        model_fingerprint=b"\1" * 32,
        profile=pb.ComputeProfile(page_tokens=PAGE),
    )
    assert len(artifact.manifest.page_sha256) == 3 * 3
    artifact.verify()
    for (keys, values), (k2, v2) in zip(kv, layer_tensors(artifact), strict=True):
        assert torch.equal(keys, k2) and torch.equal(values, v2)
    digest = artifact.manifest.page_sha256[0]
    assert hashlib.sha256(artifact.pages[digest]).digest() == digest
