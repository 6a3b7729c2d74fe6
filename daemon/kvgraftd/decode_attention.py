"""Decode-step attention on CPU: one native pass per block, partial results merged in order.

A forward pass of one token (decoding) gives each KV head a few query rows
(the heads of its group) against every key of the context: a scan of
memory at ~1.5 flops per byte, where torch's batched matmuls and a dozen
small tensor ops per block ran at a third of the machine's memory speed.
The native kernel (kvgraftd/native, built with the package) reads each
block once: scores, their max, the weights and the weighted values of every
head, and, for a page read where the store keeps it, the page's xxh3-128 in
the same pass, so checking a streamed page costs no second read.

Contract:
* `DecodeSoftmax.partial(...)` is a pure function of the block's values (not
  of strides, threads or the tier the bytes came from): thread-safe.
  `checked_partial(page, checksum)` is the same for a whole stored page, or
  None when the page's bytes do not hash to `checksum`; nothing computed from
  such a page may be used.
* `merge` folds partials in the order it is called; callers merge in block
  order (`OrderedPartials`), so the logits never depend on which thread
  computed which block (DESIGN.md, contract 5).
* `kernel_name()` names the kernel for the compute profile: "native-avx512",
  "native-generic", or "torch" where the library is not built (the engine
  then attends with kvgraftd.online_softmax alone).
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait

import numpy as np
import torch

MAX_ROWS = 8  # query rows per KV head the kernel takes (group size x tokens)
_MISMATCH, _BAD_ARGS = 1, 2
_P = ctypes.c_void_p


def _load() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("kvgraftd._attend")
    if spec is None or spec.origin is None:
        return None
    library = ctypes.CDLL(spec.origin)
    library.kvg_block_partial.argtypes = [_P, _P, _P, ctypes.c_int64] + [ctypes.c_int32] * 4
    library.kvg_block_partial.argtypes += [_P, _P, _P, _P, ctypes.c_char_p]
    library.kvg_block_partial.restype = ctypes.c_int
    library.kvg_merge.argtypes = [ctypes.c_int32, ctypes.c_int32, _P, _P, _P, _P, _P, _P]
    library.kvg_merge.restype = None
    library.kvg_kernel_name.restype = ctypes.c_char_p
    return library


_library = _load()


def kernel_name() -> str:
    return f"native-{_library.kvg_kernel_name().decode()}" if _library is not None else "torch"


Partial = tuple[np.ndarray, np.ndarray, np.ndarray]  # max [rows], sum [rows], acc [rows, D]


class DecodeSoftmax:
    """Attention of one query token q [heads, 1, D] over blocks of keys and values."""

    @staticmethod
    def takes(q: torch.Tensor, kv_heads: int) -> bool:
        heads, n, dim = q.shape
        return (
            _library is not None
            and q.device.type == "cpu"
            and q.dtype == torch.float32
            and n == 1
            and dim % 16 == 0
            and heads // kv_heads <= MAX_ROWS
        )

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

    def partial(
        self, keys: int, values: int, head_stride: int, tokens: int, checksum: bytes | None = None
    ) -> Partial | None:
        """The partial over `tokens` positions whose K and V start at addresses `keys` and
        `values` (head h at + h * head_stride floats, position j at + j * D)."""
        heads, dim = self._kv_heads * self._group, self._dim
        scores = getattr(self._scratch, "scores", None)
        if scores is None or scores.size < heads * tokens:
            scores = self._scratch.scores = np.empty(heads * tokens, np.float32)
        out = (np.empty(heads, np.float32), np.empty(heads, np.float32))
        acc = np.empty((heads, dim), np.float32)
        status = _library.kvg_block_partial(
            self._q.ctypes.data, keys, values, head_stride, self._kv_heads, self._group, dim,
            tokens, scores.ctypes.data, out[0].ctypes.data, out[1].ctypes.data, acc.ctypes.data,
            checksum,
        )  # fmt: skip
        if status == _MISMATCH:
            return None
        if status:
            raise ValueError(f"the native kernel refused a block of {tokens} tokens")
        return out[0], out[1], acc

    def slot_partial(self, block: torch.Tensor, tokens: int) -> Partial:
        """The partial over the first `tokens` positions of a slot [2, kv_heads, capacity, D]."""
        head_stride = block.stride(1)
        assert block.stride(2) == self._dim and block.stride(3) == 1, "a slot is contiguous"
        result = self.partial(block[0].data_ptr(), block[1].data_ptr(), head_stride, tokens)
        assert result is not None
        return result

    def checked_partial(self, page: np.ndarray, checksum: bytes | None) -> Partial | None:
        """The partial over a whole page (uint8, K then V), checked in the same pass unless
        `checksum` is None (a copy checked before); None when the page is corrupt."""
        tokens = page.nbytes // (2 * self._kv_heads * self._dim * 4)
        keys = page.ctypes.data
        values = keys + self._kv_heads * tokens * self._dim * 4
        return self.partial(keys, values, tokens * self._dim, tokens, checksum)

    def merge(self, partial: Partial) -> None:
        heads = self._kv_heads * self._group
        maximum, total, acc = partial
        _library.kvg_merge(
            heads, self._dim, self._max.ctypes.data, self._sum.ctypes.data,
            self._acc.ctypes.data, maximum.ctypes.data, total.ctypes.data, acc.ctypes.data,
        )  # fmt: skip

    def result(self) -> torch.Tensor:
        """[1, heads, D]."""
        return torch.from_numpy(self._acc / self._sum[:, None]).unsqueeze(0)


class OrderedPartials:
    """Block partials computed on worker threads and merged in the order they were submitted.

    At most `window` are in flight. Leaving the `with` block merges what is
    left; leaving it by an exception first waits for every task still
    running (they read pages and slots the caller is about to let go).
    """

    def __init__(self, workers: Executor, window: int, merge: Callable[[Partial], None]) -> None:
        self._workers, self._window, self._merge = workers, window, merge
        self._pending: deque[Future] = deque()

    def submit(self, compute: Callable[..., Partial], *args: object) -> None:
        self._pending.append(self._workers.submit(compute, *args))
        if len(self._pending) > self._window:
            self._merge(self._pending.popleft().result())

    def drain(self) -> None:
        while self._pending:
            self._merge(self._pending.popleft().result())

    def __enter__(self) -> OrderedPartials:
        return self

    def __exit__(self, exc_type: type | None, *_: object) -> None:
        try:
            if exc_type is None:
                self.drain()
        finally:  # a task that failed, or the caller's error: let every other task end
            wait(self._pending)
            self._pending.clear()
