"""What the uploads in progress may hold together: memory, and staged disk per connection.

kvgraftd.store.intake bounds each PutArtifact stream by itself (`spill_bytes` of verified
pages in memory, beyond which they are staged; unfinished pages up to max(spill_bytes,
64 MiB)), and the store bounds the staged pages of all uploads together, exactly, in the
transaction that stages them (`staged_max_bytes`, kvgraftd.store.staging). This module
bounds what no single stream can see:

* `UploadMemory`: the page bytes every upload in progress holds in memory (verified
  pages waiting for their manifest, the bytes of pages still arriving in pieces), at
  most `limit_bytes` together. `hold(n)` counts bytes already in memory and says whether
  everything held still fits: when not, the intake stages its verified pages (they go to
  disk, their memory back). `try_hold(n)` counts bytes only if they fit: the intake asks
  it before keeping a piece of an unfinished page, which cannot be staged, and refuses
  the upload when even its own staging leaves no room. When the uploads have given all
  their memory back after holding more than TRIM_AFTER_BYTES, the C allocator is asked
  to hand its free memory back to the system (glibc's malloc_trim): the messages and
  partial pages of a burst of uploads otherwise stay resident in its heaps.
* `StagedByConnection`: the disk a client host's uploads have staged and no manifest has
  claimed yet, counted for `ttl_s` from staging (when the daemon collects what is left),
  at most `limit_bytes` per host, so that one client cannot take the whole of
  staged_max_bytes. `charge` refuses (ResourceExhausted) pages that would pass it;
  `credit` takes off what a manifest claimed. The key is the peer's host without its
  port (kvgraftd.server.limits.peer_host): a client opening one connection after another
  draws on one quota; over a Unix socket every client is the same one.
* `CollectionPace`: staged pages past their TTL are collected when they stand in an
  upload's way, at most once every COLLECT_EVERY_S: a storm of refused uploads must not
  scan the staged pages each time.

All are thread-safe and in memory only: uploads and connections end with the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvgraft.errors import ResourceExhausted

log = logging.getLogger(__name__)

TRIM_AFTER_BYTES = 64 << 20  # a burst this large is worth a malloc_trim once it is over
COALESCE_S = 1.0  # charges this close together are one entry (bounds the entries per peer)
COLLECT_EVERY_S = 5.0  # collections on behalf of a refused upload, at most this often


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None on a C library without it."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None).malloc_trim
    except (AttributeError, OSError):
        return None


class UploadMemory:
    """Page bytes held in memory by every upload in progress (see the module)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        self._held = 0
        self._peak = 0  # the most held since the last trim
        self._trim = _malloc_trim()
        self.trims = 0  # malloc_trim calls (tests read it)

    @property
    def held(self) -> int:
        with self._lock:
            return self._held

    def hold(self, nbytes: int) -> bool:
        """Count `nbytes` the caller already holds; whether all held is within the limit."""
        with self._lock:
            self._held += nbytes
            self._peak = max(self._peak, self._held)
            return self._held <= self.limit_bytes

    def try_hold(self, nbytes: int) -> bool:
        """Count `nbytes` more only if all held stays within the limit; whether it did."""
        with self._lock:
            if self._held + nbytes > self.limit_bytes:
                return False
            self._held += nbytes
            self._peak = max(self._peak, self._held)
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._held -= nbytes
            trim = not self._held and self._peak > TRIM_AFTER_BYTES
            if trim:
                self._peak = 0
        if trim and self._trim is not None:
            self._trim(0)
            self.trims += 1


@dataclass
class _Charge:
    at: float  # when the pages were staged (the clock's seconds)
    nbytes: int


class StagedByConnection:
    """Staged disk per connection within `ttl_s` (see the module). `limit_name` is the
    setting the limit comes from, for the refusal."""

    def __init__(
        self,
        limit_bytes: int,
        ttl_s: float,
        limit_name: str = "staged_max_bytes_per_connection",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit_bytes = limit_bytes
        self._ttl_s = ttl_s
        self._limit_name = limit_name
        self._clock = clock
        self._lock = threading.Lock()
        self._charges: dict[str, deque[_Charge]] = {}

    def held(self, connection: str) -> int:
        with self._lock:
            self._expire(self._clock())
            return sum(charge.nbytes for charge in self._charges.get(connection, ()))

    def charge(self, connection: str, nbytes: int) -> None:
        """Count `nbytes` of pages `connection` is about to stage; refused past the limit.
        The empty connection (the daemon's own pulls) is not counted; a limit of 0 is none."""
        if not nbytes or not connection or not self.limit_bytes:
            return
        with self._lock:
            now = self._clock()
            self._expire(now)
            charges = self._charges.get(connection, deque())
            held = sum(charge.nbytes for charge in charges)
            if held + nbytes > self.limit_bytes:
                raise ResourceExhausted(
                    f"the uploads from this client's host hold {held} bytes of pages staged "
                    f"without their manifest; these {nbytes} would pass its limit of "
                    f"{self.limit_bytes} ({self._limit_name}): send each upload's manifest, or "
                    f"resend after staged_ttl_s ({self._ttl_s:g} s), when unclaimed pages "
                    "are collected"
                )
            if charges and now - charges[-1].at < COALESCE_S:
                charges[-1].nbytes += nbytes
            else:
                charges.append(_Charge(now, nbytes))
            self._charges[connection] = charges

    def credit(self, connection: str, nbytes: int) -> None:
        """`nbytes` of what `connection` staged were claimed (or never written): the
        latest charges give them back."""
        with self._lock:
            charges = self._charges.get(connection)
            while charges and nbytes > 0:
                taken = min(nbytes, charges[-1].nbytes)
                charges[-1].nbytes -= taken
                nbytes -= taken
                if not charges[-1].nbytes:
                    charges.pop()
            if charges is not None and not charges:
                del self._charges[connection]

    def _expire(self, now: float) -> None:
        """Forget the charges older than the TTL (the pages are collected by then), and the
        connections left with none."""
        for connection in list(self._charges):
            charges = self._charges[connection]
            while charges and now - charges[0].at >= self._ttl_s:
                charges.popleft()
            if not charges:
                del self._charges[connection]


class CollectionPace:
    """Whether a refused upload may have the staged pages collected now (see the module)."""

    def __init__(self, every_s: float = COLLECT_EVERY_S) -> None:
        self._every_s = every_s
        self._lock = threading.Lock()
        self._last = -math.inf

    def due(self) -> bool:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self._every_s:
                return False
            self._last = now
            return True


@dataclass(frozen=True)
class UploadBounds:
    """Everything an upload is held to, shared by the uploads of one daemon."""

    spill_bytes: int  # verified page bytes one upload holds in memory before staging them
    staged_max_bytes: int  # the staged disk of all uploads together (0: no limit)
    staged_ttl_s: float  # how long unclaimed staged pages are kept
    memory: UploadMemory
    staged: StagedByConnection
    running_s: float = math.inf  # how long an upload may run (max_call_s): its pages are kept
    collections: CollectionPace = field(default_factory=CollectionPace)

    @classmethod
    def of(
        cls,
        *,
        spill_bytes: int,
        staged_max_bytes: int,
        staged_ttl_s: float,
        memory_bytes: int,
        staged_per_connection: int,
        budget_bytes: int = 0,
        running_s: float = math.inf,
    ) -> UploadBounds:
        """The bounds of a daemon's settings. With a store budget, no connection stages
        more than the budget: an artifact larger could never be stored."""
        per_connection, name = staged_per_connection, "staged_max_bytes_per_connection"
        if budget_bytes and (not per_connection or budget_bytes < per_connection):
            per_connection, name = budget_bytes, "store_budget_bytes"
        return cls(
            spill_bytes,
            staged_max_bytes,
            staged_ttl_s,
            UploadMemory(memory_bytes),
            StagedByConnection(per_connection, staged_ttl_s, name),
            running_s,
        )
