"""Admission: how many requests run at once, and the live KV they may hold together.

`Admission` bounds the contexts in flight (`max_running`) and the live KV they
may hold together (`max_live_kv_bytes`, each request's reserved when it is
admitted): beyond either, requests wait their turn in order (until their
client leaves); beyond `max_queued` waiting, they are refused at once with
RESOURCE_EXHAUSTED, as is a request that alone needs more than the budget.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvgraft.errors import Cancelled, ResourceExhausted

QUEUE_POLL_S = 0.25  # how often a queued request looks whether its client is still there


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
