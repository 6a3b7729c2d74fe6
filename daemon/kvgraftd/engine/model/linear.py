"""Row-invariant fp32 linear products: the native kernel of engine/native/linear/linear.c.

Contract: `linear(x, weight)` is torch's F.linear without bias (y = x W^T, x [M, K],
W [N, K], float32 on CPU), computed so that every output element is one
fused-multiply-add chain over k in ascending order. The bits of row m of y
therefore depend on row m of x and on W alone: not on M, not on the thread
count, not on the build the CPU runs (AVX-512, AVX2 + FMA, or the portable fmaf
loop), since FMA rounds once, correctly. That is what lets a position's bits not
depend on how a context was cut into forward passes, nor on which other rows
share the pass. torch's own CPU products change their summation with the number
of rows, which is why the engine kept one fixed schedule before.

`PackedWeight.of(W)` lays W out once (panels of 16 columns, k-major, as the
kernel streams it). `PackedWeight.of_gguf` keeps a GGUF file's quantized blocks
(Q4_1, Q8_0) instead, repacked per panel: the kernel dequantizes each weight in
a register with exactly the float arithmetic of the dequantized model, so the
product has the bits it would have over those float32 weights, from 6 (Q4_1)
or 9 (Q8_0) bits a weight instead of 32.

`PackedWeight.of_gguf(..., integer=True)` lays the same blocks out for the integer
products ("q4_1_i8", "q8_0_i8": native/linear/linear_int8.c): `linear` then quantizes
each row of x to 8 bits a block of 32 (`quantize` gives what it computes) and sums
integer dot products, with a float epilogue a block in ascending k. Another arithmetic,
with the same invariance: a row's bits depend on that row and W alone, on every build.

`linear` splits the panels, never k, between `threads`
(one per core by default): the calling thread (in a ctypes call, without the
GIL) and the library's own workers, which wait for the next product spinning
briefly, so a product of one row costs microseconds to hand out, not a
thread pool's round trip.
`available()` is False where the library was not built (no C compiler); the
engine then keeps torch's products on the fixed schedule. The constants below
(PANEL, QK, BUILDS, FORMATS and the blocks' sizes) are the library's own, read from
it when it loads (native/linear_formats.h is their one source): None, or empty,
where it is not built.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from kvgraftd.engine.model import kernel_libraries

THREADS = max(1, len(os.sched_getaffinity(0)))

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def _load() -> ctypes.CDLL | None:
    library = kernel_libraries.load("kvgraftd.engine.model._linear")
    if library is None:
        return None
    library.kvg_linear.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        _PTR,
        _I64,
        _I64,
        _I64,
        _PTR,
        _I64,
        _I64,
        _I64,
        _PTR,
        _I64,
    ]
    library.kvg_linear.restype = ctypes.c_int
    # build, format, x, M, K, ldx, packed, N, y, ldy, threads
    library.kvg_linear_parallel.argtypes = [ctypes.c_int, ctypes.c_int, _PTR, *[_I64] * 3, _PTR]
    library.kvg_linear_parallel.argtypes += [_I64, _PTR, _I64]
    library.kvg_linear_parallel.argtypes += [ctypes.c_int]
    library.kvg_linear_parallel.restype = ctypes.c_int
    library.kvg_linear_rest.argtypes, library.kvg_linear_rest.restype = [], None
    library.kvg_linear_pack.argtypes = [_PTR, _I64, _I64, _PTR]
    library.kvg_linear_pack.restype = None
    # format, blocks, row_bytes, order, N, K, packed
    library.kvg_quant_pack.argtypes = [ctypes.c_int, _PTR, _I64, _PTR, _I64, _I64, _PTR]
    library.kvg_quant_pack.restype = ctypes.c_int
    library.kvg_quant_unpack.argtypes = [ctypes.c_int, _PTR, _I64, _I64, _PTR]
    library.kvg_quant_unpack.restype = None
    library.kvg_quant_rows.argtypes = [ctypes.c_int, _PTR, _I64, _PTR, _I64, _PTR]
    library.kvg_quant_rows.restype = None
    # build, x, M, K, ldx, q, d, s
    library.kvg_quantize.argtypes = [ctypes.c_int, _PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR]
    library.kvg_quantize.restype = ctypes.c_int
    library.kvg_linear_reference.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _PTR]
    library.kvg_linear_reference.restype = None
    library.kvg_linear_name.argtypes = [ctypes.c_int]
    library.kvg_linear_name.restype = ctypes.c_char_p
    library.kvg_linear_builds.restype = ctypes.c_int
    # type, blocks, count, out (gguf_blocks.c); type, &weights, &bytes
    library.kvg_gguf_dequantize.argtypes = [ctypes.c_int, _PTR, _I64, _PTR]
    library.kvg_gguf_dequantize.restype = ctypes.c_int
    library.kvg_gguf_block_size.argtypes = [ctypes.c_int, _PTR, _PTR]
    library.kvg_gguf_block_size.restype = None
    return library


_library = _load()
_constants = kernel_libraries.constants(_library, "kvg_linear_constants") if _library else {}
PANEL = _constants.get("PANEL")  # columns per packed panel
QK = _constants.get("QK")  # weights per GGUF block, along k
BUILDS = kernel_libraries.named(_constants, "BUILD_")  # "best", "generic", "avx2", "avx512"
# "f32", "q4_1", "q8_0", and "q4_1_i8", "q8_0_i8": the same blocks for the integer products
FORMATS = kernel_libraries.named(_constants, "FORMAT_")
# bytes of a block of QK weights by format: in a GGUF file's row, and packed for 16 columns
GGUF_BLOCK_BYTES = kernel_libraries.named(_constants, "GGUF_BLOCK_BYTES_")
PACKED_BLOCK_BYTES = kernel_libraries.named(_constants, "PACKED_BLOCK_BYTES_")
# GGUF tensor types the library reads, by name ("q4_k": 12, ...): engine.model.gguf_blocks
GGUF_TYPES = kernel_libraries.named(_constants, "GGUF_TYPE_")


def available() -> bool:
    return _library is not None


def native_library() -> ctypes.CDLL | None:
    """The loaded library (kvgraftd.engine.model.rowwise takes its other functions from it)."""
    return _library


def rest() -> None:
    """The products' workers sleep until the next product instead of spinning for it (a
    step is done: its cores serve the request threads meanwhile)."""
    if _library is not None:
        _library.kvg_linear_rest()


def builds() -> list[str]:
    """The builds this CPU runs, by name."""
    if _library is None:
        return []
    mask = _library.kvg_linear_builds()
    return [name for name, value in BUILDS.items() if value and mask & (1 << value)]


def kernel_name() -> str:
    """The build `linear` runs here: "avx512", "avx2" or "generic"."""
    if _library is None:
        return "none"
    return _library.kvg_linear_name(BUILDS["best"]).decode()


@dataclass(frozen=True)
class PackedWeight:
    """W [N, K] in the kernel's panels: its format ("f32", or GGUF's "q4_1" / "q8_0"
    blocks), N, K and the packed bytes."""

    format: str
    n: int
    k: int
    data: torch.Tensor  # f32: ceil(N/16) * K * 16 floats; else uint8 (linear_formats.h)

    @property
    def integer(self) -> bool:
        """Whether its products are integer dot products (activations quantized to 8 bits)."""
        return self.format.endswith("_i8")

    @cached_property
    def panels(self) -> int:
        return -(-self.n // PANEL)

    @cached_property
    def code(self) -> int:
        """The format as the kernel names it."""
        return FORMATS[self.format]

    @cached_property
    def address(self) -> int:
        return self.data.data_ptr()

    @classmethod
    def of(cls, weight: torch.Tensor) -> PackedWeight:
        _require_library()
        weight = weight.detach().to(torch.float32).contiguous()
        n, k = weight.shape
        data = torch.empty(-(-n // PANEL) * k * PANEL, dtype=torch.float32)
        _library.kvg_linear_pack(weight.data_ptr(), n, k, data.data_ptr())
        return cls("f32", n, k, data)

    @classmethod
    def of_gguf(
        cls,
        format: str,
        blocks: np.ndarray,
        order: Sequence[int],
        k: int,
        integer: bool = False,
    ) -> PackedWeight:
        """Output column n from row order[n] of a GGUF tensor's raw blocks (uint8
        [rows, row bytes], as gguf.GGUFReader gives them), k weights a row; `integer`:
        laid out for the integer products (format "q4_1_i8", "q8_0_i8")."""
        _require_library()
        if format not in GGUF_BLOCK_BYTES or k % QK:
            raise ValueError(f"no packing for {format} rows of {k} weights")
        blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
        row_bytes = k // QK * GGUF_BLOCK_BYTES[format]
        if blocks.ndim != 2 or blocks.shape[1] != row_bytes:
            shape = tuple(blocks.shape)
            raise ValueError(f"{format} rows of {k} weights are {row_bytes} bytes: not {shape}")
        rows = np.ascontiguousarray(order, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= blocks.shape[0]):
            raise ValueError("a row of the order is not in the blocks")
        n = rows.size
        format = f"{format}_i8" if integer else format
        panel_bytes = k // QK * PACKED_BLOCK_BYTES[format]
        data = torch.empty(-(-n // PANEL) * panel_bytes, dtype=torch.uint8)
        status = _library.kvg_quant_pack(
            FORMATS[format], blocks.ctypes.data, blocks.shape[1], rows.ctypes.data, n, k,
            data.data_ptr(),
        )  # fmt: skip
        if status:
            raise ValueError(f"cannot pack {format} rows of {k} weights")
        return cls(format, n, k, data)

    def unpacked(self) -> torch.Tensor:
        """The float32 W [N, K] the kernel multiplies by (a GGUF block's weights dequantized
        as the kernel does it)."""
        if self.format == "f32":
            panels = self.data.view(self.panels, self.k, PANEL).transpose(1, 2)
            return panels.reshape(-1, self.k)[: self.n].contiguous()
        out = torch.empty(self.n, self.k, dtype=torch.float32)
        _library.kvg_quant_unpack(
            FORMATS[self.format], self.data.data_ptr(), self.n, self.k, out.data_ptr()
        )
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of `unpacked()` ([len(ids), K]) without unpacking the rest: an embedding
        lookup where this is a tied embedding's blocks."""
        if self.format == "f32":
            raise ValueError("rows() reads GGUF blocks; an f32 weight has none")
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.n):
            raise ValueError(f"a row id is outside 0..{self.n - 1}")
        out = torch.empty(ids.numel(), self.k, dtype=torch.float32)
        _library.kvg_quant_rows(
            FORMATS[self.format], self.data.data_ptr(), self.k, ids.data_ptr(), ids.numel(),
            out.data_ptr(),
        )  # fmt: skip
        return out


def _require_library() -> None:
    if _library is None:
        raise RuntimeError("the native linear kernel is not built")


def linear(
    x: torch.Tensor, weight: PackedWeight, *, threads: int = THREADS, build: str = "best"
) -> torch.Tensor:
    """x [..., K] times W^T: [..., N], each element one ascending FMA chain (see above)."""
    if x.shape[-1] != weight.k:
        raise ValueError(f"x has {x.shape[-1]} columns; the weight takes {weight.k}")
    if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
        rows = x  # the forward's own activations: no copy (a decode step's 121 calls add up)
    else:
        rows = x.reshape(math.prod(x.shape[:-1]), weight.k).to(torch.float32).contiguous()
    m = rows.shape[0]
    out = torch.empty(m, weight.n, dtype=torch.float32)
    if m:
        status = _library.kvg_linear_parallel(
            BUILDS[build], weight.code, rows.data_ptr(), m, weight.k, weight.k, weight.address,
            weight.n, out.data_ptr(), weight.n, min(threads, weight.panels),
        )  # fmt: skip
        if status:
            raise RuntimeError(f"this CPU cannot run the {build} build of the linear kernel")
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], weight.n)


def quantize(x: torch.Tensor, build: str = "best") -> tuple[torch.Tensor, ...]:
    """Rows of x [M, K] (K a multiple of QK) as the integer products quantize them
    (native/linear/linear_int8.c has the rule): q int8 [M, K], and per block of QK the
    scale d and s = d * sum(q), float32 [M, K / QK] each."""
    x = x.to(torch.float32).contiguous()
    m, k = x.shape
    if k % QK:
        raise ValueError(f"rows of {k} values are not blocks of {QK}")
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // QK, dtype=torch.float32)
    s = torch.empty(m, k // QK, dtype=torch.float32)
    status = _library.kvg_quantize(
        BUILDS[build], x.data_ptr(), m, k, k, q.data_ptr(), d.data_ptr(), s.data_ptr()
    )
    if status:
        raise RuntimeError(f"this CPU cannot run the {build} build of the linear kernel")
    return q, d, s


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The contract as a plain loop over the unpacked W (for tests): [M, K] x [N, K]^T."""
    x = x.to(torch.float32).contiguous()
    weight = weight.to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    _library.kvg_linear_reference(
        x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), weight.shape[0], out.data_ptr()
    )
    return out
