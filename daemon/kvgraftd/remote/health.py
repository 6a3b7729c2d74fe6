"""The remote tier's health: what it did (counters) and whether to ask it now (a breaker).

The breaker keeps local requests off a server that is not answering:

* It starts open, with a probe of the bucket under way (the start-up check):
  until the server has answered once, reads are misses and write-through
  uploads fail at once.
* A request that fails (after its S3 client's retries) opens it: for a
  backoff that doubles from BREAKER_MIN_S up to BREAKER_MAX_S, `available()`
  is False, so reads are misses at once and local serving never waits on a
  dead server; `require()` raises Unavailable for callers that must not go on.
* When the backoff has passed, the next `available()` starts one probe on a
  thread of its own (the `probe` callable: one list request, one attempt) and
  still answers False: a request is never the probe, so no request waits on a
  server that has just failed. The probe's success closes the breaker; its
  failure opens it again for the next, doubled, backoff.

The failure is logged once per outage (the status RPC shows the latest, from
the counters); the first success after a failure says so. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

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
    """Closed while the server answers; `where` names the server in messages; `probe()`
    asks the server once and reports to the breaker (`succeeded` or `failed`)."""

    def __init__(self, counters: RemoteCounters, where: str, probe: Callable[[], object]) -> None:
        self._counters = counters
        self._where = where
        self._probe = probe
        self._lock = threading.Lock()
        self._closed = False  # not until the server has answered once
        self._down_until = 0.0
        self._backoff_s = BREAKER_MIN_S
        self._failed_once = False  # an outage was logged: its end is logged too
        self._probing: threading.Thread | None = None
        self.probe_error: BaseException | None = None  # why the last probe raised

    @property
    def closed(self) -> bool:
        """Whether the server answered last time it was asked (no side effect)."""
        return self._closed

    def available(self) -> bool:
        """Whether to ask the server now; when not, a probe starts if one is due."""
        if self._closed:
            return True
        with self._lock:
            if self._closed:
                return True
            if time.monotonic() >= self._down_until:
                self._start_probe()
        return False

    def probe_now(self) -> threading.Thread:
        """Start a probe unless one is under way; the probe (the start-up check joins it a
        while, then reads `probe_error`)."""
        with self._lock:
            return self._start_probe()

    def _start_probe(self) -> threading.Thread:
        if self._probing is None:
            self._probing = threading.Thread(
                target=self._run_probe, name="remote-probe", daemon=True
            )
            self._probing.start()
        return self._probing

    def _run_probe(self) -> None:
        try:
            self._probe()
            self.probe_error = None
        except Exception as exc:  # a probe's outcome is the breaker's state, not a crash
            self.probe_error = exc
            self.failed("check", exc)
        finally:
            with self._lock:
                self._probing = None

    def retry_in_s(self) -> float:
        if self._closed:
            return 0.0
        return max(0.0, self._down_until - time.monotonic())

    def require(self) -> None:
        """Raise Unavailable while the breaker is open."""
        if not self.available():
            cause = self._counters.last_error or "it has not answered yet"
            when = (
                "a check is under way"
                if self._probing is not None
                else f"next check in {self.retry_in_s():.0f} s"
            )
            raise Unavailable(f"the remote tier ({self._where}) is unreachable ({cause}); {when}")

    def succeeded(self) -> None:
        if self._closed:
            return
        with self._lock:
            if not self._closed and self._failed_once:
                log.info("the remote tier answers again")
            self._closed = True
            self._failed_once = False
            self._down_until = 0.0
            self._backoff_s = BREAKER_MIN_S

    def failed(self, what: str, exc: BaseException) -> None:
        detail = describe(exc)
        with self._lock:
            first = not self._failed_once
            self._closed = False
            self._failed_once = True
            self._down_until = time.monotonic() + self._backoff_s
            self._backoff_s = min(BREAKER_MAX_S, 2 * self._backoff_s)
            self._counters.last_error = f"{what}: {detail}"
            self._counters.last_error_unix_ms = int(time.time() * 1000)
        if first:  # once per outage; the status RPC shows the latest
            log.warning(
                "the remote tier failed (%s: %s); until it answers again, reads are misses, "
                "write-through uploads fail and write-back ones wait",
                what,
                detail,
            )
