"""The batcher's step: the chunks of a step's contexts computed by the model, in one call.

`ForwardStep(adapter, page_tokens)` is what the Batcher (kvgraftd.engine.scheduling.batcher)
runs on the compute thread for each step: every context's chunk appended at its own
length (KvContext.begin_chunk / end_chunk around the forward) and each context's logits
at its last token returned. On the row-invariant forward it is one pass over the rows
of all of them (NativeForward.forward_many: each row the bits it would have alone);
elsewhere the step holds one context, whose chunk the batcher ends at the next page
boundary at the latest (`page_room`: the fixed schedule). The way down from the batcher
to the kernels goes through here and nowhere back up.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvgraftd.engine.attention.kv_context import KvContext
from kvgraftd.engine.model.model_adapter import ModelAdapter


class ForwardStep:
    def __init__(self, adapter: ModelAdapter, page_tokens: int) -> None:
        self.adapter, self.page_tokens = adapter, page_tokens

    def __call__(self, items: Sequence[tuple[KvContext, list[int]]]) -> list[torch.Tensor]:
        assert torch.are_deterministic_algorithms_enabled()
        for context, chunk in items:
            context.begin_chunk(context.length, chunk)
        if self.adapter.row_invariant:
            parts = [(context, chunk, context.length) for context, chunk in items]
            logits = self.adapter.native.forward_many(parts)
        else:
            ((context, chunk),) = items
            logits = [self.adapter.forward(chunk, context.length, context)]
        for context, chunk in items:
            context.end_chunk(chunk)
        return logits

    def page_room(self, context: KvContext) -> int:
        """The fixed schedule: a pass ends at the next page boundary at the latest."""
        return self.page_tokens - context.length % self.page_tokens
