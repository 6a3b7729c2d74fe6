"""A decoder layer's weights as the row-invariant forward computes with them, packed once.

`WeightPacker` packs a product's weights: from the GGUF file's blocks where they are
proven equal to the model's (kvgraftd.engine.model.gguf_weights; laid out for the
integer products with `integer`), else the model's float32 weights. `PackedLayer`
holds one layer of any family kvgraftd.engine.model.families reads: q, k and v as one
product (one weight in Phi-3, three elsewhere); the output product; gate and up as one
product; down; each product's bias where the model has one (Qwen 2's q, k, v); and the
norms' weights as the forward
multiplies by them (offset by 1 in Gemma: transformers' (1 + w) in float32, the same
bits): the input norm, the MLP's input norm, and where the family has them the query
and key heads' norms and the norms after attention and after the MLP.
"""

from __future__ import annotations

import torch

from kvgraftd.engine.model.families import Family
from kvgraftd.engine.model.gguf_weights import GgufWeights
from kvgraftd.engine.model.linear import PackedWeight


class WeightPacker:
    def __init__(self, gguf: GgufWeights | None, integer: bool) -> None:
        self.gguf = gguf
        self.integer = integer
        self.formats: dict[str, int] = {}
        self.from_blocks: list = []  # the modules whose product reads the file's blocks

    def pack(self, prefix: str, modules: list, names: list[str]) -> PackedWeight:
        names = [f"{prefix}{name}.weight" for name in names]
        packed = self.gguf.packed(names, self.integer) if self.gguf else None
        if packed is None:
            packed = PackedWeight.of(torch.cat([module.weight for module in modules]))
        else:
            self.from_blocks += modules
        self.formats[packed.format] = self.formats.get(packed.format, 0) + 1
        return packed


def _bias(modules: list) -> torch.Tensor | None:
    """The products' biases as one float32 vector (zeros where one has none); None where none
    has one."""
    if all(module.bias is None for module in modules):
        return None
    parts = [
        torch.zeros(module.out_features) if module.bias is None else module.bias.detach()
        for module in modules
    ]
    return torch.cat(parts).to(torch.float32).clone()


def norm_weight(module, offset: float = 0.0) -> torch.Tensor:
    """A norm's weight as the forward multiplies by it (offset + w, in float32), a copy of its
    own (not a view of the model file's mapping)."""
    weight = module.weight.detach().to(torch.float32)
    return (weight + offset if offset else weight).clone()


class PackedLayer:
    def __init__(
        self, index: int, layer, packer: WeightPacker, family: Family, splits: list[int]
    ) -> None:
        """`splits`: the widths of q, k and v in the product's output."""
        attention, mlp, offset = layer.self_attn, layer.mlp, family.norm_offset
        self.splits = splits
        prefix = f"model.layers.{index}."
        if family.fused:
            projections, gate_up = [attention.qkv_proj], [mlp.gate_up_proj]
            self.qkv = packer.pack(prefix, projections, ["self_attn.qkv_proj"])
            self.gate_up = packer.pack(prefix, gate_up, ["mlp.gate_up_proj"])
        else:
            projections = [attention.q_proj, attention.k_proj, attention.v_proj]
            names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
            self.qkv = packer.pack(prefix, projections, names)
            gate_up = [mlp.gate_proj, mlp.up_proj]
            self.gate_up = packer.pack(prefix, gate_up, ["mlp.gate_proj", "mlp.up_proj"])
        self.out = packer.pack(prefix, [attention.o_proj], ["self_attn.o_proj"])
        self.down = packer.pack(prefix, [mlp.down_proj], ["mlp.down_proj"])
        self.qkv_bias, self.gate_up_bias = _bias(projections), _bias(gate_up)
        self.out_bias, self.down_bias = _bias([attention.o_proj]), _bias([mlp.down_proj])
        self.intermediate = self.gate_up.n // 2
        self.scaling = attention.scaling
        self.input_norm = norm_weight(layer.input_layernorm, offset)
        self.q_norm = self.k_norm = self.attention_out_norm = self.mlp_out_norm = None
        if family.qk_norm:
            self.q_norm = norm_weight(attention.q_norm, offset)
            self.k_norm = norm_weight(attention.k_norm, offset)
        if family.sandwich_norms:  # Gemma: post_attention_layernorm is on attention's output
            self.attention_out_norm = norm_weight(layer.post_attention_layernorm, offset)
            self.post_norm = norm_weight(layer.pre_feedforward_layernorm, offset)
            self.mlp_out_norm = norm_weight(layer.post_feedforward_layernorm, offset)
        else:  # Llama's post_attention_layernorm is the MLP's input norm
            self.post_norm = norm_weight(layer.post_attention_layernorm, offset)
