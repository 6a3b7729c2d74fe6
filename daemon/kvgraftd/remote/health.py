"""The remote tier's health: what it did (counters) and whether to try it now (a breaker).

A request that fails after botocore's own retries opens the breaker: for a
backoff that doubles from BREAKER_MIN_S up to BREAKER_MAX_S, `available()` is
False, so reads are misses at once and local serving never waits on a dead
server; `require()` raises Unavailable for callers that must not go on. The
failure is logged once per outage (the status RPC shows the latest, from the
counters); the first success closes the breaker and says so. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time

from kvgraft.errors import Unavailable
from kvgraftd.remote.s3 import describe

log = logging.getLogger("kvgraftd.remote.tier")

BREAKER_MIN_S = 1.0
BREAKER_MAX_S = 30.0


class RemoteCounters:
    """What the tier did since the daemon started (`add` from any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.hits = self.misses = self.corrupt = 0  # object reads: chains, manifests, pages
        self.page_misses = 0  # page reads that found no intact page
        self.pages_up = self.bytes_up = self.artifacts_up = 0
        self.pages_down = self.bytes_down = 0
        self.last_error = ""
        self.last_error_unix_ms = 0

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)


class Breaker:
    """Open for a growing backoff after a failure; `where` names the server in messages."""

    def __init__(self, counters: RemoteCounters, where: str) -> None:
        self._counters = counters
        self._where = where
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff_s = BREAKER_MIN_S

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def retry_in_s(self) -> float:
        return max(0.0, self._down_until - time.monotonic())

    def require(self) -> None:
        """Raise Unavailable while the breaker is open."""
        if not self.available():
            raise Unavailable(
                f"the remote tier ({self._where}) is "
                f"unreachable ({self._counters.last_error}); next attempt in "
                f"{self.retry_in_s():.0f} s"
            )

    def succeeded(self) -> None:
        if self._down_until:
            with self._lock:
                if self._down_until:
                    log.info("the remote tier answers again")
                self._down_until = 0.0
                self._backoff_s = BREAKER_MIN_S

    def failed(self, what: str, exc: BaseException) -> None:
        detail = describe(exc)
        with self._lock:
            first = not self._down_until
            self._down_until = time.monotonic() + self._backoff_s
            self._backoff_s = min(BREAKER_MAX_S, 2 * self._backoff_s)
            self._counters.last_error = f"{what}: {detail}"
            self._counters.last_error_unix_ms = int(time.time() * 1000)
        if first:  # once per outage; the status RPC shows the latest
            log.warning(
                "the remote tier failed (%s: %s); reads are misses and writes wait until it "
                "answers again",
                what,
                detail,
            )
