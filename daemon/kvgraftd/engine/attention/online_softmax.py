"""Attention merged block by block with an online softmax, in block order.

`OnlineSoftmax` is the general path (any number of query tokens, causal
masking, any device): torch ops per block, folding each block into a
running max, sum and output. Decoding on CPU (one query token) takes
kvgraftd.engine.model.decode_attention's native kernel instead (`softmax_for` chooses);
which one ran is part of the compute profile, since their last bits differ.
Either way the result depends only on the blocks' values and their order
(docs/architecture.md, contract 5), never on where a block was read from.
"""

from __future__ import annotations

import torch

from kvgraftd.engine.model.decode_attention import DecodeSoftmax, RowsSoftmax


def softmax_for(
    q: torch.Tensor, kv_heads: int, q_start: int, scaling: float, rows: bool = False,
    window: int = 0, softcap: float = 0.0,
) -> OnlineSoftmax | DecodeSoftmax:  # fmt: skip
    """The softmax a forward pass of q [heads, n, D] at positions [q_start, ...) attends with.

    `rows`: every row as a decode step at its position (RowsSoftmax), where the
    native kernel takes the geometry: the row-invariant forward's attention. A layer with a
    sliding `window` or a score `softcap` attends through RowsSoftmax alone (a model that
    has them runs on the row-invariant forward or not at all)."""
    if window or softcap:
        if not RowsSoftmax.takes(q, kv_heads):
            raise ValueError("a sliding window or a softcap needs the native attention kernel")
        return RowsSoftmax(q, kv_heads, q_start, scaling, window, softcap)
    if DecodeSoftmax.takes(q, kv_heads):
        return DecodeSoftmax(q, kv_heads, scaling)
    if rows and RowsSoftmax.takes(q, kv_heads):
        return RowsSoftmax(q, kv_heads, q_start, scaling)
    return OnlineSoftmax(q, kv_heads, q_start, scaling)


class OnlineSoftmax:
    """Attention of queries q [heads, n, D] at [q_start, ...) merged over key blocks in order."""

    def __init__(self, q: torch.Tensor, kv_heads: int, q_start: int, scaling: float) -> None:
        heads, n, dim = q.shape
        group = heads // kv_heads
        self._shape = (heads, n, dim)
        self._q = q.reshape(kv_heads, group * n, dim)  # query head h reads kv head h // group
        self._q_start = q_start
        self._q_positions = torch.arange(q_start, q_start + n).repeat(group).unsqueeze(1)
        self._scaling = scaling
        self._max = torch.full((kv_heads, group * n, 1), float("-inf"), device=q.device)
        self._sum = torch.zeros(kv_heads, group * n, 1, device=q.device)
        self._acc = torch.zeros(kv_heads, group * n, dim, device=q.device)

    def add(self, keys: torch.Tensor, values: torch.Tensor, begin: int) -> None:
        """Keys and values [kv_heads, t, D] of positions [begin, begin + t)."""
        end = begin + keys.shape[1]
        scores = torch.bmm(self._q, keys.transpose(1, 2))  # [kv_heads, group * n, t]
        scores.mul_(self._scaling)
        if end > self._q_start + 1:  # some keys lie after some query: causal mask
            k_positions = torch.arange(begin, end, device=keys.device).unsqueeze(0)
            scores.masked_fill_(k_positions > self._q_positions.to(keys.device), float("-inf"))
        new_max = torch.maximum(self._max, scores.amax(dim=-1, keepdim=True))
        weights = torch.exp(scores - new_max)
        correction = torch.exp(self._max - new_max)
        self._sum = self._sum * correction + weights.sum(dim=-1, keepdim=True)
        self._acc = self._acc * correction + torch.bmm(weights, values)
        self._max = new_max

    def result(self) -> torch.Tensor:
        """[n, heads, D]."""
        return (self._acc / self._sum).reshape(self._shape).transpose(0, 1)


def blockwise_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_start: int,
    block_tokens: int,
    scaling: float,
) -> torch.Tensor:
    """Causal attention over resident keys/values [kv_heads, >= q_start + n, D] (a reference)."""
    softmax = OnlineSoftmax(q, keys.shape[0], q_start, scaling)
    for begin in range(0, q_start + q.shape[1], block_tokens):
        end = min(begin + block_tokens, q_start + q.shape[1])
        softmax.add(keys[:, begin:end], values[:, begin:end], begin)
    return softmax.result()
