"""A GGUF file's quantized blocks as the native forward's weights, proven equal to the model's.

transformers loads a GGUF by dequantizing every tensor to float32 (gguf-py's
arithmetic) and, for Llama's (and Mistral's) q and k projections, permuting rows back
from llama.cpp's rotary layout (the other families' files keep the model's order). The
native linear kernel can multiply by the file's Q4_1 / Q8_0 blocks directly,
dequantizing each weight in a register with that
same arithmetic (kvgraftd.engine.model.linear): the same product bits from ~6x fewer
bytes a decode step.

Contract: `GgufWeights.open(path, model)` reads the file's tensors (memory-mapped);
`packed(names)` returns one PackedWeight whose columns are the named model
weights' rows, stacked in order (q, k and v as one product), from the file's
blocks, and only if every weight it stands for is bit-equal to the model's
float32 tensor (unpacked and compared as 32-bit patterns): the row order
transformers applies is checked, not assumed (q and k are tried in llama.cpp's rotary
order, then in the file's own). Otherwise it returns None and the
caller packs the float32 weights: never a different weight, only a slower one.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from kvgraftd.engine.model.linear import PackedWeight

log = logging.getLogger(__name__)

# the model's parameter names and the file's, for layer i (Phi-3's fused q, k, v and gate, up)
_LAYER_TENSORS = {
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_FORMATS = {"Q4_1": "q4_1", "Q8_0": "q8_0"}


class GgufWeights:
    def __init__(self, tensors: dict, model) -> None:
        self._tensors = tensors
        self._parameters = dict(model.named_parameters(remove_duplicate=False))  # tied lm_head too
        config = model.config
        self._heads = config.num_attention_heads
        self._kv_heads = getattr(config, "num_key_value_heads", None) or self._heads

    @classmethod
    def open(cls, path: Path, model) -> GgufWeights | None:
        """The file's tensors for `model`, or None where the file cannot be read as GGUF."""
        try:
            from gguf import GGUFReader

            reader = GGUFReader(str(path))
        except Exception as error:
            log.info("the native forward keeps float32 weights (%s: %s)", path.name, error)
            return None
        return cls({tensor.name: tensor for tensor in reader.tensors}, model)

    def packed(self, names: list[str], integer: bool = False) -> PackedWeight | None:
        """The named model weights (e.g. "model.layers.0.self_attn.q_proj.weight"), their
        rows stacked, as one PackedWeight of the file's blocks (laid out for the integer
        products with `integer`); None where any is not stored in one supported format or
        is not bit-equal to the model's."""
        for rotary_order in (True, False):
            packed = self._packed(names, integer, rotary_order)
            if packed is not None:
                return packed
        return None

    def _packed(self, names: list[str], integer: bool, rotary_order: bool) -> PackedWeight | None:
        found = [self._source(name, rotary_order) for name in names]
        if any(source is None for source in found):
            return None
        if not rotary_order and not any(rotary for _, _, rotary in found):
            return None  # no q or k: the first try was this one
        sources = [(tensor, rows) for tensor, rows, _ in found]
        formats = {_FORMATS.get(tensor.tensor_type.name) for tensor, _ in sources}
        widths = {tensor.data.shape[1] for tensor, _ in sources}
        if len(formats) != 1 or None in formats or len(widths) != 1:
            return None
        blocks, order, offset = [], [], 0
        for tensor, rows in sources:
            blocks.append(np.asarray(tensor.data))
            order.append(rows + offset)
            offset += tensor.data.shape[0]
        k = self._parameters[names[0]].shape[1]
        packed = PackedWeight.of_gguf(
            formats.pop(), np.concatenate(blocks), np.concatenate(order), k, integer
        )
        model_weights = torch.cat([self._parameters[name].detach() for name in names])
        bits = packed.unpacked().view(torch.int32), model_weights.view(torch.int32)
        return packed if torch.equal(*bits) else None

    def _source(self, name: str, rotary_order: bool) -> tuple[object, np.ndarray, bool] | None:
        """The file's tensor for a model weight, the file's row for each model row (for q and
        k with `rotary_order`, transformers' permutation back from llama.cpp's rotary
        order), and whether it is q or k."""
        file_name = self._file_name(name)
        tensor = self._tensors.get(file_name) if file_name else None
        weight = self._parameters.get(name)
        if tensor is None or weight is None or tuple(tensor.data.shape[:1]) != weight.shape[:1]:
            return None
        rows = np.arange(weight.shape[0])
        heads = {"attn_q.weight": self._heads, "attn_k.weight": self._kv_heads}
        rotary = heads.get(file_name.split(".", 2)[-1])  # blk.{i}.attn_q.weight
        if rotary and rotary_order:
            rows = _reverse_permuted(rows, rotary)
        return tensor, rows, rotary is not None

    def _file_name(self, name: str) -> str | None:
        if name == "lm_head.weight":
            return "output.weight" if "output.weight" in self._tensors else "token_embd.weight"
        parts = name.split(".")  # model.layers.{i}.{module}.{projection}.weight
        if len(parts) != 6 or parts[:2] != ["model", "layers"] or parts[5] != "weight":
            return None
        tensor = _LAYER_TENSORS.get(f"{parts[3]}.{parts[4]}")
        return f"blk.{parts[2]}.{tensor}.weight" if tensor else None


def _reverse_permuted(rows: np.ndarray, heads: int) -> np.ndarray:
    """transformers' reverse of llama.cpp's rotary row permutation, applied to row indices."""
    dim = rows.shape[0] // heads // 2
    return rows.reshape(heads, dim, 2).swapaxes(2, 1).reshape(-1)
