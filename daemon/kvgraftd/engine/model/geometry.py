"""A model's shape as the KV context, the receipts and the tiers need it (no torch, no
transformers: importing it loads nothing else)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelGeometry:
    """Layers, query heads, KV heads, values a head and the vocabulary's size."""

    num_layers: int
    num_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
