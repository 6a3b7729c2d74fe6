"""Every GGUF block format the engine reads, dequantized bit for bit as gguf-py does.

The oracle is gguf-py's `gguf.quants.dequantize` (llama.cpp's own Python package, an
implementation no one here wrote). Blocks are random bytes, their float16 scales any finite
half (subnormals, zeros and negatives included), so every bit of every field is exercised;
the native library's weights must equal gguf-py's as 32-bit patterns. Block sizes agree with
gguf-py's table, and a type the engine does not read is refused, naming the ones it does.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from kvgraftd.engine.model import gguf_blocks

pytestmark = pytest.mark.skipif(not gguf_blocks.TYPES, reason="native library not built")

# where each format keeps its float16 scales (byte offsets in a block)
HALVES = {
    "q4_0": [0], "iq4_nl": [0], "q5_0": [0], "q8_0": [0], "iq4_xs": [0],
    "q4_1": [0, 2], "q5_1": [0, 2], "q4_k": [0, 2], "q5_k": [0, 2],
    "q2_k": [80, 82], "q3_k": [108], "q6_k": [208],
}  # fmt: skip
BLOCKS = 64


def finite_halves(rng: np.random.Generator, count: int) -> np.ndarray:
    halves = rng.integers(0, 1 << 16, count, dtype=np.uint16)
    infinite = (halves & 0x7C00) == 0x7C00
    halves[infinite] &= 0xBFFF  # exponent 31 -> 15: a finite value
    return halves


def random_blocks(name: str, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    weights, size = gguf_blocks.block_size(gguf_blocks.TYPES[name])
    if name == "f32":
        data = rng.standard_normal(BLOCKS * 8, dtype=np.float32) * np.float32(1e3)
        return data.view(np.uint8).copy(), data.size
    if name in ("f16", "bf16"):
        halves = finite_halves(rng, BLOCKS * 8)
        if name == "bf16":  # a float's top half, from finite floats
            halves = rng.standard_normal(BLOCKS * 8).astype(np.float32).view(np.uint32) >> 16
            halves = halves.astype(np.uint16)
        return halves.view(np.uint8).copy(), halves.size
    raw = rng.integers(0, 256, (BLOCKS, size), dtype=np.uint8)
    for offset in HALVES[name]:
        raw[:, offset : offset + 2] = finite_halves(rng, BLOCKS).view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1), BLOCKS * weights


@pytest.mark.parametrize("name", [*sorted(HALVES), "f32", "f16", "bf16"])
def test_every_format_dequantizes_as_gguf_py_does(name: str) -> None:
    assert name in gguf_blocks.TYPES
    qtype = GGMLQuantizationType[name.upper()]
    assert gguf_blocks.block_size(qtype.value) == GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(sum(map(ord, name)))
    raw, weights = random_blocks(name, rng)
    ours = gguf_blocks.dequantize(qtype.value, raw, weights)
    theirs = np.asarray(gguf_dequantize(raw, qtype), np.float32).reshape(-1)
    assert ours.shape == theirs.shape == (weights,)
    assert np.count_nonzero(ours) > weights // 2 and np.isfinite(ours).all()  # real weights
    differ = np.flatnonzero(ours.view(np.uint32) != theirs.view(np.uint32))
    assert differ.size == 0, f"{name}: {differ.size} weights differ, first at {differ[0]}"


def test_a_type_not_read_or_a_partial_block_is_refused() -> None:
    with pytest.raises(ValueError, match=r"type 16 is not one kvgraft reads.*Q4_K"):
        gguf_blocks.block_size(GGMLQuantizationType.IQ2_XXS.value)
    q4_k = gguf_blocks.TYPES["q4_k"]
    with pytest.raises(ValueError, match="256 weights of Q4_K are 1 blocks of 144 bytes"):
        gguf_blocks.dequantize(q4_k, np.zeros(143, np.uint8), 256)
    with pytest.raises(ValueError, match="weights of Q4_K"):
        gguf_blocks.dequantize(q4_k, np.zeros(144, np.uint8), 200)
