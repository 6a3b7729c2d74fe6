"""The CPU forward pass with row-invariant matrix products (kvgraftd.engine.model.linear).

A decoder of any family kvgraftd.engine.model.families reads (Llama, Mistral, Qwen 2 and 3,
Gemma 2 and 3, Phi-3), computed layer by layer: the embedding (a lookup: in the output
product's GGUF blocks where the two are tied, else the model's table; scaled where the
family scales it), kvgraftd.engine.model.linear for every product (q, k and v as one
product, the gate and up projections as one, the logits), the row-wise operations of
kvgraftd.engine.model.rowwise (residual adds, norms, rotary positions, activations, soft
caps), and the context (kvgraftd.engine.attention.kv_context) for attention and the KV
it keeps, with each layer's sliding window and score cap. Each layer runs in the fused
native calls of kvgraftd.engine.model.layer_kernels (its family's biases, head norms,
norms after attention and the MLP, GELU gate and rotary table among their entries), and
a step of decode rows through every layer in one.

Contract: a row's bits depend on its token, its position and the KV it attends,
never on how many rows share the pass. Each product sums every output in one
fixed order and each row-wise operation is one fixed sequence per row (their
own contracts); the real-model tests check it end to end
(tests/engine/test_native_forward.py, and every family's tiny model in
tests/engine/test_model_families.py). The arithmetic is the model's up to the
order of sums and its own exp, tanh, cos and sin: logits agree with transformers' to
about 1e-4, argmax equal.
`forward` returns the float32 logits of the last row, or of every row;
`forward_many` runs the rows of several contexts, each at its own positions and
attending its own KV, in one pass (the engine's batch).

Weights are packed once when the model loads (kvgraftd.engine.model.packed_layers), next
to the model's own (which the CUDA path and the fingerprint still read): from the GGUF
file's quantized blocks where the model came from one and they are proven bit-equal to
its weights (kvgraftd.engine.model.gguf_weights), else as float32. `products` chooses
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
from kvgraftd.engine.model.families import Family
from kvgraftd.engine.model.gguf_weights import GgufWeights
from kvgraftd.engine.model.packed_layers import PackedLayer, WeightPacker, norm_weight

# the products as a compute profile names them: float FMA chains (linear.c), or integer dot
# products over 8-bit activations (linear_int8.c; weights without GGUF blocks keep the chains)
FLOAT_PRODUCTS = "row-invariant-fma rowwise=2"
INTEGER_PRODUCTS = "int8-dot/1 row-invariant-fma rowwise=2"


def missing(model) -> list[str]:
    """What this forward lacks to compute `model` exactly as its own modules do, with every
    row's attention in the native kernel (else a pass's rows would attend through torch's
    products, whose bits depend on the number of rows); empty where it takes it."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    lacking = list(Family.of(model).missing)
    if not rowwise.available():
        lacking.append("the native kernels (not built: make install)")
    elif not decode_attention.takes_geometry(heads, kv_heads, head_dim):
        lacking.append(f"attention heads of {head_dim} values, {heads // kv_heads} a KV head")
    return lacking


def supports(model) -> bool:
    return not missing(model)


class NativeForward:
    def __init__(self, model, gguf_path: Path | None = None, products: str = "int8-dot") -> None:
        if products not in PRODUCTS:
            raise ValueError(f"products {products!r}: use {' or '.join(PRODUCTS)}")
        config = model.config
        self.family = family = Family.of(model)
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        decoder = model.model
        self.embed = decoder.embed_tokens
        scale = getattr(self.embed, "embed_scale", None)  # Gemma's, in its embedding's forward
        self._embed_scale = None if scale is None else scale.to(torch.float32).clone()
        self.norm = norm_weight(decoder.norm, family.norm_offset)
        self.eps = family.eps
        gguf = GgufWeights.open(gguf_path, model) if gguf_path else None
        packer = WeightPacker(gguf, products == "int8-dot")
        dim, kv = self.head_dim, self.kv_heads
        splits = [self.heads * dim, kv * dim, kv * dim]
        self.layers = [
            PackedLayer(index, layer, packer, family, splits)
            for index, layer in enumerate(decoder.layers)
        ]
        self.logits = packer.pack("", [model.lm_head], ["lm_head"])
        # a tied embedding read from the output product's blocks: the same floats (proven
        # equal with them), so the float32 table need not stay (release_model_weights)
        tied = model.lm_head.weight.data_ptr() == self.embed.weight.data_ptr()
        self._embedding_blocks = self.logits if tied and self.logits.format != "f32" else None
        shape = {
            "heads": self.heads, "kv_heads": kv, "dim": dim,
            "inter": self.layers[0].intermediate, "qkv_n": self.layers[0].qkv.n, "eps": self.eps,
        }  # fmt: skip
        self.native_layers = layer_kernels.Layers.of(self.layers, self.norm, shape, family)
        # products by weight format, e.g. {"q4_1": 120, "q8_0": 1}: what the kernels stream
        self.weight_formats = dict(sorted(packer.formats.items()))
        self._from_blocks = packer.from_blocks
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
        if self._embedding_blocks is None:
            return self.embed(at).contiguous()  # the module scales where its family does
        rows = self._embedding_blocks.rows(at)
        return rows if self._embed_scale is None else rows * self._embed_scale

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
            # what torch still computes (the embedding, attention's scaling, copies)
            # stays on one thread: the products and row-wise operations have their own
            torch.set_num_threads(1)
        sizes = [len(ids) for _, ids, _ in parts]
        ids = [token for _, part_ids, _ in parts for token in part_ids]
        positions = [p for _, part_ids, start in parts for p in range(start, start + len(part_ids))]
        hidden = self._embedding(ids)
        tables = [  # in the order of the family's (as layer_kernels numbers them)
            rowwise.RopeTable.of(positions, table.inv_freq, table.scaling)
            for table in self.family.rope_tables.values()
        ]
        contexts = [context for context, _, _ in parts]
        one_call = [c.decodes_in_one_call(size) for c, size in zip(contexts, sizes, strict=True)]
        live = self._live_rows(contexts, sizes, one_call)
        normed = rowwise.add_rmsnorm(hidden, None, self.layers[0].input_norm, self.eps)
        layers = self.native_layers
        if live is not None and live.count == len(parts):  # decode rows only: one call
            normed = layers.decode(live, hidden, normed, tables)
        else:
            for index, layer in enumerate(self.layers):
                qkv = layers.qkv(index, normed, tables)
                attended = self._attention(index, layer, qkv, parts, one_call, live)
                normed = layers.mlp(index, attended, hidden)
        if rows is not None:
            logits = self._logits(normed[torch.tensor(rows, dtype=torch.long)])
            return [logits]
        ends = torch.tensor(sizes).cumsum(0)
        logits = self._logits(normed if every_row else normed[ends - 1])
        return list(logits.split(sizes)) if every_row else list(logits)

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        logits = linear.linear(normed, self.logits)
        linear.rest()  # the pass is done: its cores serve the request threads meanwhile
        if self.family.final_softcap:
            rowwise.softcap_(logits, self.family.final_softcap)
        return logits

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

    def _attention(self, index: int, layer: PackedLayer, qkv, parts, one_call, live):
        """Each context's attention of this layer over its rows of `qkv`, its K and V kept:
        [rows, heads * D] (those of `live` in one call, the others each through its own
        `attend`)."""
        n, dim = qkv.shape[0], self.head_dim
        out = torch.empty(n, self.heads * dim, dtype=torch.float32)
        geometry = (self.kv_heads, self.heads // self.kv_heads, dim)
        if live is not None:
            window, softcap = self.native_layers.window(index), self.family.attention_softcap
            live.attend(index, qkv, out, geometry, layer.scaling, window, softcap)
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
