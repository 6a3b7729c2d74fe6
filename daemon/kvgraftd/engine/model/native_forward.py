"""The CPU forward pass with row-invariant matrix products (kvgraftd.engine.model.linear).

A Llama-family decoder (attention q/k/v/o projections, a SiLU-gated MLP, RMS
norms, rotary positions with a fixed inv_freq, no biases) computed layer by
layer: the embedding (a lookup: in the output product's GGUF blocks where the two are
tied, else the model's table), kvgraftd.engine.model.linear for every
product (q, k and v as one product, the gate and up projections as one, the
logits), kvgraftd.engine.model.rowwise for the residual adds, norms, rotary positions
and activation, and the context (kvgraftd.engine.attention.kv_context) for attention and
the KV it keeps.

Contract: a row's bits depend on its token, its position and the KV it attends,
never on how many rows share the pass. Each product sums every output in one
fixed order and each row-wise operation is one fixed sequence per row (their
own contracts); the real-model tests check it end to end
(tests/engine/test_native_forward.py). The arithmetic is the model's up to the
order of sums and its own exp, cos and sin: logits agree with transformers' to
about 1e-4, argmax equal.
`forward` returns the float32 logits of the last row, or of every row;
`forward_many` runs the rows of several contexts, each at its own positions and
attending its own KV, in one pass (the engine's batch).

Weights are packed once when the model loads, next to the model's own (which
the CUDA path and the fingerprint still read): from the GGUF file's quantized
blocks where the model came from one and they are proven bit-equal to its
weights (kvgraftd.engine.model.gguf_weights), else as float32. `products` chooses
the arithmetic over those blocks: "int8-dot" (integer dot products over activations
quantized to 8 bits; the default) or "fp32" (the dequantized weights in float, whose
logits agree with transformers' to ~1e-4); `products_profile` is what the compute
profile names (float32 weights keep the float chains in both).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvgraftd.config import PRODUCTS
from kvgraftd.engine.model import decode_attention, layer_kernels, linear, rowwise
from kvgraftd.engine.model.gguf_weights import GgufWeights
from kvgraftd.engine.model.linear import PackedWeight

SUPPORTED_TYPES = frozenset({"llama"})
# the products as a compute profile names them: float FMA chains (linear.c), or integer dot
# products over 8-bit activations (linear_int8.c; weights without GGUF blocks keep the chains)
FLOAT_PRODUCTS = "row-invariant-fma rowwise=2"
INTEGER_PRODUCTS = "int8-dot/1 row-invariant-fma rowwise=2"
STATIC_ROPE = frozenset({"default", "linear", "llama3"})  # inv_freq fixed at load


def supports(model) -> bool:
    """Whether `model` is a decoder this forward computes exactly as its own modules do,
    with every row's attention in the native kernel (else a pass's rows would attend
    through torch's products, whose bits depend on the number of rows)."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return (
        rowwise.available()
        and decode_attention.takes_geometry(heads, kv_heads, head_dim)
        and config.model_type in SUPPORTED_TYPES
        and not getattr(config, "attention_bias", False)
        and not getattr(config, "mlp_bias", False)
        and getattr(config, "hidden_act", None) == "silu"
        and getattr(model.model.rotary_emb, "rope_type", None) in STATIC_ROPE
        and len(_norm_epsilons(model.model)) == 1
    )


def _norm_epsilons(decoder) -> set[float]:
    norms = [decoder.norm]
    for layer in decoder.layers:
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
    return {getattr(norm, "variance_epsilon", None) for norm in norms}


class _Layer:
    def __init__(self, index: int, layer, weights: _Weights) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        self.input_norm = _norm(layer.input_layernorm)
        self.post_norm = _norm(layer.post_attention_layernorm)
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
        self.scaling = attention.scaling


def _norm(module) -> torch.Tensor:
    """A norm's weight, a copy of its own (not a view of the model file's mapping)."""
    return module.weight.detach().to(torch.float32).clone()


class _Weights:
    """Packs a product's weights: from the GGUF file's blocks where they are proven equal to
    the model's (kvgraftd.engine.model.gguf_weights; for the integer products with
    `integer`), else the model's float32 weights."""

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


class NativeForward:
    def __init__(self, model, gguf_path: Path | None = None, products: str = "int8-dot") -> None:
        if products not in PRODUCTS:
            raise ValueError(f"products {products!r}: use {' or '.join(PRODUCTS)}")
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        decoder = model.model
        self.embed = decoder.embed_tokens
        self.inv_freq = decoder.rotary_emb.inv_freq.detach().to(torch.float32).clone()
        self.rope_scaling = float(decoder.rotary_emb.attention_scaling)
        self.norm = _norm(decoder.norm)
        self.eps = float(decoder.norm.variance_epsilon)
        gguf = GgufWeights.open(gguf_path, model) if gguf_path else None
        weights = _Weights(gguf, products == "int8-dot")
        self.layers = [_Layer(index, layer, weights) for index, layer in enumerate(decoder.layers)]
        self.logits = weights.pack("", [model.lm_head], ["lm_head"])
        # a tied embedding read from the output product's blocks: the same floats (proven
        # equal with them), so the float32 table need not stay (release_model_weights)
        tied = model.lm_head.weight.data_ptr() == self.embed.weight.data_ptr()
        self._embedding_blocks = self.logits if tied and self.logits.format != "f32" else None
        first = self.layers[0]
        shape = {
            "heads": self.heads, "kv_heads": self.kv_heads, "dim": self.head_dim,
            "inter": first.intermediate, "qkv_n": first.qkv.n, "eps": self.eps,
        }  # fmt: skip
        self.native_layers = layer_kernels.Layers.of(self.layers, self.norm, shape)
        # products by weight format, e.g. {"q4_1": 120, "q8_0": 1}: what the kernels stream
        self.weight_formats = dict(sorted(weights.formats.items()))
        self._from_blocks = weights.from_blocks
        integer = any(format.endswith("_i8") for format in self.weight_formats)
        self.products_profile = INTEGER_PRODUCTS if integer else FLOAT_PRODUCTS

    def release_model_weights(self) -> int:
        """Frees the model's float32 copies of the weights whose products read the GGUF
        file's blocks (this forward never reads them again; the embedding too where the
        lookup reads the tied output product's blocks, else it is kept); returns the bytes
        freed. The model's own forward cannot run after."""
        keep = None if self._embedding_blocks is not None else self.embed.weight
        freed: dict[int, int] = {}
        for module in [*self._from_blocks, self.embed]:
            weight = module.weight
            if weight.numel() and weight is not keep:
                freed[weight.data_ptr()] = weight.numel() * weight.element_size()
                module.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        self._from_blocks = []
        return sum(freed.values())

    def _embedding(self, ids: list[int]) -> torch.Tensor:
        """The input rows of `ids`: [rows, hidden]."""
        at = torch.tensor(ids, dtype=torch.long)
        if self._embedding_blocks is not None:
            return self._embedding_blocks.rows(at)
        return self.embed(at).contiguous()

    def forward(
        self,
        token_ids: list[int],
        start: int,
        context: Any,
        every_row: bool = False,
        rows: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Logits (float32) of the last of `token_ids` at positions start..., of every row, or
        of the given `rows` (indices into token_ids: [len(rows), vocab])."""
        if rows is not None:
            return self.forward_many([(context, token_ids, start)], rows=rows)[0]
        return self.forward_many([(context, token_ids, start)], every_row)[0]

    @torch.inference_mode()
    def forward_many(
        self,
        parts: list[tuple[Any, list[int], int]],
        every_row: bool = False,
        rows: Sequence[int] | None = None,
    ) -> list[torch.Tensor]:
        """One pass over the rows of several contexts: each part is (context, token ids, first
        position); every product takes all the rows at once, each context attends its own.
        Returns each part's logits (its last row's, or every row's); with `rows`, one
        tensor of the logits of those rows of the pass only (the logits are the pass's
        costliest product: a replay takes just the rows it hashes)."""
        if torch.get_num_threads() != 1:
            # what torch still computes (the embedding, attention's scaling, copies) stays on
            # one thread: the products and row-wise operations have their own
            torch.set_num_threads(1)
        sizes = [len(ids) for _, ids, _ in parts]
        ids = [token for _, part_ids, _ in parts for token in part_ids]
        positions = [p for _, part_ids, start in parts for p in range(start, start + len(part_ids))]
        hidden = self._embedding(ids)
        table = rowwise.RopeTable.of(positions, self.inv_freq, self.rope_scaling)
        contexts = [context for context, _, _ in parts]
        one_call = [c.decodes_in_one_call(size) for c, size in zip(contexts, sizes, strict=True)]
        live = self._live_rows(contexts, sizes, one_call)
        normed = rowwise.add_rmsnorm(hidden, None, self.layers[0].input_norm, self.eps)
        layers = self.native_layers
        if live is not None and live.count == len(parts):  # decode rows only: one call
            normed = layers.decode(live, hidden, normed, table)
        else:
            for index, layer in enumerate(self.layers):
                attended = self._attention(index, layer, normed, table, parts, one_call, live)
                normed = layers.mlp(index, attended, hidden)
        if rows is not None:
            logits = linear.linear(normed[torch.tensor(rows, dtype=torch.long)], self.logits)
            linear.rest()  # the pass is done: its cores serve the request threads meanwhile
            return [logits]
        ends = torch.tensor(sizes).cumsum(0)
        logits = linear.linear(normed if every_row else normed[ends - 1], self.logits)
        linear.rest()
        return list(logits.split(sizes)) if every_row else list(logits)

    def _live_rows(
        self, contexts: list, sizes: list[int], one_call: list[bool]
    ) -> layer_kernels.LiveRows | None:
        """The decoding contexts whose step one kernel call attends, with their rows."""
        starts = [0, *itertools.accumulate(sizes)][:-1]  # each part's first row
        chosen = [
            (context, start)
            for context, start, chosen in zip(contexts, starts, one_call, strict=True)
            if chosen
        ]
        if not chosen:
            return None
        picked, rows = zip(*chosen, strict=True)
        block = picked[0].block_tokens
        return layer_kernels.LiveRows(picked, rows, len(self.layers), block)

    def _attention(self, index: int, layer: _Layer, normed, table, parts, one_call, live):
        """Each context's attention of this layer, its K and V kept: [rows, heads * D]
        (those of `live` in one call, the others each through its own `attend`)."""
        n, dim = normed.shape[0], self.head_dim
        qkv = self.native_layers.qkv(index, normed, table)
        out = torch.empty(n, self.heads * dim, dtype=torch.float32)
        geometry = (self.kv_heads, self.heads // self.kv_heads, dim)
        if live is not None:
            live.attend(index, qkv, out, geometry, layer.scaling)
        pairs = zip(parts, one_call, strict=True)
        if any(not in_live and len(ids) > 1 for (_, ids, _), in_live in pairs):
            # a pass of many rows attends on the row threads: the products' workers sleep
            # meanwhile instead of spinning on the cores those threads need
            linear.rest()
        start = 0
        for (context, ids, _), in_live in zip(parts, one_call, strict=True):
            size = len(ids)
            if not in_live:
                q, k, v = qkv[start : start + size].split(layer.splits, dim=-1)
                attended = context.attend(
                    index,
                    q.view(size, self.heads, dim).transpose(0, 1),  # [heads, rows, D]
                    k.view(size, self.kv_heads, dim).transpose(0, 1),
                    v.view(size, self.kv_heads, dim).transpose(0, 1),
                    layer.scaling,
                )  # [rows, heads, D]
                out[start : start + size] = attended.reshape(size, self.heads * dim)
            start += size
        return out
