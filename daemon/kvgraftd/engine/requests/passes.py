"""A request's passes: its context admitted, its segments computed, cancellable, reported.

`Passes` is the part of the Engine (kvgraftd.engine.requests.engine) that computes a
request's tokens. `_serving` admits the request (kvgraftd.engine.scheduling.admission) with
the live KV it will hold reserved (its prompt's positions not grafted whole, and max_new_tokens) and
gives it a context whose buffers are sized for that once. `_appending` appends one
segment as a pass handed to the batcher, whose loop computes it on the compute thread
(kvgraftd.engine.scheduling.forward_step): on the row-invariant forward in steps that hold
other contexts' rows too, elsewhere one context a step in forward passes up to each page
boundary (the fixed schedule). A request whose
client has left (`context.wanted()` false) stops before its next step with Cancelled; one
closed while a pass is in the batcher (at a progress report) withdraws the pass and waits for
the step computing it, so no step writes a context after its request gave it back.
`_prompt` reports how far a prompt got (ProgressEvent: at its start, then every
PROGRESS_S) when the request asked for it. It reads the engine's state (adapter, batcher,
admission, tiers, geometry) and owns none.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import closing, contextmanager

import torch

from kvgraftd.engine.attention.kv_context import KvContext
from kvgraftd.engine.requests.decoding import DecodeOptions, ProgressEvent
from kvgraftd.engine.scheduling.batcher import always
from kvgraftd.tiers.live_buffers import round_capacity

PROGRESS_S = 0.5  # how often a prompt being computed reports how far it got


class Passes:
    def _context(self, live_tokens: int = 0) -> KvContext:
        return KvContext(
            self.adapter.geometry,
            self.page_tokens,
            self.block_tokens,
            self.tiers,
            rows=self.adapter.row_invariant,
            live_tokens=live_tokens,
        )

    @contextmanager
    def _serving(
        self, is_active: Callable[[], bool] | None, live_tokens: int
    ) -> Iterator[KvContext]:
        """A request's context: admitted with `live_tokens` of live KV reserved (or queued
        while `is_active`, or refused); its passes stop once `is_active` turns false (the
        client left)."""
        reserved = round_capacity(live_tokens) * self.live_bytes_per_token
        with self.admission.admitted(is_active, reserved), self._context(live_tokens) as context:
            context.wanted = is_active or always
            yield context

    def _append(self, context: KvContext, token_ids: Sequence[int]) -> torch.Tensor:
        """Append one segment; logits at its last token (see `_appending`)."""
        steps = self._appending(context, token_ids)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def _appending(
        self, context: KvContext, token_ids: Sequence[int]
    ) -> Generator[int, None, torch.Tensor]:
        """Append one segment, yielding the tokens of it computed so far now and then
        (PROGRESS_S); returns the logits at its last token. In the batcher's steps (on the
        row-invariant forward with other contexts' passes; else up to each page boundary).
        Cancelled once the request is no longer wanted."""
        ids = list(token_ids)
        assert ids, "a segment holds at least one token"
        item = self.batcher.submit(context, ids, context.wanted)
        try:
            while True:
                try:
                    logits = item.future.result(timeout=PROGRESS_S)
                    break
                except FutureTimeout:
                    yield item.computed
        finally:
            if not item.future.done():  # closed at a report: its request is leaving
                self.batcher.withdraw(item)
        context.segment_ends.append(context.length)
        return logits

    def _prompt(
        self, context: KvContext, token_ids: Sequence[int], options: DecodeOptions, reused: int
    ) -> Generator[ProgressEvent, None, torch.Tensor]:
        """Append a prompt's tokens as one segment; with `options.progress`, a ProgressEvent
        as it starts (the grafted tokens counted as done), then every PROGRESS_S."""
        steps = self._appending(context, token_ids)
        total, last = reused + len(token_ids), time.monotonic()
        # closed at a report (the client left): `steps` is closed here, withdrawing its pass,
        # before the request gives its context back
        with closing(steps):
            if options.progress:
                yield ProgressEvent(reused, total, reused)
            while True:
                try:
                    done = next(steps)
                except StopIteration as finished:
                    return finished.value
                if options.progress and time.monotonic() - last >= PROGRESS_S:
                    last = time.monotonic()
                    yield ProgressEvent(reused + done, total, reused)
