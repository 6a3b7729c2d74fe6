"""Attention on CPU through the native kernel: one pass per block, partials merged in order.

A forward pass of one token (decoding) gives each KV head a few query rows
(the heads of its group) against every key of the context: a scan of
memory at ~1.5 flops per byte, where torch's batched matmuls and a dozen
small tensor ops per block ran at a third of the machine's memory speed.
The native kernel (kvgraftd/engine/native, built with the package) reads each
block once: scores, their max, the weights and the weighted values of every
head, and, for a page read where the store keeps it, the page's xxh3-128 in
the same pass, so checking a streamed page costs no second read. Blocks go
to the kernel in batches, one call per batch, so a step of thousands of
pages pays the interpreter per batch, not per page.

Contract:
* `DecodeSoftmax.partials(blocks)` gives each block's partial, a pure function
  of that block's values (not of strides, batches, threads or the tier the
  bytes came from): thread-safe. A block with a checksum (a whole stored
  page, `page_block`) is checked in the same pass; when one does not match,
  CorruptBlock names it and nothing computed from the batch may be used. A
  page where it lies in the store (InPlacePage) is read under the store's
  fault guard (kvgraftd.store.segment_maps), handed to the library when it
  loads: one its file can no longer give raises UnreadBlock, never SIGBUS.
* `merge` folds partials in the order given; callers merge in block order
  (kvgraftd.engine.attention.ordered_partials), so the logits never depend on which thread computed
  which block or how blocks were batched (docs/architecture.md, contract 5).
* `RowsSoftmax` attends the rows of a forward pass of several tokens: each
  token's partial over a block is the kernel's for the keys up to its own
  position, and its partials merge in block order, so every row's bits are
  those of a decode step at that position, whatever the chunk (the exactness
  contract for any schedule, docs/architecture.md). With a sliding `window`
  (the keys of the last `window` positions) or a score `softcap` (a model's
  layer that has them), it is how every pass attends, a decode step too (as
  `attend_live_step` and layer_kernels' one-call step do, in tiles of one token):
  the window and the cap are part of each position's arithmetic (the kernel's
  tile_partial), the same whatever the pass.
* `kernel_for(heads, kv_heads, dim)` names the kernel that decodes a model of
  that geometry, for the compute profile: "native" (its written arithmetic, which
  every build, generic, AVX2 or AVX-512, computes to the bit), or "torch" where the
  library is not built or does not take the geometry (the engine then attends with
  kvgraftd.engine.attention.online_softmax alone). `kernel_build()` says which build
  runs here.

The kernel's limits (MAX_ROWS, the head sizes it takes) and statuses are its own,
read from the library when it loads (native/attend_limits.h is their one source).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import torch

from kvgraftd.engine.model import kernel_libraries
from kvgraftd.store.page_records import InPlacePage
from kvgraftd.store.segment_maps import fault_guard

ROW_THREADS = max(1, len(os.sched_getaffinity(0)))  # a prefill's rows are split between them
_P = ctypes.c_void_p


def _load() -> ctypes.CDLL | None:
    library = kernel_libraries.load("kvgraftd.engine.model._attend")
    if library is None:
        return None
    library.kvg_blocks_partial.argtypes = [ctypes.c_int32] + [_P] * 4 + [ctypes.c_int32] * 3
    library.kvg_blocks_partial.argtypes += [_P] * 5
    library.kvg_blocks_partial.restype = ctypes.c_int
    library.kvg_merge_blocks.argtypes = [ctypes.c_int32] * 3 + [_P] * 6
    library.kvg_merge_blocks.restype = None
    library.kvg_rows_partial.argtypes = [ctypes.c_int32, _P, _P, ctypes.c_int64]
    library.kvg_rows_partial.argtypes += [ctypes.c_int32] * 3 + [ctypes.c_int64, ctypes.c_float]
    library.kvg_rows_partial.argtypes += [_P] * 2 + [ctypes.c_int32] * 3
    library.kvg_rows_partial.argtypes += [_P] * 6
    library.kvg_rows_partial.restype = ctypes.c_int
    for name in ("kvg_blocks_partial", "kvg_rows_partial"):  # each with a guarded twin
        guarded = getattr(library, f"{name}_guarded")
        guarded.argtypes, guarded.restype = getattr(library, name).argtypes, ctypes.c_int
    guard = fault_guard()  # stored pages are read where they lie only where there is one
    if guard is not None:
        library.kvg_attend_set_fault_guard.argtypes = [_P, _P]
        library.kvg_attend_set_fault_guard(*guard)
    library.kvg_rows_merge.argtypes = [ctypes.c_int32] * 4 + [_P] * 7
    library.kvg_rows_merge.restype = None
    # q, k, v, head_stride, H, R, D, total, block, scaling, window, cap, out
    library.kvg_decode_live.argtypes = [_P] * 3 + [ctypes.c_int64] + [ctypes.c_int32] * 3
    library.kvg_decode_live.argtypes += [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int64]
    library.kvg_decode_live.argtypes += [ctypes.c_float, _P]
    library.kvg_decode_live.restype = ctypes.c_int
    library.kvg_kernel_name.restype = ctypes.c_char_p
    return library


_library = _load()
# the kernel's limits and statuses (None where the library is not built)
_constants = kernel_libraries.constants(_library, "kvg_attend_constants") if _library else {}
MAX_ROWS = _constants.get("MAX_ROWS")  # query rows per KV head it takes (group size x tokens)
_DIM_MULTIPLE, _MAX_DIM = _constants.get("DIM_MULTIPLE"), _constants.get("MAX_DIM")  # head sizes
_CHECKSUM_BYTES = _constants.get("CHECKSUM_BYTES")  # a page's xxh3-128
TILE_TOKENS = _constants.get("TILE_TOKENS")  # a prefill's tokens attending a block together
_MISMATCH = _constants.get("MISMATCH")  # a checked page does not hash to its checksum
_FAULTED = _constants.get("FAULTED")  # a page read where it lies could not be read


def available() -> bool:
    """Whether the library was built (else attention runs on torch alone)."""
    return _library is not None


_row_workers: ThreadPoolExecutor | None = None
_row_workers_lock = threading.Lock()


def _row_pool() -> ThreadPoolExecutor:
    """Workers for a prefill's rows (their own: the rows may be split on an attention worker)."""
    global _row_workers
    with _row_workers_lock:
        if _row_workers is None:
            _row_workers = ThreadPoolExecutor(max(1, ROW_THREADS - 1), thread_name_prefix="rows")
        return _row_workers


def native_library() -> ctypes.CDLL | None:
    """The loaded library (kvgraftd.engine.model.layer_kernels takes its batched step from it)."""
    return _library


def takes_geometry(heads: int, kv_heads: int, dim: int) -> bool:
    if _library is None:
        return False
    return dim % _DIM_MULTIPLE == 0 and dim <= _MAX_DIM and heads // kv_heads <= MAX_ROWS


def kernel_for(heads: int, kv_heads: int, dim: int) -> str:
    if not takes_geometry(heads, kv_heads, dim):
        return "torch"
    return "native"


def kernel_build() -> str:
    """The build of the attention kernel this CPU runs: "avx512", "avx2" or "generic"."""
    return _library.kvg_kernel_name().decode() if _library is not None else "none"


def attend_live_step(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    total: int,
    block_tokens: int,
    scaling: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """A decode step (q [heads, 1, D]) over positions [0, total) of one context's live
    buffers (keys, values [kv_heads, capacity, D]), in blocks of `block_tokens`: one call
    of the kernel for what DecodeSoftmax does block by block (RowsSoftmax, for a layer with
    a sliding `window` or a `softcap`), with the same bits. Returns [1, heads, D]."""
    heads, _, dim = q.shape
    kv_heads = keys.shape[0]
    assert keys.is_contiguous() and values.is_contiguous() and keys.stride() == values.stride()
    rows = q.reshape(heads, dim).contiguous()
    out = torch.empty(heads, dim, dtype=torch.float32)
    status = _library.kvg_decode_live(
        rows.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(0), kv_heads,
        heads // kv_heads, dim, total, block_tokens, scaling, window, softcap, out.data_ptr(),
    )  # fmt: skip
    if status:
        raise MemoryError if status < 0 else ValueError(f"the native kernel refused ({status})")
    return out.unsqueeze(0)


@dataclass(frozen=True)
class Block:
    """K and V of `tokens` positions from `begin`: head h, position begin + j at
    address `keys` + (h * head_stride + j * D) floats (V the same from `values`),
    and the xxh3-128 a whole stored page is checked against (None: checked before)."""

    keys: int
    values: int
    head_stride: int
    tokens: int
    checksum: bytes | None = None
    begin: int = 0
    in_place: bool = False  # a stored page where it lies in a segment's mapping


class UnreadBlock(Exception):
    """Block `index` of a batch, a stored page read where it lies, could not be read (its
    segment file cut short, or the disk failing): nothing computed from the batch may be
    used."""

    def __init__(self, index: int) -> None:
        super().__init__(f"block {index} could not be read from its segment")
        self.index = index


class CorruptBlock(Exception):
    """Block `index` of a batch does not hash to its checksum: nothing computed from the
    batch may be used."""

    def __init__(self, index: int) -> None:
        super().__init__(f"block {index} does not match its checksum")
        self.index = index


# per block of a batch: max [n, rows], sum [n, rows], acc [n, rows, D]
Partials = tuple[np.ndarray, np.ndarray, np.ndarray]


class DecodeSoftmax:
    """Attention of one query token q [heads, 1, D] over blocks of keys and values."""

    @staticmethod
    def takes(q: torch.Tensor, kv_heads: int) -> bool:
        heads, n, dim = q.shape
        on_cpu = q.device.type == "cpu" and q.dtype == torch.float32
        return on_cpu and n == 1 and takes_geometry(heads, kv_heads, dim)

    def __init__(self, q: torch.Tensor, kv_heads: int, scaling: float) -> None:
        heads, _, dim = q.shape
        self._kv_heads, self._group, self._dim = kv_heads, heads // kv_heads, dim
        # query head h reads kv head h // group; the scaling is applied once, to q
        scaled = (q.reshape(kv_heads, self._group, dim) * scaling).contiguous()
        self._q = scaled.numpy()
        self._max = np.full(heads, -np.inf, np.float32)
        self._sum = np.zeros(heads, np.float32)
        self._acc = np.zeros((heads, dim), np.float32)
        self._scratch = threading.local()

    def page_block(
        self, page: np.ndarray | InPlacePage, checksum: bytes | None, begin: int = 0
    ) -> Block:
        """A whole stored page (uint8, K then V of every head) of positions from `begin`,
        checked against `checksum`: a copy, or the page where it lies in the store (read
        under the store's fault guard)."""
        tokens = page.nbytes // (2 * self._kv_heads * self._dim * 4)
        in_place = isinstance(page, InPlacePage)
        # the kernel arms the store's fault guard over checked blocks: one read in place is
        assert checksum is not None or not in_place, "a page read where it lies is checked"
        keys = page.address if in_place else page.ctypes.data
        half = page.nbytes // 2
        return Block(keys, keys + half, tokens * self._dim, tokens, checksum, begin, in_place)

    @staticmethod
    def slot_block(slot: torch.Tensor, tokens: int, begin: int = 0) -> Block:
        """The first `tokens` positions of a slot [2, kv_heads, capacity, D], from `begin`."""
        assert slot.stride(3) == 1 and slot.stride(2) == slot.shape[3], "a slot is contiguous"
        return Block(slot[0].data_ptr(), slot[1].data_ptr(), slot.stride(1), tokens, None, begin)

    def partials(self, blocks: Sequence[Block]) -> Partials:
        """Each block's partial, computed in one call of the kernel; raises CorruptBlock, or
        UnreadBlock for a page read in place that its file could not give."""
        n, rows, dim = len(blocks), self._kv_heads * self._group, self._dim
        scores = self._scores(blocks)
        shape = np.array([(b.keys, b.values, b.head_stride, b.tokens) for b in blocks], np.int64)
        checksums, checked = _checks(blocks)
        out = np.empty((n, rows), np.float32), np.empty((n, rows), np.float32)
        acc = np.empty((n, rows, dim), np.float32)
        failed = ctypes.c_int32(-1)
        guarded = any(block.in_place for block in blocks)
        function = _library.kvg_blocks_partial_guarded if guarded else _library.kvg_blocks_partial
        status = function(
            n, self._q.ctypes.data, shape.ctypes.data, checksums, checked, self._kv_heads,
            self._group, dim, scores.ctypes.data, out[0].ctypes.data, out[1].ctypes.data,
            acc.ctypes.data, ctypes.byref(failed),
        )  # fmt: skip
        _check_status(status, failed.value)
        return out[0], out[1], acc

    def _score_rows(self) -> int:
        """Rows of scores the kernel keeps at once: every head's of the token."""
        return self._kv_heads * self._group

    def _scores(self, blocks: Sequence[Block]) -> np.ndarray:
        """This thread's scratch for the kernel's scores: its rows over the longest block."""
        size = self._score_rows() * max(block.tokens for block in blocks)
        scores = getattr(self._scratch, "scores", None)
        if scores is None or scores.size < size:
            scores = self._scratch.scores = np.empty(size, np.float32)
        return scores

    def first_block(self, block_tokens: int) -> int:
        """The first block of `block_tokens` keys any of its rows sees (every one)."""
        return 0

    def merge(self, partials: Partials) -> None:
        """Fold the partials into the result, in their order."""
        maximum, total, acc = partials
        _library.kvg_merge_blocks(
            len(maximum), self._kv_heads * self._group, self._dim, self._max.ctypes.data,
            self._sum.ctypes.data, self._acc.ctypes.data, maximum.ctypes.data,
            total.ctypes.data, acc.ctypes.data,
        )  # fmt: skip

    def result(self) -> torch.Tensor:
        """[1, heads, D]."""
        return torch.from_numpy(self._acc / self._sum[:, None]).unsqueeze(0)


class RowsSoftmax(DecodeSoftmax):
    """Attention of the tokens q [heads, n, D] at positions [first, first + n), each row as
    the decode step at its position attends (see the module docstring)."""

    @staticmethod
    def takes(q: torch.Tensor, kv_heads: int) -> bool:
        heads, _, dim = q.shape
        on_cpu = q.device.type == "cpu" and q.dtype == torch.float32
        return on_cpu and takes_geometry(heads, kv_heads, dim)

    def __init__(
        self, q: torch.Tensor, kv_heads: int, first: int, scaling: float, window: int = 0,
        softcap: float = 0.0,
    ) -> None:  # fmt: skip
        heads, n, dim = q.shape
        self._kv_heads, self._group, self._dim = kv_heads, heads // kv_heads, dim
        self._first, self._count = first, n
        self._window, self._softcap = window, softcap
        # per token, as DecodeSoftmax scales its one token: [n, kv_heads, group, D]
        rows = q.transpose(0, 1).reshape(n, kv_heads, self._group, dim)
        self._q = (rows * scaling).contiguous().numpy()
        self._max = np.full((n, heads), -np.inf, np.float32)
        self._sum = np.zeros((n, heads), np.float32)
        self._acc = np.zeros((n, heads, dim), np.float32)
        self._scratch = threading.local()

    def first_block(self, block_tokens: int) -> int:
        """The first block its first row's window reaches (the later rows' start later): the
        blocks before it are no row's, not merged whatever they would give."""
        if not self._window:
            return 0
        return max(0, self._first - self._window + 1) // block_tokens

    def _score_rows(self) -> int:
        """A tile of tokens' rows of one head (the kernel's tile_partial)."""
        return TILE_TOKENS * self._group

    def partials(self, blocks: Sequence[Block]) -> Partials:
        """Each block's partial for every token that sees it; raises CorruptBlock, or
        UnreadBlock for a page read in place that its file could not give."""
        n, count, rows, dim = len(blocks), self._count, self._kv_heads * self._group, self._dim
        shape = np.array(
            [(b.keys, b.values, b.head_stride, b.tokens, b.begin) for b in blocks], np.int64
        )
        checksums, checked = _checks(blocks)
        maximum = np.empty((n, count, rows), np.float32)
        total = np.empty((n, count, rows), np.float32)
        acc = np.empty((n, count, rows, dim), np.float32)
        used = np.empty((n, count), np.uint8)
        outputs = (maximum, total, acc, used)

        guarded = any(block.in_place for block in blocks)
        function = _library.kvg_rows_partial_guarded if guarded else _library.kvg_rows_partial

        def compute(t0: int, t1: int) -> tuple[int, int]:
            scratch = self._scores(blocks)  # this thread's
            failed = ctypes.c_int32(-1)
            status = function(
                n, self._q.ctypes.data, shape.ctypes.data, self._first, count, t0, t1,
                self._window, self._softcap, checksums, checked, self._kv_heads, self._group,
                dim, scratch.ctypes.data,
                *(array.ctypes.data for array in outputs), ctypes.byref(failed),
            )  # fmt: skip
            return status, failed.value

        # the rows are independent: split them between this thread and the row workers
        parts = min(ROW_THREADS, count)
        bounds = [count * i // parts for i in range(parts + 1)]
        futures = [_row_pool().submit(compute, bounds[i], bounds[i + 1]) for i in range(1, parts)]
        try:
            first = compute(bounds[0], bounds[1])
        finally:  # the workers read the caller's pages, in place too: none outlives the call
            wait(futures)
        results = [first, *(future.result() for future in futures)]
        for status, failed in results:
            _check_status(status, failed)
        return maximum, total, acc, used

    def merge(self, partials) -> None:
        maximum, total, acc, used = partials
        _library.kvg_rows_merge(
            len(maximum), self._count, self._kv_heads * self._group, self._dim,
            self._max.ctypes.data, self._sum.ctypes.data, self._acc.ctypes.data,
            maximum.ctypes.data, total.ctypes.data, acc.ctypes.data, used.ctypes.data,
        )  # fmt: skip

    def result(self) -> torch.Tensor:
        """[n, heads, D]."""
        return torch.from_numpy(self._acc / self._sum[:, :, None])


def _checks(blocks: Sequence[Block]) -> tuple[bytes, bytes]:
    """The blocks' checksums (zeros where none) and which of them to check, for the kernel."""
    checksums = b"".join(b.checksum or bytes(_CHECKSUM_BYTES) for b in blocks)
    assert len(checksums) == _CHECKSUM_BYTES * len(blocks), "a checksum is an xxh3-128 digest"
    return checksums, bytes(b.checksum is not None for b in blocks)


def _check_status(status: int, failed: int) -> None:
    """The kernel's status as an exception: CorruptBlock for a page that does not match,
    UnreadBlock for one read in place that faulted."""
    if status == _MISMATCH:
        raise CorruptBlock(failed)
    if status == _FAULTED:
        raise UnreadBlock(failed)
    if status:
        raise ValueError(f"the native kernel refused block {failed} of a batch")
