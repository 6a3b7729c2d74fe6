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


def _silu_mul_reference(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """rowwise.c's silu(g) * u, operation by operation in numpy float32 (each rounded once)."""
    f = np.float32
    g = gate.astype(f)
    x = np.where(g < 0, g, -g)
    x = np.where(x < f(-87), f(-87), x)
    shifter = f(12582912.0)
    n = (x * f(1.44269504088896341) + shifter) - shifter
    r = x - n * f(0.693359375)
    r = r - n * f(-2.12194440e-4)
    p = np.full_like(r, f(1.9875691500e-4))
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + f(c)
    p = p * (r * r) + r + f(1.0)
    power = ((n.astype(np.int32) + 127) << 23).view(f)
    e = p * power
    sigmoid = np.where(g < 0, e, f(1.0)) / (f(1.0) + e)
    return g * sigmoid * up.astype(f)


def test_the_gated_activation_is_its_written_arithmetic_in_every_lane() -> None:
    """kvg_silu_mul (8 lanes at a time, the tail in lanes padded with zeros) against the
    same operations in numpy float32, bit for bit: 300 rows of 1,539 (not a multiple of 8),
    with zeros, signed zeros, tiny, huge and infinite gates; a NaN gate gives NaN."""
    generator = torch.Generator().manual_seed(3)
    gate_up = torch.randn(300, 2 * 1539, generator=generator) * 6
    specials = [0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, -100.0, 100.0, 1e30, -1e30]
    gate_up[0, : len(specials) + 2] = torch.tensor([*specials, float("inf"), -float("inf")])
    out = rowwise.silu_mul(gate_up, 1539)
    gate, up = gate_up[:, :1539].numpy(), gate_up[:, 1539:].numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        expected = _silu_mul_reference(gate, up)
    assert out.numpy().tobytes() == expected.tobytes()
    gate_up[1, 5] = float("nan")
    assert rowwise.silu_mul(gate_up, 1539)[1, 5].isnan()
