"""The row-invariant linear kernel (kvgraftd.engine.model.linear): every build, every blocking and
thread count gives the bits of the scalar fmaf reference, row by row."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from kvgraftd.engine.model import linear
from kvgraftd.engine.model.linear import PackedWeight
from tests.support import native_kernels

if not linear.available():
    native_kernels.missing("the native linear kernel is not built")

SHAPES = 24  # random shapes per build


def random_shape(rng: random.Random) -> tuple[int, int, int]:
    """Rows 1-300; k and n mostly not multiples of the vector width."""
    return rng.randint(1, 300), rng.randint(1, 200), rng.randint(1, 150)


@pytest.mark.parametrize("build", ["generic", "avx2", "avx512"])
def test_every_build_gives_the_reference_bits(build: str, rng: random.Random) -> None:
    if build not in linear.builds():
        pytest.skip(f"this CPU does not run the {build} build")
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for _ in range(SHAPES):
        m, k, n = random_shape(rng)
        x = torch.randn(m, k, generator=generator)
        weight = torch.randn(n, k, generator=generator)
        packed = PackedWeight.of(weight)
        expected = linear.reference(x, weight)
        for threads in (1, 2):
            got = linear.linear(x, packed, threads=threads, build=build)
            assert torch.equal(got, expected), (build, m, k, n, threads)
        assert torch.allclose(expected, x @ weight.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("products", ["fp32", "int8-dot"])
def test_a_row_has_the_same_bits_in_any_batch(products: str, rng: random.Random) -> None:
    """Row i computed alone, or among 1-300 other rows, at any offset: the same bytes (the
    float products over float32 panels, the integer ones over Q4_1 blocks)."""
    k, n = 576, 1536 + 7
    generator = torch.Generator().manual_seed(7)
    if products == "fp32":
        packed = PackedWeight.of(torch.randn(n, k, generator=generator))
    else:
        packed = integer_weight("q4_1", n, k, np.random.default_rng(9))
    rows = torch.randn(300, k, generator=generator)
    alone = torch.cat([linear.linear(rows[i : i + 1], packed) for i in range(rows.shape[0])])
    for _ in range(12):
        lo = rng.randrange(rows.shape[0])
        hi = rng.randint(lo + 1, rows.shape[0])
        batched = linear.linear(rows[lo:hi], packed, threads=rng.choice([1, 2]))
        assert torch.equal(batched, alone[lo:hi]), (lo, hi)


def test_nan_and_inf_propagate_as_in_the_reference(rng: random.Random) -> None:
    generator = torch.Generator().manual_seed(3)
    m, k, n = 13, 37, 45
    x = torch.randn(m, k, generator=generator)
    weight = torch.randn(n, k, generator=generator)
    x[2, 5] = math.nan
    x[4, 0] = math.inf
    x[4, 1] = -math.inf  # inf - inf: NaN
    x[7, 3] = math.inf
    weight[9, 11] = -math.inf
    weight[10, 0] = 0.0  # 0 * inf: NaN in row 4
    expected = linear.reference(x, weight)
    assert expected.isnan().any() and expected.isinf().any()
    for build in linear.builds():
        got = linear.linear(x, PackedWeight.of(weight), build=build)
        same_nan = torch.equal(got.isnan(), expected.isnan())
        finite = ~expected.isnan()
        assert same_nan and torch.equal(got[finite], expected[finite]), build


def test_shapes_are_checked() -> None:
    packed = PackedWeight.of(torch.ones(4, 8))
    with pytest.raises(ValueError, match="takes 8"):
        linear.linear(torch.ones(2, 7), packed)
    assert linear.linear(torch.ones(0, 8), packed).shape == (0, 4)
    empty = PackedWeight.of(torch.ones(4, 0))  # k = 0: an empty sum, +0.0 on every build
    for build in linear.builds():
        got = linear.linear(torch.ones(3, 0), empty, build=build)
        assert got.numpy().tobytes() == bytes(3 * 4 * 4), build
    assert linear.linear(torch.ones(2, 3, 8), packed).shape == (2, 3, 4)


FOLLOWING_PRODUCTS = """
import torch
from kvgraftd.engine.model import linear
from kvgraftd.engine.model.linear import PackedWeight

generator = torch.Generator().manual_seed(11)
weights = [torch.randn(n, 64, generator=generator) for n in (16, 48, 80)]
packed = [PackedWeight.of(w) for w in weights]
x = torch.randn(5, 64, generator=generator)
expected = [linear.reference(x, w) for w in weights]
for round_index in range(300):
    which = round_index % 3
    got = linear.linear(x, packed[which], threads=2 + round_index % 3)
    assert torch.equal(got, expected[which]), round_index
"""


def test_products_of_any_thread_count_follow_each_other_safely() -> None:
    """Products handed to fewer threads than the library has workers, back to back: every
    one complete and right (regression: a worker without a part was not waited for, and
    could read the next product's description half-written). In a process of its own: the
    workers it starts (up to 3, more than this machine's cores may be) wake for every later
    product of their process, and would slow the rest of the suite's products tenfold."""
    run = subprocess.run(
        [sys.executable, "-c", FOLLOWING_PRODUCTS], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr


def gguf_blocks(format: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random rows of GGUF blocks as a GGUF file stores them (uint8 [rows, bytes]): scales
    are random normal float16s (a few subnormal, zero and negative), weights any value."""
    blocks = k // linear.QK
    scales = rng.standard_normal((rows, blocks, 2)).astype(np.float16)
    scales[0, 0, 0] = np.float16(3e-7)  # subnormal
    scales[-1, -1, :] = np.float16(0.0)
    if format == "q4_1":
        quants = rng.integers(0, 256, (rows, blocks, 16), dtype=np.uint8)
        body = np.concatenate([scales.view(np.uint8).reshape(rows, blocks, 4), quants], axis=2)
    else:
        quants = rng.integers(-128, 128, (rows, blocks, 32), dtype=np.int8).view(np.uint8)
        body = np.concatenate([scales[..., :1].view(np.uint8).reshape(rows, blocks, 2), quants], 2)
    return np.ascontiguousarray(body.reshape(rows, -1))


@pytest.mark.parametrize("format", ["q4_1", "q8_0"])
def test_gguf_blocks_stand_for_gguf_pys_weights_and_multiply_as_them(
    format: str, rng: random.Random
) -> None:
    """Packed GGUF blocks unpack to exactly the float32 weights gguf-py (so transformers)
    dequantizes, rows in the order asked; every build, thread count and number of rows
    multiplies by them with the bits of the reference over those floats."""
    numbers = np.random.default_rng(rng.randrange(1 << 30))
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for rows, n, k in ((1, 37, 64), (7, 16, 96), (150, 61, 32), (300, 33, 320)):
        blocks = gguf_blocks(format, n + 5, k, numbers)
        order = numbers.permutation(n + 5)[:n]
        packed = PackedWeight.of_gguf(format, blocks, order, k)
        dequantized = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[format.upper()])
        weight = torch.from_numpy(np.ascontiguousarray(dequantized.reshape(n + 5, k)[order]))
        assert torch.equal(packed.unpacked(), weight), (format, n, k)
        x = torch.randn(rows, k, generator=generator)
        expected = linear.reference(x, weight)
        for build in linear.builds():
            for threads in (1, 2):
                got = linear.linear(x, packed, threads=threads, build=build)
                assert torch.equal(got, expected), (format, rows, n, k, build, threads)


def test_gguf_blocks_are_checked_before_packing() -> None:
    blocks = np.zeros((4, 20), np.uint8)
    with pytest.raises(ValueError, match="rows of 48"):
        PackedWeight.of_gguf("q4_1", blocks, [0, 1], 48)
    with pytest.raises(ValueError, match="not in the blocks"):
        PackedWeight.of_gguf("q4_1", blocks, [0, 4], 32)
    with pytest.raises(ValueError, match="no packing for q5_0"):
        PackedWeight.of_gguf("q5_0", blocks, [0], 32)
    # rows narrower than k says (regression: packing read past the rows' end)
    with pytest.raises(ValueError, match="rows of 64 weights are 40 bytes"):
        PackedWeight.of_gguf("q4_1", blocks, [0, 1], 64)


# ---- the integer products (int8-dot): native/linear/linear_int8.c ----


def quantized_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """linear_int8.c's rule in numpy (float32 arithmetic, each operation rounded once)."""
    m, k = x.shape
    blocks = x.reshape(m, k // linear.QK, linear.QK).astype(np.float32)
    q = np.zeros(blocks.shape, np.int8)
    d = np.zeros(blocks.shape[:2], np.float32)
    s = np.zeros(blocks.shape[:2], np.float32)
    for row in range(m):
        for b in range(blocks.shape[1]):
            values = blocks[row, b]
            if not np.isfinite(values).all():
                d[row, b] = s[row, b] = np.nan
                continue
            amax = np.abs(values).max()
            if amax < np.float32(2.0**-64):
                continue
            inv = np.float32(127) / amax
            q[row, b] = np.rint(values * inv).astype(np.int8)  # ties to even
            d[row, b] = amax / np.float32(127)
            s[row, b] = d[row, b] * np.float32(q[row, b].astype(np.int32).sum())
    return q.reshape(m, k), d, s


def test_activations_are_quantized_by_the_written_rule() -> None:
    """Every build quantizes as the rule says, zero, tiny, tie and non-finite blocks too."""
    generator = torch.Generator().manual_seed(17)
    x = torch.randn(9, 8 * linear.QK, generator=generator) * 3
    x[0, :32] = 0.0  # a zero block
    x[1, 32:64] = 2.0**-70  # below 2^-64: zero
    x[2, 64:96] = torch.arange(32) - 15.5  # a block of half-integers
    x[3, 0:32] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5] + [0.0] * 26)  # ties to even
    x[4, 40] = math.nan
    x[5, 100] = math.inf
    x[6, 200] = -math.inf
    x[7, 255] = 1e30  # huge, finite
    q_ref, d_ref, s_ref = quantized_reference(x.numpy())
    assert list(q_ref[3, :6]) == [127, 0, 2, 2, 0, -2]
    for build in linear.builds():
        q, d, s = linear.quantize(x, build)
        assert np.array_equal(q.numpy(), q_ref), build
        for got, expected in ((d, d_ref), (s, s_ref)):
            assert np.array_equal(got.numpy(), expected, equal_nan=True), build
        assert int(q.abs().max()) <= 127
    with pytest.raises(ValueError, match="blocks of 32"):
        linear.quantize(torch.ones(2, 40))


def integer_weight(format: str, n: int, k: int, numbers: np.random.Generator) -> PackedWeight:
    blocks = gguf_blocks(format, n, k, numbers)
    return PackedWeight.of_gguf(format, blocks, numbers.permutation(n), k, integer=True)


@pytest.mark.parametrize("format", ["q4_1", "q8_0"])
def test_every_build_of_the_integer_products_gives_the_portable_bits(
    format: str, rng: random.Random
) -> None:
    """Rows 1-300, n not a multiple of the vector width, 1 and 2 threads: every build's bits
    are the portable build's, row by row; and they stay near the float products'."""
    numbers = np.random.default_rng(rng.randrange(1 << 30))
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for _ in range(SHAPES // 2):
        m, n, k = rng.randint(1, 300), rng.randint(1, 150), linear.QK * rng.randint(1, 12)
        packed = integer_weight(format, n, k, numbers)
        x = torch.randn(m, k, generator=generator)
        expected = linear.linear(x, packed, threads=1, build="generic")
        for build in linear.builds():
            for threads in (1, 2):
                got = linear.linear(x, packed, threads=threads, build=build)
                assert torch.equal(got, expected), (format, m, n, k, build, threads)
        exact = x @ packed.unpacked().T
        error = ((expected - exact).norm() / exact.norm()).item()
        assert error < 0.03, (format, m, n, k, error)  # 8-bit activations: ~0.5% here


def test_the_integer_products_are_the_written_sums(rng: random.Random) -> None:
    """Weights d = 1, m = 0 and activations whose blocks span [-127, 127] quantize to
    themselves: every output is then exactly the integer sum of products."""
    numbers = np.random.default_rng(5)
    n, k = 21, 4 * linear.QK
    for format in ("q4_1", "q8_0"):
        blocks = gguf_blocks(format, n, k, numbers).reshape(n, k // linear.QK, -1)
        blocks[:, :, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)  # d = 1
        if format == "q4_1":
            blocks[:, :, 2:4] = 0  # m = 0
        blocks = np.ascontiguousarray(blocks.reshape(n, -1))
        packed = PackedWeight.of_gguf(format, blocks, np.arange(n), k, integer=True)
        x = numbers.integers(-126, 127, (7, k)).astype(np.float32)
        x[:, :: linear.QK] = 127  # every block's largest magnitude: 127, so d = 1
        weights = packed.unpacked().numpy().astype(np.int64)
        expected = x.astype(np.int64) @ weights.T
        for build in linear.builds():
            got = linear.linear(torch.from_numpy(x), packed, build=build)
            assert np.array_equal(got.numpy(), expected.astype(np.float32)), (format, build)


def test_non_finite_activations_poison_their_rows_as_in_the_portable_build() -> None:
    numbers = np.random.default_rng(4)
    packed = integer_weight("q4_1", 40, 96, numbers)
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(4))
    x[1, 3], x[2, 50], x[3, 95] = math.nan, math.inf, -math.inf
    expected = linear.linear(x, packed, build="generic")
    assert expected[1:4].isnan().all() and not expected[[0, 4, 5]].isnan().any()
    for build in linear.builds():
        got = linear.linear(x, packed, build=build)
        assert torch.equal(got.isnan(), expected.isnan()), build
        finite = ~expected.isnan()
        assert torch.equal(got[finite], expected[finite]), build
