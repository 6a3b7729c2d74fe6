"""A request's passes: its context admitted, its segments computed, cancellable, reported.

`Passes` is the part the Engine (kvgraftd.engine.requests.engine) holds to compute a
request's tokens; it is built from what it uses: the batcher, the admission (the engine's,
or a tenant's), a maker of contexts sized for a number of live tokens, and the live KV bytes
a position holds. `serving` admits the request (kvgraftd.engine.scheduling.admission) with
the live KV it will hold reserved (its prompt's positions not grafted whole, and
max_new_tokens) and gives it a context whose buffers are sized for that once. `appending`
appends one segment as a pass handed to the batcher, whose loop computes it on the compute
thread (kvgraftd.engine.scheduling.forward_step): on the row-invariant forward in steps that
hold other contexts' rows too, elsewhere one context a step in forward passes up to each
page boundary (the fixed schedule). A request whose client has left (`context.wanted()`
false) stops before its next step with Cancelled; one closed while a pass is in the batcher
(at a progress report) withdraws the pass and waits for the step computing it, so no step
writes a context after its request gave it back. `prompt` reports how far a prompt got
(ProgressEvent: at its start, then every PROGRESS_S) when the request asked for it. It owns
no state of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AbstractContextManager, closing, contextmanager
from typing import Protocol

import torch

from kvgraftd.engine.attention.kv_context import KvContext
from kvgraftd.engine.requests.decoding import DecodeOptions, ProgressEvent
from kvgraftd.engine.scheduling.batcher import Batcher, always
from kvgraftd.tiers.live_buffers import round_capacity

PROGRESS_S = 0.5  # how often a prompt being computed reports how far it got


class Admitting(Protocol):
    """What `Passes` asks of an admission (the engine's, or a tenant's)."""

    def admitted(
        self, is_active: Callable[[], bool] | None = None, kv_bytes: int = 0
    ) -> AbstractContextManager[None]: ...


class Passes:
    def __init__(
        self,
        batcher: Batcher,
        admission: Admitting,
        new_context: Callable[[int], KvContext],
        live_bytes_per_token: int,
    ) -> None:
        """`new_context(live_tokens)`: a fresh context with buffers for `live_tokens`."""
        self.batcher = batcher
        self.admission = admission
        self.new_context = new_context
        self.live_bytes_per_token = live_bytes_per_token

    @contextmanager
    def serving(
        self, is_active: Callable[[], bool] | None, live_tokens: int
    ) -> Iterator[KvContext]:
        """A request's context: admitted with `live_tokens` of live KV reserved (or queued
        while `is_active`, or refused); its passes stop once `is_active` turns false (the
        client left)."""
        reserved = round_capacity(live_tokens) * self.live_bytes_per_token
        with (
            self.admission.admitted(is_active, reserved),
            self.new_context(live_tokens) as context,
        ):
            context.wanted = is_active or always
            yield context

    def append(self, context: KvContext, token_ids: Sequence[int]) -> torch.Tensor:
        """Append one segment; logits at its last token (see `appending`)."""
        steps = self.appending(context, token_ids)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def appending(
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

    def prompt(
        self, context: KvContext, token_ids: Sequence[int], options: DecodeOptions, reused: int
    ) -> Generator[ProgressEvent, None, torch.Tensor]:
        """Append a prompt's tokens as one segment; with `options.progress`, a ProgressEvent
        as it starts (the grafted tokens counted as done), then every PROGRESS_S."""
        steps = self.appending(context, token_ids)
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
