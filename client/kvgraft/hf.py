"""kvgraft.hf: artifacts as Hugging Face transformers caches, and back.

For users with their own transformers model: `to_dynamic_cache(artifact)`
gives a `DynamicCache` whose per-layer K and V tensors ([1, kv_heads, tokens,
head_dim], the artifact's dtype) hold exactly the stored page bytes;
`layer_tensors` gives the same tensors without transformers. `from_kv` goes
the other way: per-layer K and V tensors become an Artifact with pages cut at
`page_tokens`. Bytes are copied, never converted.

Needs torch (and transformers for the cache class): `pip install kvgraft[engine]`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvgraft.artifact import DTYPE_NAMES, DTYPES_BY_NAME, Artifact, page_token_count
from kvgraft.v1 import kvgraft_pb2 as pb


def _torch_dtype(kv_dtype: int) -> torch.dtype:
    return getattr(torch, DTYPE_NAMES[kv_dtype])


def layer_tensors(artifact: Artifact) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) per layer, each [1, kv_heads, tokens, head_dim], byte-identical to the pages."""
    manifest = artifact.manifest
    layout = manifest.layout
    dtype = _torch_dtype(layout.kv_dtype)
    layers: list[tuple[torch.Tensor, torch.Tensor]] = []
    pages = -(-len(manifest.token_ids) // manifest.profile.page_tokens)
    for layer in range(layout.num_layers):
        keys, values = [], []
        for page in range(pages):
            tokens = page_token_count(manifest, page)
            raw = bytearray(artifact.page(page, layer))  # writable, owned copy
            both = torch.frombuffer(raw, dtype=dtype).view(
                2, layout.kv_heads, tokens, layout.head_dim
            )
            keys.append(both[0])
            values.append(both[1])
        layers.append((torch.cat(keys, dim=1).unsqueeze(0), torch.cat(values, dim=1).unsqueeze(0)))
    return layers


def to_dynamic_cache(artifact: Artifact):
    """A transformers DynamicCache holding the artifact's KV."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer, (keys, values) in enumerate(layer_tensors(artifact)):
        cache.update(keys, values, layer)
    return cache


def from_kv(
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    token_ids: Sequence[int],
    *,
    model_fingerprint: bytes,
    profile: pb.ComputeProfile,
    segment_ends: Sequence[int] | None = None,
    labels: Mapping[str, str] | None = None,
) -> Artifact:
    """An artifact from per-layer (K, V) of shape [1, kv_heads, tokens, head_dim]."""
    first = kv[0][0]
    _, kv_heads, tokens, head_dim = first.shape
    name = str(first.dtype).removeprefix("torch.")
    if name not in DTYPES_BY_NAME:
        raise ValueError(f"KV dtype {first.dtype} is not one of {sorted(DTYPES_BY_NAME)}")
    if tokens != len(token_ids):
        raise ValueError(
            f"the KV holds {tokens} positions but {len(token_ids)} token ids were given"
        )
    layout = pb.KvLayout(
        num_layers=len(kv), kv_heads=kv_heads, head_dim=head_dim, kv_dtype=DTYPES_BY_NAME[name]
    )
    page_tokens = profile.page_tokens
    pages = []
    for begin in range(0, tokens, page_tokens):
        end = min(begin + page_tokens, tokens)
        for keys, values in kv:
            both = torch.stack((keys[0, :, begin:end], values[0, :, begin:end])).contiguous()
            pages.append(both.view(torch.uint8).numpy().tobytes())
    return Artifact.build(
        model_fingerprint=model_fingerprint,
        layout=layout,
        profile=profile,
        token_ids=token_ids,
        page_bytes=pages,
        segment_ends=segment_ends,
        labels=labels,
    )
