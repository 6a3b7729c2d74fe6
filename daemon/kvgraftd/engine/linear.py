"""Row-invariant fp32 linear products: the native kernel of engine/native/linear.c.

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
kernel streams it). `linear` splits the panels, never k, between `threads`
(one per core by default): the calling thread (in a ctypes call, without the
GIL) and the library's own workers, which wait for the next product spinning
briefly, so a product of one row costs microseconds to hand out, not a
thread pool's round trip.
`available()` is False where the library was not built (no C compiler); the
engine then keeps torch's products on the fixed schedule.
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
import os
from dataclasses import dataclass

import torch

PANEL = 16  # columns per packed panel
BUILDS = {"best": 0, "generic": 1, "avx2": 2, "avx512": 3}
THREADS = max(1, len(os.sched_getaffinity(0)))

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def _load() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("kvgraftd.engine._linear")
    if spec is None or spec.origin is None:
        return None
    library = ctypes.CDLL(spec.origin)
    library.kvg_linear.argtypes = [
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
    # build, x, M, K, ldx, packed, N, y, ldy, threads
    library.kvg_linear_parallel.argtypes = [ctypes.c_int, _PTR, *[_I64] * 3, _PTR, _I64, _PTR, _I64]
    library.kvg_linear_parallel.argtypes += [ctypes.c_int]
    library.kvg_linear_parallel.restype = ctypes.c_int
    library.kvg_linear_pack.argtypes = [_PTR, _I64, _I64, _PTR]
    library.kvg_linear_pack.restype = None
    library.kvg_linear_reference.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _PTR]
    library.kvg_linear_reference.restype = None
    library.kvg_linear_name.argtypes = [ctypes.c_int]
    library.kvg_linear_name.restype = ctypes.c_char_p
    library.kvg_linear_builds.restype = ctypes.c_int
    return library


_library = _load()


def available() -> bool:
    return _library is not None


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
    return _library.kvg_linear_name(0).decode()


@dataclass(frozen=True)
class PackedWeight:
    """W [N, K] in the kernel's panels: N, K and the packed floats."""

    n: int
    k: int
    data: torch.Tensor  # ceil(N/16) * K * 16 float32

    @property
    def panels(self) -> int:
        return -(-self.n // PANEL)

    @classmethod
    def of(cls, weight: torch.Tensor) -> PackedWeight:
        if _library is None:
            raise RuntimeError("the native linear kernel is not built")
        weight = weight.detach().to(torch.float32).contiguous()
        n, k = weight.shape
        data = torch.empty(-(-n // PANEL) * k * PANEL, dtype=torch.float32)
        _library.kvg_linear_pack(weight.data_ptr(), n, k, data.data_ptr())
        return cls(n, k, data)


def linear(
    x: torch.Tensor, weight: PackedWeight, *, threads: int = THREADS, build: str = "best"
) -> torch.Tensor:
    """x [..., K] times W^T: [..., N], each element one ascending FMA chain (see above)."""
    if x.shape[-1] != weight.k:
        raise ValueError(f"x has {x.shape[-1]} columns; the weight takes {weight.k}")
    rows = x.reshape(math.prod(x.shape[:-1]), weight.k).to(torch.float32).contiguous()
    out = torch.empty(rows.shape[0], weight.n, dtype=torch.float32)
    if rows.shape[0]:
        _run(rows, weight, out, max(1, min(threads, weight.panels)), BUILDS[build])
    return out.reshape(*x.shape[:-1], weight.n)


def _run(rows: torch.Tensor, weight: PackedWeight, out: torch.Tensor, threads: int, build: int):
    m, k = rows.shape
    status = _library.kvg_linear_parallel(
        build, rows.data_ptr(), m, k, k, weight.data.data_ptr(), weight.n, out.data_ptr(),
        weight.n, threads,
    )  # fmt: skip
    if status:
        raise RuntimeError(f"this CPU cannot run the {build} build of the linear kernel")


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The contract as a plain loop over the unpacked W (for tests): [M, K] x [N, K]^T."""
    x = x.to(torch.float32).contiguous()
    weight = weight.to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    _library.kvg_linear_reference(
        x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), weight.shape[0], out.data_ptr()
    )
    return out
