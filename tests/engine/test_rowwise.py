"""The forward's row-wise operations (kvgraftd.engine.model.rowwise): the rotary table's cos
and sin are the kernel's own (no C library's), within a rounding of the true values."""

from __future__ import annotations

import numpy as np
import pytest
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


def _exp_neg_reference(x: np.ndarray) -> np.ndarray:
    """rowwise.c's exp_neg8 (x <= 0), operation by operation in numpy float32."""
    f = np.float32
    x = np.where(x < f(-87), f(-87), x)
    shifter = f(12582912.0)
    n = (x * f(1.44269504088896341) + shifter) - shifter
    r = x - n * f(0.693359375)
    r = r - n * f(-2.12194440e-4)
    p = np.full_like(r, f(1.9875691500e-4))
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + f(c)
    p = p * (r * r) + r + f(1.0)
    return p * ((n.astype(np.int32) + 127) << 23).view(f)


def _silu_mul_reference(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """rowwise.c's silu(g) * u, operation by operation in numpy float32 (each rounded once)."""
    f = np.float32
    g = gate.astype(f)
    e = _exp_neg_reference(np.where(g < 0, g, -g))
    sigmoid = np.where(g < 0, e, f(1.0)) / (f(1.0) + e)
    return g * sigmoid * up.astype(f)


def _tanh_reference(y: np.ndarray) -> np.ndarray:
    f = np.float32
    e = _exp_neg_reference(f(-2.0) * np.abs(y))
    return np.copysign((f(1.0) - e) / (f(1.0) + e), y)


def _gelu_tanh_mul_reference(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    f = np.float32
    g = gate.astype(f)
    inner = f(0.7978845608028654) * (g + f(0.044715) * ((g * g) * g))
    return ((f(0.5) * g) * (f(1.0) + _tanh_reference(inner))) * up.astype(f)


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


def test_the_gelu_gate_and_the_soft_cap_are_their_written_arithmetic_in_every_lane() -> None:
    """kvg_gelu_tanh_mul (Gemma's gate) and kvg_softcap (Gemma 2's logits) against the same
    operations in numpy float32, bit for bit, tails and specials included; and against
    torch's own GELU (tanh) and tanh in float64, to within their float32 rounding."""
    generator = torch.Generator().manual_seed(4)
    gate_up = torch.randn(200, 2 * 1539, generator=generator) * 4
    specials = [0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 1e30, -1e30]
    gate_up[0, : len(specials) + 2] = torch.tensor([*specials, float("inf"), -float("inf")])
    gate, up = gate_up[:, :1539].numpy(), gate_up[:, 1539:].numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        expected = _gelu_tanh_mul_reference(gate, up)
    out = rowwise.gelu_tanh_mul(gate_up, 1539)
    assert out.numpy().tobytes() == expected.tobytes()
    finite = gate_up[1:].double()
    exact = torch.nn.functional.gelu(finite[:, :1539], approximate="tanh") * finite[:, 1539:]
    assert (out[1:].double() - exact).abs().max().item() < 1e-5
    logits = torch.randn(3, 1001, generator=generator) * 40
    capped = logits.clone()
    rowwise.softcap_(capped, 30.0)
    f = np.float32
    with np.errstate(over="ignore"):
        expected = _tanh_reference(logits.numpy() / f(30.0)) * f(30.0)
    assert capped.numpy().tobytes() == expected.tobytes()
    assert (capped.double() - torch.tanh(logits.double() / 30) * 30).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="a soft cap is a positive number"):
        rowwise.softcap_(capped, 0.0)
