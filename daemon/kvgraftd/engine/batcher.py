"""Continuous batching: the forward passes of many contexts, a step at a time.

Every request whose context needs a forward pass (its prompt, or one generated
token) hands it to the Batcher and waits. The batcher's thread runs steps
(iteration-level scheduling, as in Orca and vLLM): each step takes one row of
every decoding context, then prompt chunks in order of arrival cut to fit
`max_batch_tokens`, at most `max_batch_rows` contexts, and computes them in one
forward pass of the row-invariant forward (`run_step`: Engine's batch on the
compute thread). A long prompt is computed over several steps, so it never
stalls the others' tokens for more than a step. Each row's bits are those of a
lone run (docs/architecture.md), so no receipt depends on what shared a step.

Before a step, the batcher waits up to `gather_s` for every context in flight
(`joined`) to hand in its next pass: a decoding context is away only while its
token is chosen and sent, and waiting that long makes full steps, not ragged
ones.

Isolation: a step that fails is run again context by context; only the
context whose own pass fails gets the error (DATA_LOSS for a corrupt page, say),
the others' rows are computed again with the same bits. Positions a failed step
wrote are not the context's until a pass ends (KvContext.end_chunk), so the
retry writes them again. A pass whose request is no longer wanted (its client
left: `wanted()` turns false) leaves before the next step with Cancelled, so a
long prompt nobody waits for stops within a step; `withdraw` does the same for a pass
whose caller is leaving and returns once no step computes it.

`Admission` bounds the contexts in flight (`max_running`) and the live KV they
may hold together (`max_live_kv_bytes`, each request's reserved when it is
admitted): beyond either, requests wait their turn in order (until their
client leaves); beyond `max_queued` waiting, they are refused at once with
RESOURCE_EXHAUSTED, as is a request that alone needs more than the budget.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvgraft.errors import Cancelled, ResourceExhausted

if TYPE_CHECKING:  # imported by the engine service, which a store-only daemon runs too
    import torch

log = logging.getLogger(__name__)
QUEUE_POLL_S = 0.25  # how often a queued request looks whether its client is still there

Step = Callable[[Sequence[tuple[object, list[int]]]], "list[torch.Tensor]"]


def always() -> bool:
    return True


def never() -> bool:
    return False


@dataclass
class Pass:
    """A context's tokens to append, over as many steps as they take: `future` holds the
    logits at the last one (or the error); `computed` counts those done so far."""

    context: object
    tokens: list[int]  # still to compute
    wanted: Callable[[], bool] = always  # false once its client has left
    future: Future = field(default_factory=Future)
    arrived: float | None = field(default_factory=time.monotonic)  # None once stepped
    computed: int = 0


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
        gather_s: float = 0.002,
    ) -> None:
        if max_batch_tokens < 1 or max_batch_rows < 1:
            raise ValueError("a step holds at least one token of one context")
        self._run_step = run_step
        self.max_batch_tokens, self.max_batch_rows = max_batch_tokens, max_batch_rows
        self._gather_s = gather_s
        self._cond = threading.Condition()
        self._waiting: list[Pass] = []  # in order of arrival
        self._joined = 0
        self._thread: threading.Thread | None = None
        self.counters = BatchCounters()

    def snapshot(self) -> BatchCounters:
        with self._cond:
            return dataclasses.replace(self.counters)

    @contextmanager
    def joined(self) -> Iterator[None]:
        """A context in flight: steps wait (up to gather_s) for its next pass."""
        with self._cond:
            self._joined += 1
        try:
            yield
        finally:
            with self._cond:
                self._joined -= 1
                self._cond.notify_all()

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
        with self._cond:
            self._waiting.append(item)
            self.counters.waiting = len(self._waiting)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="batcher", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return item

    def withdraw(self, item: Pass) -> None:
        """Its caller no longer waits for `item` (the request is leaving): it gets Cancelled
        before its next step, and this returns once no step computes it (a step in flight
        writes its context's buffers, which the caller gives back next)."""
        with self._cond:
            item.wanted = never
            self._cond.notify_all()
        futures.wait([item.future])

    # ------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._waiting:
                    self._cond.wait()
                deadline = time.monotonic() + self._gather_s
                while len(self._waiting) < self._joined and time.monotonic() < deadline:
                    self._cond.wait(max(0.0, deadline - time.monotonic()))
                self._drop_abandoned()
                if not self._waiting:
                    continue
                step = self._take()
            try:
                self._run(step)
            except BaseException as error:  # a bug, or an interrupt: those passes fail, not all
                log.exception("a batch step failed; its %d passes get the error", len(step))
                with self._cond:
                    for item, _ in step:
                        if item in self._waiting:
                            self._waiting.remove(item)
                        if not item.future.done():
                            item.future.set_exception(error)

    def _drop_abandoned(self) -> None:
        """Passes whose client left get Cancelled instead of another step (under the lock)."""
        for item in [p for p in self._waiting if not p.wanted()]:
            self._waiting.remove(item)
            self.counters.abandoned += 1
            item.future.set_exception(Cancelled("the client went away; its request stopped"))
        self.counters.waiting = len(self._waiting)

    def _take(self) -> list[tuple[Pass, list[int]]]:
        """This step's (pass, chunk)s within the budgets: one-token passes (decoding contexts)
        first, then prompt chunks, each group in order of arrival. While a prompt waits, the
        one-token passes leave it a row and half the tokens, so no prompt starves however
        many contexts decode (those left out are first in line next step). With one row a
        step, the oldest pass alone."""
        if self.max_batch_rows == 1:
            oldest = self._waiting[0]
            return [(oldest, oldest.tokens[: self.max_batch_tokens])]
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
                    self._waiting.remove(item)
                    item.future.set_exception(result)
                elif not item.tokens:
                    self._waiting.remove(item)
                    item.future.set_result(result)
            counters.waiting = len(self._waiting)


class Admission:
    """At most `max_running` requests in flight, holding at most `max_live_kv_bytes` of live
    KV together (0: no bound); up to `max_queued` more wait in order."""

    def __init__(self, max_running: int, max_queued: int, max_live_kv_bytes: int = 0) -> None:
        self.max_running, self.max_queued = max_running, max_queued
        self.max_live_kv_bytes = max_live_kv_bytes
        self._cond = threading.Condition()
        self._running = 0
        self._live_kv_bytes = 0
        self._queue: list[object] = []

    @property
    def running(self) -> int:
        return self._running

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def live_kv_bytes(self) -> int:
        """Live KV reserved by the requests running now."""
        return self._live_kv_bytes

    def _fits(self, kv_bytes: int) -> bool:
        room = not self.max_live_kv_bytes or (
            self._live_kv_bytes + kv_bytes <= self.max_live_kv_bytes
        )
        return self._running < self.max_running and room

    @contextmanager
    def admitted(
        self, is_active: Callable[[], bool] | None = None, kv_bytes: int = 0
    ) -> Iterator[None]:
        """Hold a place (and `kv_bytes` of the live KV budget) for the body; wait in line for
        one (giving up when `is_active` turns false: the client left), or raise
        ResourceExhausted when the line is full or the request alone exceeds the budget."""
        if self.max_live_kv_bytes and kv_bytes > self.max_live_kv_bytes:
            raise ResourceExhausted(
                f"this request needs {kv_bytes / 2**20:.0f} MiB of live KV (its prompt and "
                f"max_new_tokens), more than max_live_kv_bytes={self.max_live_kv_bytes / 2**20:.0f}"
                " MiB lets all requests hold: shorten it, ask for fewer new tokens, or raise "
                "max_live_kv_bytes in the daemon's config"
            )
        ticket = object()
        with self._cond:
            if not self._fits(kv_bytes) or self._queue:
                if len(self._queue) >= self.max_queued:
                    raise ResourceExhausted(
                        f"the engine is busy: {self._running} requests running and "
                        f"{len(self._queue)} waiting (max_running_contexts="
                        f"{self.max_running}, max_queued_requests={self.max_queued}, "
                        f"{self._live_kv_bytes / 2**20:.0f} MiB of live KV held of "
                        f"max_live_kv_bytes={self.max_live_kv_bytes / 2**20:.0f} MiB); "
                        "retry later, or raise those limits in the daemon's config"
                    )
                self._queue.append(ticket)
                try:
                    while not self._fits(kv_bytes) or self._queue[0] is not ticket:
                        self._cond.wait(QUEUE_POLL_S)
                        if is_active is not None and not is_active():
                            raise Cancelled("the request was cancelled while queued")
                finally:
                    self._queue.remove(ticket)
                    self._cond.notify_all()  # the next in line may be the head now
            self._running += 1
            self._live_kv_bytes += kv_bytes
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._live_kv_bytes -= kv_bytes
                self._cond.notify_all()
