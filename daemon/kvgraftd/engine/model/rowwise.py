"""The row-invariant forward's row-wise operations: engine/native/linear/rowwise.c.

Contract: each output row is computed from its own input row by one fixed sequence
of float operations (rowwise.c states it), so its bits depend on that row alone, not
on how many rows share the call: what the row-invariant forward needs of everything
between its products (torch's own ops give that only on one thread, and each costs
microseconds of dispatch a decode step pays 40 times a layer).

* `add_rmsnorm(hidden, delta, weight, eps)`: hidden += delta (in place; delta may be
  None), then the RMS norm of each row times `weight`, as a new tensor.
* `RopeTable.of(positions, inv_freq, scaling)`: the cos and sin of each row's angles;
  `rope_(x, table, heads, dim)` rotates the first `heads` heads of each row of x in place.
* `silu_mul(gate_up, width)`: SiLU of each row's first `width` values times the next `width`;
  `gelu_tanh_mul(gate_up, width)` the same with GELU's tanh form (Gemma's).
* `softcap_(x, cap)`: tanh(x / cap) * cap of every value, in place (Gemma 2's logits).

All take float32 CPU tensors, rows contiguous; shapes are checked. Loaded from the
linear kernel's library (`kvgraftd.engine.model._linear`); `available()` says whether it was built.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvgraftd.engine.model import linear

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def _load():
    library = linear.native_library()
    if library is None:
        return None
    library.kvg_add_rmsnorm.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float, _PTR]
    library.kvg_rope_table.argtypes = [_PTR, _I64, _PTR, _I64, ctypes.c_float, _PTR, _PTR]
    library.kvg_rope.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR]
    library.kvg_silu_mul.argtypes = [_PTR, _I64, _I64, _PTR]
    library.kvg_gelu_tanh_mul.argtypes = [_PTR, _I64, _I64, _PTR]
    library.kvg_softcap.argtypes = [_PTR, _I64, ctypes.c_float]
    functions = ("kvg_add_rmsnorm", "kvg_rope_table", "kvg_rope", "kvg_silu_mul")
    for function in (*functions, "kvg_gelu_tanh_mul", "kvg_softcap"):
        getattr(library, function).restype = None
    return library


_library = _load()


def available() -> bool:
    return _library is not None


def _rows(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or tensor.dim() != 2:
        raise ValueError(
            f"{name} must be a float32 CPU matrix, not {tensor.dtype} {tuple(tensor.shape)}"
        )
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return tensor


def add_rmsnorm(
    hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """hidden += delta (in place), then each row's RMS norm times weight: [rows, dim]."""
    rows, dim = _rows(hidden, "hidden").shape
    if delta is not None and _rows(delta, "delta").shape != hidden.shape:
        raise ValueError(f"delta is {tuple(delta.shape)}; hidden is {tuple(hidden.shape)}")
    weight = weight.detach().to(torch.float32).contiguous()
    if weight.shape != (dim,):
        raise ValueError(f"the norm's weight is {tuple(weight.shape)}; rows have {dim} values")
    out = torch.empty_like(hidden)
    _library.kvg_add_rmsnorm(
        hidden.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
        rows, dim, eps, out.data_ptr(),
    )  # fmt: skip
    return out


@dataclass(frozen=True)
class RopeTable:
    """cos and sin [rows, dim / 2] of each row's position."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def of(cls, positions: list[int], inv_freq: torch.Tensor, scaling: float) -> RopeTable:
        inv_freq = inv_freq.detach().to(torch.float32).contiguous()
        at = torch.tensor(positions, dtype=torch.int64)
        cos = torch.empty(len(positions), inv_freq.numel(), dtype=torch.float32)
        sin = torch.empty_like(cos)
        _library.kvg_rope_table(
            at.data_ptr(), len(positions), inv_freq.data_ptr(), inv_freq.numel(), scaling,
            cos.data_ptr(), sin.data_ptr(),
        )  # fmt: skip
        return cls(cos, sin)


def rope_(x: torch.Tensor, table: RopeTable, heads: int, dim: int) -> None:
    """Rotate the first `heads` heads (of `dim` values) of each row of x in place."""
    rows, width = _rows(x, "x").shape
    if heads * dim > width or table.cos.shape != (rows, dim // 2) or dim % 2:
        raise ValueError(f"{heads} heads of {dim} do not fit rows of {width} and the table")
    _library.kvg_rope(
        x.data_ptr(), rows, width, heads, dim, table.cos.data_ptr(), table.sin.data_ptr()
    )


def silu_mul(gate_up: torch.Tensor, width: int) -> torch.Tensor:
    """SiLU(gate) * up of rows [gate (width values) | up (width values)]: [rows, width]."""
    return _gated(_library.kvg_silu_mul, gate_up, width)


def gelu_tanh_mul(gate_up: torch.Tensor, width: int) -> torch.Tensor:
    """GELU(gate) (its tanh form) * up of rows [gate | up]: [rows, width]."""
    return _gated(_library.kvg_gelu_tanh_mul, gate_up, width)


def _gated(function, gate_up: torch.Tensor, width: int) -> torch.Tensor:
    rows, double = _rows(gate_up, "gate_up").shape
    if double != 2 * width:
        raise ValueError(f"rows of {double} values are not a gate and an up of {width}")
    out = torch.empty(rows, width, dtype=torch.float32)
    function(gate_up.data_ptr(), rows, width, out.data_ptr())
    return out


def softcap_(x: torch.Tensor, cap: float) -> None:
    """x = tanh(x / cap) * cap, every value, in place."""
    rows, width = _rows(x, "x").shape
    if not cap > 0:
        raise ValueError(f"a soft cap is a positive number, not {cap}")
    _library.kvg_softcap(x.data_ptr(), rows * width, cap)
