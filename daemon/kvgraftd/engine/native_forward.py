"""The CPU forward pass with row-invariant matrix products (kvgraftd.engine.linear).

A Llama-family decoder (attention q/k/v/o projections, a gated MLP, RMS norms,
rotary positions, no biases) computed layer by layer: the model's own
embedding, norms, rotary embedding and activation (elementwise, or one
reduction per row), kvgraftd.engine.linear for every product (q, k and v as one
product, the gate and up projections as one, the logits), and the context
(kvgraftd.engine.kv_context) for attention and the KV it keeps.

Contract: a row's bits depend on its token, its position and the KV it attends,
never on how many rows share the pass. It runs torch's own ops on one thread
(set at every pass): see `forward_many`. Each product sums every output in one
fixed order; the elementwise and per-row operations are checked to be the same
for any number of rows by the real-model tests (tests/engine/test_native_forward.py).
`forward` returns the float32 logits of the last row, or of every row;
`forward_many` runs the rows of several contexts, each at its own positions and
attending its own KV, in one pass (the engine's batch).

Weights are packed once when the model loads, next to the model's own (which
the CUDA path and the fingerprint still read): from the GGUF file's quantized
blocks where the model came from one and they are proven bit-equal to its
weights (kvgraftd.engine.gguf_weights), else as float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvgraftd.engine import decode_attention, linear
from kvgraftd.engine.gguf_weights import GgufWeights
from kvgraftd.engine.linear import PackedWeight

SUPPORTED_TYPES = frozenset({"llama"})


def supports(model) -> bool:
    """Whether `model` is a decoder this forward computes exactly as its own modules do,
    with every row's attention in the native kernel (else a pass's rows would attend
    through torch's products, whose bits depend on the number of rows)."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return (
        linear.available()
        and decode_attention.takes_geometry(heads, kv_heads, head_dim)
        and config.model_type in SUPPORTED_TYPES
        and not getattr(config, "attention_bias", False)
        and not getattr(config, "mlp_bias", False)
    )


class _Layer:
    def __init__(self, index: int, layer, weights: _Weights) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        prefix = f"model.layers.{index}."
        self.qkv = weights.pack(
            prefix, [attention.q_proj, attention.k_proj, attention.v_proj],
            ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        )  # fmt: skip
        self.splits = [
            attention.q_proj.out_features,
            attention.k_proj.out_features,
            attention.v_proj.out_features,
        ]
        self.out = weights.pack(prefix, [attention.o_proj], ["self_attn.o_proj"])
        self.gate_up = weights.pack(
            prefix, [mlp.gate_proj, mlp.up_proj], ["mlp.gate_proj", "mlp.up_proj"]
        )
        self.intermediate = mlp.gate_proj.out_features
        self.down = weights.pack(prefix, [mlp.down_proj], ["mlp.down_proj"])
        self.act = mlp.act_fn
        self.scaling = attention.scaling


class _Weights:
    """Packs a product's weights: from the GGUF file's blocks where they are proven equal to
    the model's (kvgraftd.engine.gguf_weights), else the model's float32 weights."""

    def __init__(self, gguf: GgufWeights | None) -> None:
        self.gguf = gguf
        self.formats: dict[str, int] = {}

    def pack(self, prefix: str, modules: list, names: list[str]) -> PackedWeight:
        packed = (
            self.gguf.packed([f"{prefix}{name}.weight" for name in names]) if self.gguf else None
        )
        if packed is None:
            packed = PackedWeight.of(torch.cat([module.weight for module in modules]))
        self.formats[packed.format] = self.formats.get(packed.format, 0) + 1
        return packed


class NativeForward:
    def __init__(self, model, gguf_path: Path | None = None) -> None:
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        decoder = model.model
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.norm = decoder.norm
        weights = _Weights(GgufWeights.open(gguf_path, model) if gguf_path else None)
        self.layers = [_Layer(index, layer, weights) for index, layer in enumerate(decoder.layers)]
        self.logits = weights.pack("", [model.lm_head], ["lm_head"])
        # products by weight format, e.g. {"q4_1": 120, "q8_0": 1}: what the kernels stream
        self.weight_formats = dict(sorted(weights.formats.items()))

    def forward(
        self, token_ids: list[int], start: int, context: Any, every_row: bool = False
    ) -> torch.Tensor:
        """Logits (float32) of the last of `token_ids` at positions start..., or of every row."""
        return self.forward_many([(context, token_ids, start)], every_row)[0]

    @torch.inference_mode()
    def forward_many(
        self, parts: list[tuple[Any, list[int], int]], every_row: bool = False
    ) -> list[torch.Tensor]:
        """One pass over the rows of several contexts: each part is (context, token ids, first
        position); every product takes all the rows at once, each context attends its own.
        Returns each part's logits (its last row's, or every row's)."""
        if torch.get_num_threads() != 1:
            # torch's elementwise ops must run on one thread: with more, a pass is cut into
            # chunks whose ends fall mid-row, and the elements at a chunk's end take a scalar
            # path with other last bits. (The products have their own threads.)
            torch.set_num_threads(1)
        sizes = [len(ids) for _, ids, _ in parts]
        ids = [token for _, part_ids, _ in parts for token in part_ids]
        positions = [p for _, part_ids, start in parts for p in range(start, start + len(part_ids))]
        hidden = self.embed(torch.tensor(ids, dtype=torch.long))  # [rows, hidden]
        cos, sin = self.rotary(hidden.unsqueeze(0), torch.tensor([positions]))
        contexts = [context for context, _, _ in parts]
        for index, layer in enumerate(self.layers):
            hidden = hidden + self._attention(index, layer, hidden, cos, sin, contexts, sizes)
            hidden = hidden + self._mlp(layer, hidden)
        ends = torch.tensor(sizes).cumsum(0)
        rows = hidden if every_row else hidden[ends - 1]
        logits = linear.linear(self.norm(rows), self.logits)
        return list(logits.split(sizes)) if every_row else list(logits)

    def _attention(self, index: int, layer: _Layer, hidden, cos, sin, contexts, sizes):
        n, dim = hidden.shape[0], self.head_dim
        q, k, v = linear.linear(layer.input_norm(hidden), layer.qkv).split(layer.splits, dim=-1)
        q = q.view(n, self.heads, dim).transpose(0, 1).unsqueeze(0)  # [1, heads, rows, D]
        k = k.view(n, self.kv_heads, dim).transpose(0, 1).unsqueeze(0)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        v = v.view(n, self.kv_heads, dim).transpose(0, 1)
        out = torch.cat(
            [
                context.attend(index, q_part, k_part, v_part, layer.scaling)  # [rows, heads, D]
                for context, q_part, k_part, v_part in zip(
                    contexts,
                    q[0].split(sizes, 1),
                    k[0].split(sizes, 1),
                    v.split(sizes, 1),
                    strict=True,
                )
            ]
        )
        return linear.linear(out.reshape(n, self.heads * dim), layer.out)

    def _mlp(self, layer: _Layer, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = linear.linear(layer.post_norm(hidden), layer.gate_up).split(
            layer.intermediate, dim=-1
        )
        return linear.linear(layer.act(gate) * up, layer.down)
