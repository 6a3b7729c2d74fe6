"""A model's shape as the KV context, the receipts and the tiers need it (no torch, no
transformers: importing it loads nothing else)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelGeometry:
    """Layers, query heads, KV heads, values a head and the vocabulary's size; where the
    model has them, each layer's sliding window (keys of the last `windows[i]` positions; 0:
    every position) and the attention scores' softcap (0: none)."""

    num_layers: int
    num_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    windows: tuple[int, ...] = ()
    softcap: float = 0.0

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    @property
    def plain_attention(self) -> bool:
        """Whether every layer attends every position, its scores uncapped."""
        return not any(self.windows) and not self.softcap
