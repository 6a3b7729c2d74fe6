"""GGUF's tensor types, read as the file stores them: every block format's weights as float32.

Contract: `TYPES` names each type the native library reads (GGUF's numbers: "q4_k": 12,
...); `block_size(type)` is one block's (weights, bytes); `dequantize(type, raw, weights)`
is `weights` float32 values from the bytes `raw` of whole blocks, each weight computed as
gguf-py's `gguf.quants.dequantize` computes it (native/linear/gguf_blocks.c; held to it bit
for bit by tests/engine/test_gguf_blocks.py). A type the library does not read, or bytes
that are not whole blocks of it, raise ValueError naming them; where the library is not
built, `TYPES` is empty.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kvgraftd.engine.model import linear

TYPES: dict[str, int] = dict(linear.GGUF_TYPES)
_NAMES = {number: name for name, number in TYPES.items()}


def block_size(gguf_type: int) -> tuple[int, int]:
    """(weights, bytes) of one block of `gguf_type`."""
    library = _library()
    weights, size = ctypes.c_int64(), ctypes.c_int64()
    library.kvg_gguf_block_size(gguf_type, ctypes.byref(weights), ctypes.byref(size))
    if gguf_type not in _NAMES or not size.value:
        raise ValueError(
            f"GGUF tensor type {gguf_type} is not one kvgraft reads; it reads "
            f"{', '.join(name.upper() for name in TYPES)}"
        )
    return weights.value, size.value


def dequantize(gguf_type: int, raw: np.ndarray, weights: int) -> np.ndarray:
    """`weights` float32 weights from `raw` (uint8, C-contiguous): whole blocks of the type."""
    per_block, size = block_size(gguf_type)
    blocks, rest = divmod(weights, per_block)
    if rest or raw.dtype != np.uint8 or raw.size != blocks * size:
        raise ValueError(
            f"{weights} weights of {_NAMES[gguf_type].upper()} are {blocks} blocks of {size} "
            f"bytes ({per_block} weights each); got {raw.size} bytes of {raw.dtype}"
        )
    source = np.ascontiguousarray(raw)
    out = np.empty(weights, np.float32)
    done = _library().kvg_gguf_dequantize(gguf_type, source.ctypes.data, blocks, out.ctypes.data)
    assert done == 0, done  # the type was checked above
    return out


def _library() -> ctypes.CDLL:
    library = linear.native_library()
    if library is None:
        raise ValueError("the native linear library is not built: GGUF blocks cannot be read")
    return library
