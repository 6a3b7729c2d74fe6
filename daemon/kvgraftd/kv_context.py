"""The KV of one inference context, and attention over it in a fixed block order.

Per layer, K and V live in growable buffers [kv_heads, capacity, head_dim]
(float32). A forward pass over a chunk of tokens at positions [start,
start + n) first writes the chunk's K and V into the buffers, then attends
over positions [0, start + n) block by block (`block_tokens` keys at a
time, always the same block boundaries) with an online softmax whose running
max, sum and output are merged in block order. Whether a position's KV was
computed here or grafted from stored pages, the attention reads the same
bytes in the same order through the same operations, so the logits are
bitwise the same (DESIGN.md, contract items 1, 2 and 5).

Pages are the unit of storage: page p of layer l holds positions
[p * page_tokens, (p + 1) * page_tokens) as K then V, each [kv_heads, t,
head_dim]. `page_bytes` copies one out; `load_pages` copies pages in.
"""

from __future__ import annotations

import numpy as np
import torch

from kvgraftd.model_adapter import ModelGeometry

_GROWTH_TOKENS = 1024


def blockwise_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_start: int,
    block_tokens: int,
    scaling: float,
) -> torch.Tensor:
    """Causal attention of queries at [q_start, q_start + n) over keys [0, q_start + n).

    q: [heads, n, D]; keys, values: [kv_heads, >= q_start + n, D]. Returns
    [n, heads, D]. Query head h reads kv head h // (heads // kv_heads).
    """
    heads, n, dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    total = q_start + n
    qg = q.reshape(kv_heads, group * n, dim)  # [kv_heads, group * n, D]
    q_positions = torch.arange(q_start, total).repeat(group).unsqueeze(1)  # [group * n, 1]
    row_max = torch.full((kv_heads, group * n, 1), float("-inf"))
    row_sum = torch.zeros(kv_heads, group * n, 1)
    acc = torch.zeros(kv_heads, group * n, dim)
    for begin in range(0, total, block_tokens):
        end = min(begin + block_tokens, total)
        scores = torch.bmm(qg, keys[:, begin:end].transpose(1, 2))  # [kv_heads, group * n, t]
        scores.mul_(scaling)
        if end > q_start + 1:  # some keys lie after some query
            k_positions = torch.arange(begin, end).unsqueeze(0)  # [1, t]
            scores.masked_fill_(k_positions > q_positions, float("-inf"))
        new_max = torch.maximum(row_max, scores.amax(dim=-1, keepdim=True))
        weights = torch.exp(scores - new_max)
        correction = torch.exp(row_max - new_max)
        row_sum = row_sum * correction + weights.sum(dim=-1, keepdim=True)
        acc = acc * correction + torch.bmm(weights, values[:, begin:end])
        row_max = new_max
    out = (acc / row_sum).reshape(heads, n, dim)
    return out.transpose(0, 1)  # [n, heads, D]


class KvContext:
    """Token ids, segments and per-layer KV of one context."""

    def __init__(self, geometry: ModelGeometry, page_tokens: int, block_tokens: int) -> None:
        if block_tokens % page_tokens:
            raise ValueError("block_tokens must be a multiple of page_tokens")
        self.geometry = geometry
        self.page_tokens = page_tokens
        self.block_tokens = block_tokens
        self.token_ids: list[int] = []
        self.segment_ends: list[int] = []
        self._keys = [self._empty(0) for _ in range(geometry.num_layers)]
        self._values = [self._empty(0) for _ in range(geometry.num_layers)]
        self._chunk_start = 0

    def _empty(self, capacity: int) -> torch.Tensor:
        return torch.zeros(self.geometry.kv_heads, capacity, self.geometry.head_dim)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def _reserve(self, tokens: int) -> None:
        capacity = self._keys[0].shape[1]
        if tokens <= capacity:
            return
        grown = max(tokens, 2 * capacity, _GROWTH_TOKENS)
        for buffers in (self._keys, self._values):
            for layer, old in enumerate(buffers):
                new = self._empty(grown)
                new[:, :capacity] = old
                buffers[layer] = new

    # ------------------------------------------------------------------
    def begin_chunk(self, start: int, token_ids: list[int]) -> None:
        """Prepare a forward pass over `token_ids` at positions [start, ...)."""
        assert start == self.length, "chunks are appended in order"
        self._reserve(start + len(token_ids))
        self._chunk_start = start

    def end_chunk(self, token_ids: list[int]) -> None:
        self.token_ids += token_ids

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Store the chunk's k, v ([kv_heads, n, D]) for `layer`, then attend (q: [heads, n, D])."""
        start, n = self._chunk_start, k.shape[1]
        self._keys[layer][:, start : start + n] = k
        self._values[layer][:, start : start + n] = v
        return blockwise_attention(
            q, self._keys[layer], self._values[layer], start, self.block_tokens, scaling
        )

    # ------------------------------------------------------------------
    def page_count(self) -> int:
        return -(-self.length // self.page_tokens)

    def page_bytes(self, page: int, layer: int) -> bytes:
        """Page `page` of `layer` as stored: K then V, [kv_heads, t, D] each."""
        begin = page * self.page_tokens
        end = min(begin + self.page_tokens, self.length)
        both = torch.stack((self._keys[layer][:, begin:end], self._values[layer][:, begin:end]))
        return both.contiguous().numpy().tobytes()

    def load_pages(self, token_ids: list[int], layer_pages: list[np.ndarray]) -> None:
        """Graft the KV of `token_ids` (positions [0, len)), one uint8 array per layer.

        layer_pages[l] holds layer l's pages back to back, each K then V.
        """
        assert self.length == 0, "grafts start from an empty context"
        total = len(token_ids)
        self._reserve(total)
        kv_heads, dim, page = self.geometry.kv_heads, self.geometry.head_dim, self.page_tokens
        whole = total // page
        for layer, raw in enumerate(layer_pages):
            flat = torch.from_numpy(raw).view(torch.float32)
            # Whole pages in one strided copy per tensor: [pages, 2, kv_heads, page, D]
            # -> [kv_heads, pages * page, D].
            pages = flat[: whole * 2 * kv_heads * page * dim].view(whole, 2, kv_heads, page, dim)
            for buffers, part in ((self._keys, 0), (self._values, 1)):
                target = buffers[layer][:, : whole * page].view(kv_heads, whole, page, dim)
                target.copy_(pages[:, part].transpose(0, 1))
            tail = total - whole * page
            if tail:
                last = flat[whole * 2 * kv_heads * page * dim :].view(2, kv_heads, tail, dim)
                self._keys[layer][:, whole * page : total] = last[0]
                self._values[layer][:, whole * page : total] = last[1]
        self.token_ids = list(token_ids)
