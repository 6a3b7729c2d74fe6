"""A decoder layer in three native calls, and a decode step's every layer in one
(native/linear/layer.c; the decode steps of many contexts: native/attend/attend.c), for
every family kvgraftd.engine.model.families reads (its biases, head norms, norms on
attention's and the MLP's outputs, GELU gate, sliding windows, soft cap and rotary tables
are entries of a layer's row or arguments of the calls).

Contract: each call makes a fixed sequence of the products (kvgraftd.engine.model.linear),
bias adds and row-wise operations (.rowwise), each row-invariant, and of each context's
own K/V write and `attend_live_step`, whose bits a step of one context through the
context's own path has too (tests/engine/test_native_forward.py); the interpreter's time
is paid once a layer for all of a step's contexts, or, for a step of decode rows over
live positions only (the common step), once a step.

* `Layers.of(layers, final_norm, shape, family)`: the packed weights, biases, norms,
  windows and scalings of every layer as the native calls take them (addresses in one
  table), built once at load.
* `Layers.qkv(layer, normed, tables)`: the q, k and v product (with its bias and head
  norms), the queries' and keys' heads rotated by the layer's table: [rows, n].
* `Layers.mlp(layer, attended, hidden)`: out product (its bias and norm), residual add and
  norm, gated MLP (SiLU or GELU-tanh, biases, its norm), residual add, the next norm: the
  next layer's input [rows, dim] (hidden in place).
* `LiveRows`: the step's decoding contexts whose KV is all live on CPU, attended in one
  call a layer (`attend`), or, when they are all of the step's rows, computed through
  every layer in one call (`Layers.decode`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from kvgraftd.engine.model import decode_attention, kernel_libraries, linear

_I64, _I32, _P, _F = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_float
# the tensors of a layer's row of the table besides its products (layer.c's column names)
TENSORS = (
    "qkv_bias", "q_norm", "k_norm", "out_bias", "attention_out_norm", "gate_up_bias",
    "down_bias", "mlp_out_norm",
)  # fmt: skip


def _load() -> tuple[ctypes.CDLL, ctypes.CDLL, int] | None:
    products, attend = linear.native_library(), decode_attention.native_library()
    if products is None or attend is None:
        return None
    products.kvg_layer_qkv.argtypes = [_P, _P, _I64, _I64, _I64, _P, _P, _I64, _I64, _I64, _F]
    products.kvg_layer_qkv.argtypes += [_P, ctypes.c_int]
    products.kvg_layer_qkv.restype = ctypes.c_int
    products.kvg_layer_mlp.argtypes = [_P, _I64, _I64, _P, _I64, _P, _I64, _F, ctypes.c_int]
    products.kvg_layer_mlp.argtypes += [_P, ctypes.c_int]
    products.kvg_layer_mlp.restype = ctypes.c_int
    products.kvg_decode_layers.argtypes = [_P, _I32, _P, _P, _F, _F, _P, _P, _P, _P, _P, _P]
    products.kvg_decode_layers.restype = ctypes.c_int
    attend.kvg_decode_live_rows.argtypes = [_I32] * 3 + [_P, _I64] + [_I32] * 3 + [_P] * 5
    attend.kvg_decode_live_rows.argtypes += [_I64, _F, _I64, _F, _P, _I64, _I32, _I32]
    attend.kvg_decode_live_rows.restype = ctypes.c_int
    # kvg_decode_layers calls the attention library's step by address
    return products, attend, ctypes.cast(attend.kvg_decode_live_rows, _P).value


_libraries = _load()
# a layer row's columns and the activations' numbers: layer.c's, read from the library
_columns = kernel_libraries.constants(_libraries[0], "kvg_layer_constants") if _libraries else {}


def available() -> bool:
    return _libraries is not None


def _check(status: int, what: str) -> None:
    if status < 0:
        # -1: memory ran out, or a product or a part of the step failed (kvg_parallel)
        raise MemoryError(f"the native {what} failed: out of memory, or a part of it refused")
    if status:
        raise RuntimeError(f"the native {what} refused its arguments ({status})")


class LiveRows:
    """The step's decoding contexts attended in one call a layer: row `rows[i]` of the pass
    is context i's one token, at position `positions[i]` of its live buffers."""

    def __init__(self, contexts: Sequence, rows: Sequence[int], layers: int, block: int) -> None:
        buffers = [context.live_buffers() for context in contexts]
        self.count, self.layers = len(rows), layers
        # kept alive: `arguments` holds their addresses
        self._arrays = [
            np.concatenate([keys for keys, _, _ in buffers]).astype(np.int64),
            np.concatenate([values for _, values, _ in buffers]).astype(np.int64),
            np.array([stride for _, _, stride in buffers], dtype=np.int64),
            np.array([c.length for c in contexts], dtype=np.int64),
            np.array(rows, dtype=np.int64),
        ]
        self.addresses = [array.ctypes.data for array in self._arrays]
        self.block = block
        # kvg_decode_layers' rows_of: the addresses above, then the block
        self.arguments = np.array([*self.addresses, block], dtype=np.int64)

    def attend(
        self, layer: int, qkv: torch.Tensor, out: torch.Tensor, geometry: tuple[int, int, int],
        scaling: float, window: int = 0, softcap: float = 0.0,
    ) -> None:  # fmt: skip
        """Write each context's K, V of `layer` (from its row of qkv) and attend (over its
        sliding `window` where it has one, scores soft-capped at `softcap`): its output row
        of `out` [rows, heads * D]."""
        kv_heads, group, dim = geometry
        status = _libraries[1].kvg_decode_live_rows(
            self.count, layer, self.layers, qkv.data_ptr(), qkv.shape[1], kv_heads, group, dim,
            *self.addresses, self.block, scaling, window, softcap, out.data_ptr(), out.shape[1],
            0, kv_heads,
        )  # fmt: skip
        _check(status, "decode attention")


class Layers:
    """Every layer's weights, norms and scaling as the native calls take them."""

    def __init__(self, table: np.ndarray, scalings: np.ndarray, keep: list, shape: dict) -> None:
        self.table, self.scalings, self._keep = table, scalings, keep
        self.heads, self.kv_heads, self.head_dim = shape["heads"], shape["kv_heads"], shape["dim"]
        self.inter, self.qkv_n, self.eps = shape["inter"], shape["qkv_n"], shape["eps"]
        self.activation, self.softcap = shape["activation"], shape["softcap"]
        self._row_bytes = table.shape[1] * table.itemsize

    @classmethod
    def of(cls, layers: Sequence, final_norm: torch.Tensor, shape: dict, family) -> Layers:
        """`layers`: packed_layers.PackedLayer each; `shape`: heads, kv_heads, dim (a head's),
        inter, qkv_n, eps; `family`: families.Family (its activation, windows, soft cap and
        rotary tables, which `qkv` and `decode` take in the order of its rope_tables)."""
        column, keep = _columns, [final_norm]
        table = np.zeros((len(layers), column["LAYER_ENTRIES"]), dtype=np.int64)  # 0: none
        kinds = list(family.rope_tables)
        for index, (layer, row) in enumerate(zip(layers, table, strict=True)):
            after = layers[index + 1].input_norm if index + 1 < len(layers) else final_norm
            for name in ("qkv", "out", "gate_up", "down"):  # (format, address) each
                weight, at = getattr(layer, name), column[name.upper()]
                row[at], row[at + 1] = weight.code, weight.address
                keep.append(weight)
            tensors = {name: getattr(layer, name) for name in TENSORS}
            tensors.update(post_norm=layer.post_norm, next_norm=after)
            for name, tensor in tensors.items():
                if tensor is not None:
                    row[column[name.upper()]] = tensor.data_ptr()
                    keep.append(tensor)
            row[column["WINDOW"]] = family.windows[index]
            row[column["ROPE_TABLE"]] = kinds.index(family.rope_types[index])
        scalings = np.array([layer.scaling for layer in layers], dtype=np.float32)
        activation = column[f"ACTIVATION_{family.activation.upper()}"]
        shape = {**shape, "activation": activation, "softcap": family.attention_softcap}
        return cls(table, scalings, keep, shape)

    def window(self, layer: int) -> int:
        return int(self.table[layer, _columns["WINDOW"]])

    def qkv(self, layer: int, normed: torch.Tensor, tables: Sequence) -> torch.Tensor:
        """normed [rows, dim] times the layer's q, k, v weights (its bias and head norms too),
        q's and k's heads rotated by its table (of `tables`, rowwise.RopeTable each)."""
        rows, dim = normed.shape
        out = torch.empty(rows, self.qkv_n, dtype=torch.float32)
        rope = tables[int(self.table[layer, _columns["ROPE_TABLE"]])]
        status = _libraries[0].kvg_layer_qkv(
            self.table.ctypes.data + layer * self._row_bytes, normed.data_ptr(), rows, dim,
            self.qkv_n, rope.cos.data_ptr(), rope.sin.data_ptr(), self.heads, self.kv_heads,
            self.head_dim, self.eps, out.data_ptr(), linear.THREADS,
        )  # fmt: skip
        _check(status, "q, k, v product")
        return out

    def mlp(self, layer: int, attended: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Attention's output [rows, width] into the residual stream `hidden` [rows, dim] (in
        place) and through the MLP; returns the next layer's normed input [rows, dim]."""
        rows, dim = hidden.shape
        normed = torch.empty(rows, dim, dtype=torch.float32)
        entries = self.table.ctypes.data + layer * self._row_bytes
        status = _libraries[0].kvg_layer_mlp(
            attended.data_ptr(), rows, attended.shape[1], hidden.data_ptr(), dim, entries,
            self.inter, self.eps, self.activation, normed.data_ptr(), linear.THREADS,
        )  # fmt: skip
        _check(status, "MLP")
        return normed

    def decode(
        self, live: LiveRows, hidden: torch.Tensor, normed: torch.Tensor, tables: Sequence
    ) -> torch.Tensor:
        """Every layer of a step whose rows are all `live`'s: from layer 0's normed input to
        the final norm's output [rows, dim] (both in place, in `hidden` and `normed`)."""
        rows, dim = hidden.shape
        shape = np.array(
            [rows, dim, self.heads, self.kv_heads, self.head_dim, self.inter, self.qkv_n,
             linear.THREADS, self.activation],
            dtype=np.int64,
        )  # fmt: skip
        cos = np.array([table.cos.data_ptr() for table in tables], dtype=np.int64)
        sin = np.array([table.sin.data_ptr() for table in tables], dtype=np.int64)
        status = _libraries[0].kvg_decode_layers(
            shape.ctypes.data, len(self.table), self.table.ctypes.data, self.scalings.ctypes.data,
            self.eps, self.softcap, hidden.data_ptr(), normed.data_ptr(), cos.ctypes.data,
            sin.ctypes.data, _libraries[2], live.arguments.ctypes.data,
        )  # fmt: skip
        _check(status, "decode step")
        return normed
