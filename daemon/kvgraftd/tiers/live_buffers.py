"""Host buffers for the live KV of contexts, recycled from one context to the next.

A context keeps the KV it computes (or loads from a partial block) in host
buffers [kv_heads, capacity, head_dim], one K and one V per layer. A fresh
buffer of a few megabytes costs page faults on its first write, and those
cost more than the write itself: attaching a 2,048-token graft of the default
model copies 94 MB, ~10 ms into warm memory and ~60 ms into new memory
(measured on the 2-core machine). Requests run one after another, so the
buffers of a closed context are kept, up to `keep_bytes` in all, and handed
to the next context asking for the same shape.

Capacities are multiples of `GRANULE_TOKENS`, so contexts of similar length
share buffers. A recycled buffer holds the previous context's bytes: they are
never read, because a context reads only the positions it has written
(kv_context), exactly as with an uninitialized new buffer.

Thread-safe.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

GRANULE_TOKENS = 1024  # capacities are rounded up to a multiple of this
KEEP_BYTES = 256 << 20  # idle buffers kept for the next context (~5,500 tokens of SmolLM2)


def round_capacity(tokens: int) -> int:
    return -(-tokens // GRANULE_TOKENS) * GRANULE_TOKENS


class LiveBuffers:
    def __init__(self, *, pinned: bool = False, keep_bytes: int = KEEP_BYTES) -> None:
        self.pinned = pinned  # page-locked, for fast copies to a GPU
        self.keep_bytes = keep_bytes
        self._idle: defaultdict[tuple[int, ...], list[torch.Tensor]] = defaultdict(list)
        self._idle_bytes = 0
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def take(self, kv_heads: int, capacity: int, head_dim: int) -> torch.Tensor:
        """A float32 buffer [kv_heads, capacity, head_dim] with unspecified contents."""
        shape = (kv_heads, capacity, head_dim)
        with self._lock:
            idle = self._idle.get(shape)
            if idle:
                buffer = idle.pop()
                self._idle_bytes -= _nbytes(buffer)
                return buffer
        with torch.inference_mode(False):  # a normal tensor: writable on any thread
            return torch.empty(shape, pin_memory=self.pinned)

    def give(self, buffers: list[torch.Tensor]) -> None:
        """Buffers nobody reads any more; kept while they fit in keep_bytes, else freed."""
        with self._lock:
            for buffer in buffers:
                size = _nbytes(buffer)
                if size and self._idle_bytes + size <= self.keep_bytes:
                    self._idle[tuple(buffer.shape)].append(buffer)
                    self._idle_bytes += size


def _nbytes(buffer: torch.Tensor) -> int:
    return buffer.numel() * buffer.element_size()
