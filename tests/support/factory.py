"""Random artifacts of chosen or random geometry, for tests and benchmarks."""

from __future__ import annotations

import random

from kvgraft.artifact import DTYPE_BYTES, Artifact
from kvgraft.v1 import kvgraft_pb2 as pb

FINGERPRINT = bytes(range(32))
DTYPES = (pb.KV_DTYPE_FLOAT32, pb.KV_DTYPE_FLOAT16, pb.KV_DTYPE_BFLOAT16)


def random_artifact(
    rng: random.Random,
    *,
    num_layers: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    kv_dtype: int | None = None,
    tokens: int | None = None,
    page_tokens: int | None = None,
    fingerprint: bytes = FINGERPRINT,
    labels: dict[str, str] | None = None,
    shared_pages: dict[tuple[int, int], bytes] | None = None,
) -> Artifact:
    """An artifact with random bytes; `shared_pages[(page, layer)]` overrides pages."""
    layout = pb.KvLayout(
        num_layers=num_layers or rng.randint(1, 4),
        kv_heads=kv_heads or rng.randint(1, 4),
        head_dim=head_dim or rng.choice((8, 16, 32, 64)),
        kv_dtype=kv_dtype or rng.choice(DTYPES),
    )
    page_tokens = page_tokens or rng.choice((4, 16, 64))
    tokens = tokens or rng.randint(1, 5 * page_tokens)
    profile = pb.ComputeProfile(torch_version="test", device_kind="cpu", page_tokens=page_tokens)
    element_bytes = 2 * layout.kv_heads * layout.head_dim * DTYPE_BYTES[layout.kv_dtype]
    pages = []
    for page in range(-(-tokens // page_tokens)):
        n = min(page_tokens, tokens - page * page_tokens)
        for layer in range(layout.num_layers):
            override = (shared_pages or {}).get((page, layer))
            pages.append(override if override is not None else rng.randbytes(element_bytes * n))
    token_ids = [rng.randrange(50_000) for _ in range(tokens)]
    cut = rng.randint(1, tokens)
    segments = sorted({cut, tokens})
    return Artifact.build(
        model_fingerprint=fingerprint,
        layout=layout,
        profile=profile,
        token_ids=token_ids,
        page_bytes=pages,
        segment_ends=segments,
        labels=labels,
    )


class Clock:
    """Unix ms that the test moves (a store's clock)."""

    def __init__(self) -> None:
        self.now = 1_700_000_000_000

    def __call__(self) -> int:
        return self.now
