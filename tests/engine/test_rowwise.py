"""The forward's row-wise operations (kvgraftd.engine.model.rowwise): the rotary table's cos
and sin are the kernel's own (no C library's), within a rounding of the true values."""

from __future__ import annotations

import numpy as np
import torch

from kvgraftd.engine.model import rowwise
from tests.support import native_kernels

if not rowwise.available():
    native_kernels.missing("the native row-wise kernels are not built")


def _ulps(got: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """|got - exact| in units of float32's spacing at the exact value."""
    spacing = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    return np.abs(got.astype(np.float64) - exact) / spacing


def test_rotary_table_cos_and_sin_are_nearly_correctly_rounded() -> None:
    """Every position of a 128k context and some past ten million, each frequency of a
    64-wide head (base 10,000) and two of 1 and 0.5: cos and sin of the float32 angle
    against numpy's float64 values, at most 0.51 ulp off (a correctly rounded result
    is 0.5 off at most; measured 0.5009), and scaled by the table's factor."""
    positions = [*range(0, 131072, 3), 131071, 2**20 + 1, 2**22 + 3, 10_000_019]
    frequencies = 10000.0 ** (-np.arange(32) / 32)
    inv_freq = torch.tensor(np.concatenate([frequencies, [1.0, 0.5]]), dtype=torch.float32)
    table = rowwise.RopeTable.of(positions, inv_freq, 1.0)
    angles = inv_freq.numpy()[None, :] * np.array(positions, dtype=np.float32)[:, None]
    angles = angles.astype(np.float32).astype(np.float64)  # the kernel's float32 angle
    cos_ulps = _ulps(table.cos.numpy(), np.cos(angles))
    sin_ulps = _ulps(table.sin.numpy(), np.sin(angles))
    print(f"max error: cos {cos_ulps.max():.4f} ulp, sin {sin_ulps.max():.4f} ulp")
    assert cos_ulps.max() <= 0.51 and sin_ulps.max() <= 0.51
    scaled = rowwise.RopeTable.of(positions[:100], inv_freq, 0.75)
    assert torch.equal(scaled.cos, table.cos[:100] * 0.75)
    assert torch.equal(scaled.sin, table.sin[:100] * 0.75)
