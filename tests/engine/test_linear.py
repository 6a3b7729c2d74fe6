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


def test_a_row_has_the_same_bits_in_any_batch(rng: random.Random) -> None:
    """Row i computed alone, or among 1-300 other rows, at any offset: the same bytes."""
    k, n = 576, 1536 + 7
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(n, k, generator=generator)
    packed = PackedWeight.of(weight)
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
