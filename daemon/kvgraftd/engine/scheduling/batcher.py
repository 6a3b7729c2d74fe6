"""Continuous batching: the forward passes of many contexts, a step at a time, on one loop.

Every request whose context needs a forward pass (its prompt, or a continuation)
hands it to the Batcher. The batcher's loop runs steps on the engine's compute
thread (kvgraftd.engine.scheduling.compute_thread; iteration-level scheduling, as in Orca and
vLLM): each step takes one row of every decoding context, then prompt chunks in
order of arrival cut to fit `max_batch_tokens`, at most `max_batch_rows` contexts,
and computes them in one forward pass of the row-invariant forward (`run_step`). A
long prompt is computed over several steps, so it never stalls the others' tokens
for more than a step. Each row's bits are those of a lone run
(docs/architecture.md), so no receipt depends on what shared a step. With one row a
step (`max_batch_rows` 1), the oldest pass alone: the fixed schedule's policy, whose
steps the engine cuts at page boundaries (`page_tokens`).

A decoding request is one pass for all its tokens (`decode`): after each step the
loop asks its `Decoder` for the next token (chosen from that step's logits, on the
loop's thread, as vLLM's model runner returns sampled tokens) and the pass stays in
line with it, so a token costs no thread hop and no step waits for a request's
thread; the request's thread reads the tokens as they come (kvgraftd.engine.requests.token_stream).

Isolation: a step that fails is run again context by context; only the
context whose own pass fails gets the error (DATA_LOSS for a corrupt page, say),
the others' rows are computed again with the same bits. Positions a failed step
wrote are not the context's until a pass ends (KvContext.end_chunk), so the
retry writes them again. A pass whose request is no longer wanted (its client
left: `wanted()` turns false) leaves before the next step with Cancelled, so a
long prompt nobody waits for stops within a step; `withdraw` does the same for a pass
whose caller is leaving and returns once no step computes it. Between two steps the
loop runs the compute thread's other jobs (a verification's passes, say).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvgraft.errors import Cancelled
from kvgraftd.engine.scheduling.compute_thread import ComputeThread

if TYPE_CHECKING:  # imported by the engine service, which a store-only daemon runs too
    import torch

log = logging.getLogger(__name__)

Step = Callable[[Sequence[tuple[object, list[int]]]], "list[torch.Tensor]"]


def always() -> bool:
    return True


def never() -> bool:
    return False


class Decoder(Protocol):
    """Chooses a decoding pass's tokens, on the loop's thread."""

    def advance(self, logits: torch.Tensor) -> int | None:
        """The next token after the step whose logits (at the pass's last token) these are,
        or None: the request has its tokens."""


@dataclass
class Pass:
    """A context's tokens to append, over as many steps as they take: `future` holds the
    logits at the last one (or the error); `computed` counts those done so far. A decoding
    pass (`decoder`) goes on with the token its decoder chooses after each step."""

    context: object
    tokens: list[int]  # still to compute
    wanted: Callable[[], bool] = always  # false once its client has left
    future: Future = field(default_factory=Future)
    arrived: float | None = field(default_factory=time.monotonic)  # None once stepped
    computed: int = 0
    decoder: Decoder | None = None
    logits: torch.Tensor | None = None  # a decoding pass's first logits, before its first token


@dataclass
class BatchCounters:
    """What the batcher did, for the metrics: steps, the contexts and tokens computed in
    them, seconds passes waited before their first step, passes now waiting."""

    steps: int = 0
    contexts: int = 0  # each step's contexts, summed
    tokens: int = 0
    queue_seconds: float = 0.0
    passes: int = 0
    waiting: int = 0
    largest_step_contexts: int = 0
    abandoned: int = 0  # passes dropped because their client left


@dataclass(frozen=True)
class BatchFigures:
    """A snapshot for the metrics: the batcher's counters, requests running and queued."""

    counters: BatchCounters
    running: int
    queued: int
    live_kv_bytes: int  # reserved by the running requests
    max_live_kv_bytes: int  # 0: unbounded


class Batcher:
    def __init__(
        self,
        run_step: Step,
        max_batch_tokens: int = 512,
        max_batch_rows: int = 64,
        compute: ComputeThread | None = None,
        chunk_limit: Callable[[object], int] | None = None,
    ) -> None:
        """`chunk_limit(context)`: at most that many tokens of the context's next step (with
        one row a step: the fixed schedule's page boundaries)."""
        if max_batch_tokens < 1 or max_batch_rows < 1:
            raise ValueError("a step holds at least one token of one context")
        self._run_step = run_step
        self.max_batch_tokens, self.max_batch_rows = max_batch_tokens, max_batch_rows
        self.compute = compute or ComputeThread()
        self._chunk_limit = chunk_limit
        self._cond = threading.Condition()
        self._waiting: list[Pass] = []  # in order of arrival
        self._looping = False  # the loop is posted to, or runs on, the compute thread
        self.counters = BatchCounters()

    def snapshot(self) -> BatchCounters:
        with self._cond:
            return dataclasses.replace(self.counters)

    def forward(
        self, context: object, tokens: Sequence[int], wanted: Callable[[], bool] = always
    ) -> torch.Tensor:
        """Append `tokens` to `context` (over as many steps as the budget needs); the logits
        at the last of them. Blocks the caller until then (Cancelled once not `wanted`)."""
        return self.submit(context, tokens, wanted).future.result()

    def submit(
        self, context: object, tokens: Sequence[int], wanted: Callable[[], bool] = always
    ) -> Pass:
        """`forward` without waiting: the pass, whose future the caller waits on."""
        item = Pass(context, list(tokens), wanted)
        if not item.tokens:
            raise ValueError("a pass holds at least one token")
        return self._queue(item)

    def decode(
        self,
        context: object,
        decoder: Decoder,
        logits: torch.Tensor,
        wanted: Callable[[], bool] = always,
    ) -> Pass:
        """A decoding pass: the loop asks `decoder` for a token from `logits` (the
        context's last), computes it, asks again with its logits, and so on until the
        decoder has them all; the future then holds the last logits (or the error)."""
        return self._queue(Pass(context, [], wanted, decoder=decoder, logits=logits))

    def _queue(self, item: Pass) -> Pass:
        with self._cond:
            self._waiting.append(item)
            self.counters.waiting = len(self._waiting)
            if not self._looping:
                self._looping = True
                self.compute.post(self._loop)
        return item

    def withdraw(self, item: Pass) -> None:
        """Its caller no longer waits for `item` (the request is leaving): it gets Cancelled
        before its next step, and this returns once no step computes it (a step in flight
        writes its context's buffers, which the caller gives back next)."""
        with self._cond:
            item.wanted = never
        futures.wait([item.future])

    # ------------------------------------------------------------------
    def _loop(self) -> None:
        """Steps while passes wait (on the compute thread, its other jobs between them)."""
        while True:
            self.compute.run_pending()
            with self._cond:
                self._drop_abandoned()
                for item in [p for p in self._waiting if p.logits is not None]:
                    logits, item.logits = item.logits, None
                    self._advance(item, logits)
                if not self._waiting:
                    self._looping = False
                    return
                step = self._take()
            try:
                self._run(step)
            except BaseException as error:  # a bug, or an interrupt: those passes fail, not all
                log.exception("a batch step failed; its %d passes get the error", len(step))
                with self._cond:
                    for item, _ in step:
                        self._finish(item, error=error)

    def _finish(self, item: Pass, result: object = None, error: BaseException | None = None):
        """`item` leaves the line with its result or error (under the lock)."""
        if item in self._waiting:
            self._waiting.remove(item)
        if not item.future.done():
            if error is not None:
                item.future.set_exception(error)
            else:
                item.future.set_result(result)

    def _advance(self, item: Pass, logits: torch.Tensor) -> None:
        """A pass whose tokens are computed: done, or (decoding) on with its next token."""
        if item.decoder is None:
            self._finish(item, logits)
            return
        try:
            token = item.decoder.advance(logits)
        except Exception as error:  # the request's, not the loop's
            self._finish(item, error=error)
            return
        if token is None:
            self._finish(item, logits)
        else:
            item.tokens = [token]

    def _drop_abandoned(self) -> None:
        """Passes whose client left get Cancelled instead of another step (under the lock)."""
        for item in [p for p in self._waiting if not p.wanted()]:
            self.counters.abandoned += 1
            self._finish(item, error=Cancelled("the client went away; its request stopped"))
        self.counters.waiting = len(self._waiting)

    def _take(self) -> list[tuple[Pass, list[int]]]:
        """This step's (pass, chunk)s within the budgets: one-token passes (decoding contexts)
        first, then prompt chunks, each group in order of arrival. While a prompt waits, the
        one-token passes leave it a row and half the tokens, so no prompt starves however
        many contexts decode (those left out are first in line next step). With one row a
        step, the oldest pass alone."""
        if self.max_batch_rows == 1:
            oldest = next(p for p in self._waiting if p.tokens)
            limit = self.max_batch_tokens
            if self._chunk_limit is not None:
                limit = min(limit, self._chunk_limit(oldest.context))
            return [(oldest, oldest.tokens[:limit])]
        decoding = [p for p in self._waiting if len(p.tokens) == 1]
        prompts = [p for p in self._waiting if len(p.tokens) > 1]
        rows, tokens = self.max_batch_rows, self.max_batch_tokens
        if prompts:
            rows, tokens = rows - 1, max(1, tokens // 2)
        step = [(item, list(item.tokens)) for item in decoding[: min(rows, tokens)]]
        rows, tokens = self.max_batch_rows - len(step), self.max_batch_tokens - len(step)
        for item in prompts:
            if not rows or not tokens:
                break
            chunk = item.tokens[:tokens]
            step.append((item, chunk))
            rows, tokens = rows - 1, tokens - len(chunk)
        return step

    def _run(self, step: list[tuple[Pass, list[int]]]) -> None:
        now = time.monotonic()
        counters = self.counters
        try:
            results = self._run_step([(item.context, chunk) for item, chunk in step])
        except Exception:  # each pass again alone: the error is one context's
            results = []
            for item, chunk in step:
                try:
                    results.extend(self._run_step([(item.context, chunk)]))
                except Exception as error:  # handed to that pass's caller
                    results.append(error)
        with self._cond:
            counters.steps += 1
            counters.contexts += len(step)
            counters.tokens += sum(len(chunk) for _, chunk in step)
            counters.largest_step_contexts = max(counters.largest_step_contexts, len(step))
            for (item, chunk), result in zip(step, results, strict=True):
                if item.arrived is not None:
                    counters.queue_seconds += now - item.arrived
                    counters.passes += 1
                    item.arrived = None
                del item.tokens[: len(chunk)]
                item.computed += len(chunk)
                if isinstance(result, Exception):
                    self._finish(item, error=result)
                elif not item.tokens:
                    self._advance(item, result)
            counters.waiting = len(self._waiting)
