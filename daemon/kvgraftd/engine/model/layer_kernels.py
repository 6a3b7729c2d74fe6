"""A decoder layer in three native calls: the products and row-wise operations before and
after attention (native/layer.c), and the decode steps of many contexts (native/attend.c).

Contract: each call makes the calls the row-invariant forward made one at a time
(kvgraftd.engine.model.linear, kvgraftd.engine.model.rowwise, and each context's own K/V write and
`attend_live_step`), in the same order on the same bytes, so every output has the bits
it had; what changes is the interpreter's time between them, paid once a layer instead of
about ten times, and once a layer for all the decoding contexts of a step instead of once
each.

* `qkv(normed, weight, table, heads, head_dim)`: the q, k and v product, the queries'
  and keys' heads rotated: [rows, n].
* `mlp(attended, hidden, weights, post_norm, inter, eps, next_norm)`: out product,
  residual add and norm, gated MLP, residual add, the next norm: the next layer's input
  [rows, dim] (hidden updated in place).
* `LiveRows`: the decoding contexts of a step whose KV is all live on CPU, attended in one
  call a layer (`attend(layer, qkv, out, ...)`); each context's buffers are read once a
  step (`KvContext.live_buffers`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvgraftd.engine.model import decode_attention, linear
from kvgraftd.engine.model.linear import PackedWeight

_I64, _I32, _P = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p


def _load() -> tuple[ctypes.CDLL, ctypes.CDLL] | None:
    products, attend = linear.native_library(), decode_attention.native_library()
    if products is None or attend is None or not hasattr(products, "kvg_layer_mlp"):
        return None
    products.kvg_layer_qkv.argtypes = [ctypes.c_int, _P, _I64, _I64, _P, _I64, _P, _P]
    products.kvg_layer_qkv.argtypes += [_I64, _I64, _P, ctypes.c_int]
    products.kvg_layer_qkv.restype = ctypes.c_int
    products.kvg_layer_mlp.argtypes = [_P, _I64, _I64, _P, _I64, _P, _P, _I64, ctypes.c_float]
    products.kvg_layer_mlp.argtypes += [_P, _P, ctypes.c_int]
    products.kvg_layer_mlp.restype = ctypes.c_int
    attend.kvg_decode_live_rows.argtypes = [_I32] * 3 + [_P, _I64] + [_I32] * 3 + [_P] * 5
    attend.kvg_decode_live_rows.argtypes += [_I64, ctypes.c_float, _P, _I64]
    attend.kvg_decode_live_rows.restype = ctypes.c_int
    return products, attend


_libraries = _load()


def available() -> bool:
    return _libraries is not None


def _check(status: int, what: str) -> None:
    if status < 0:
        raise MemoryError(f"the native {what} ran out of memory")
    if status:
        raise RuntimeError(f"the native {what} refused its arguments ({status})")


def qkv(
    normed: torch.Tensor, weight: PackedWeight, table, heads: int, head_dim: int
) -> torch.Tensor:
    """normed [rows, dim] times the q, k, v weights, the first `heads` heads rotated."""
    rows, dim = normed.shape
    out = torch.empty(rows, weight.n, dtype=torch.float32)
    status = _libraries[0].kvg_layer_qkv(
        weight.code, normed.data_ptr(), rows, dim, weight.address, weight.n,
        table.cos.data_ptr(), table.sin.data_ptr(), heads, head_dim, out.data_ptr(),
        linear.THREADS,
    )  # fmt: skip
    _check(status, "q, k, v product")
    return out


@dataclass(frozen=True)
class MlpWeights:
    """The packed products after attention, as kvg_layer_mlp takes them: (format, address)
    of the out, gate-and-up and down weights."""

    table: np.ndarray  # int64 [6]
    packed: tuple[PackedWeight, ...]  # kept alive: the table holds their addresses

    @classmethod
    def of(cls, out: PackedWeight, gate_up: PackedWeight, down: PackedWeight) -> MlpWeights:
        table = [value for w in (out, gate_up, down) for value in (w.code, w.address)]
        return cls(np.array(table, dtype=np.int64), (out, gate_up, down))


def mlp(
    attended: torch.Tensor,
    hidden: torch.Tensor,
    weights: MlpWeights,
    post_norm: torch.Tensor,
    inter: int,
    eps: float,
    next_norm: torch.Tensor,
) -> torch.Tensor:
    """Attention's output [rows, width] into the residual stream `hidden` [rows, dim] (in
    place) and through the MLP; returns the next layer's normed input [rows, dim]."""
    rows, dim = hidden.shape
    normed = torch.empty(rows, dim, dtype=torch.float32)
    status = _libraries[0].kvg_layer_mlp(
        attended.data_ptr(), rows, attended.shape[1], hidden.data_ptr(), dim,
        weights.table.ctypes.data, post_norm.data_ptr(), inter, eps, next_norm.data_ptr(),
        normed.data_ptr(), linear.THREADS,
    )  # fmt: skip
    _check(status, "MLP")
    return normed


class LiveRows:
    """The step's decoding contexts attended in one call a layer: row `rows[i]` of the pass
    is context i's one token, at position `positions[i]` of its live buffers."""

    def __init__(self, contexts: Sequence, rows: Sequence[int], layers: int, block: int) -> None:
        buffers = [context.live_buffers() for context in contexts]
        self.count, self.layers, self.block = len(rows), layers, block
        self.keys = np.concatenate([keys for keys, _, _ in buffers]).astype(np.int64)
        self.values = np.concatenate([values for _, values, _ in buffers]).astype(np.int64)
        self.strides = np.array([stride for _, _, stride in buffers], dtype=np.int64)
        self.positions = np.array([c.length for c in contexts], dtype=np.int64)
        self.rows = np.array(rows, dtype=np.int64)

    def attend(
        self, layer: int, qkv: torch.Tensor, out: torch.Tensor, geometry: tuple[int, int, int],
        scaling: float,
    ) -> None:  # fmt: skip
        """Write each context's K, V of `layer` (from its row of qkv) and attend: its
        output row of `out` [rows, heads * D]."""
        kv_heads, group, dim = geometry
        status = _libraries[1].kvg_decode_live_rows(
            self.count, layer, self.layers, qkv.data_ptr(), qkv.shape[1], kv_heads, group, dim,
            self.keys.ctypes.data, self.values.ctypes.data, self.strides.ctypes.data,
            self.positions.ctypes.data, self.rows.ctypes.data, self.block, scaling,
            out.data_ptr(), out.shape[1],
        )  # fmt: skip
        _check(status, "decode attention")
