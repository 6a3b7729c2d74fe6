"""Batches of block partials computed on worker threads, merged in the order submitted.

A step's blocks go to the native kernel in batches (kvgraftd.engine.model.decode_attention),
on the tiers' attention workers; the online softmax must fold their partials in block
order, or the logits would depend on which thread finished first (docs/architecture.md,
contract 5). The BlockGather (kvgraftd.engine.attention.block_gather) hands its batches
to one of these:

* `OrderedPartials(workers, window, merge)`: at most `window` batches in flight; each
  result merged in submission order as the window moves; leaving the `with` block merges
  what is left, and leaving it by an exception first waits for every task still running
  (they read pages and slots the caller is about to let go, some where they lie in the
  store's mappings).
* `InlinePartials(merge)`: the same merges, each batch computed on the calling thread at
  once (a step of one batch, where a hand-off would only cost).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait

from kvgraftd.engine.model.decode_attention import Partials


class OrderedPartials:
    """Batches of block partials computed on worker threads and merged in the order they
    were submitted.

    At most `window` batches are in flight. Leaving the `with` block merges what is
    left; leaving it by an exception first waits for every task still
    running (they read pages and slots the caller is about to let go).
    """

    def __init__(self, workers: Executor, window: int, merge: Callable[[Partials], None]) -> None:
        self._workers, self._window, self._merge = workers, window, merge
        self._pending: deque[Future] = deque()

    def submit(self, compute: Callable[..., Partials], *args: object) -> None:
        self._pending.append(self._workers.submit(compute, *args))
        if len(self._pending) > self._window:
            self._merge(self._pending.popleft().result())

    def drain(self) -> None:
        while self._pending:
            self._merge(self._pending.popleft().result())

    def __enter__(self) -> OrderedPartials:
        return self

    def settle(self) -> None:
        """Wait until no task is running (after an error: they read pages and slots the
        caller is about to let go); what they computed is dropped."""
        wait(self._pending)
        self._pending.clear()

    def __exit__(self, exc_type: type | None, *_: object) -> None:
        try:
            if exc_type is None:
                self.drain()
        finally:  # a task that failed, or the caller's error: let every other task end
            self.settle()


class InlinePartials(OrderedPartials):
    """OrderedPartials that computes each batch on the calling thread, at once: for a step of
    one batch, where handing it to a worker would only add the hand-off (the same merge
    order, so the same bits)."""

    def __init__(self, merge: Callable[[Partials], None]) -> None:
        super().__init__(None, 0, merge)

    def submit(self, compute: Callable[..., Partials], *args: object) -> None:
        self._merge(compute(*args))
