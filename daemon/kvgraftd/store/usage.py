"""What the store knows of each artifact's use, and who is reading it now.

The cache lifecycle (kvgraftd.store.eviction) needs, for every artifact,
when it was last used (a graft, a prefix reuse, an export), how many tokens
other requests reused from it, its page bytes, and whether it is pinned;
and, to never cut a reader, which artifacts are being read. `UsageBook`
keeps all of it in memory, mirroring the catalogue: the store tells it of
every artifact added and removed, inside its own write path.

Contract:
* `lease(aid)` succeeds only for an artifact in the book; one claimed for a
  removal is waited for, and leased if the removal did not take it (a delete
  refused: pinned); until the lease is returned the artifact cannot be claimed.
  `claim(aids)` takes for removal the artifacts not leased (and marks them so
  that no new lease starts); the caller removes them, then `removed`, or
  `unclaim` if the removal failed. So a graft or an export that holds a lease
  finishes with the bytes it started with.
* Last use and reused tokens are approximate across restarts: `dirty()` hands
  the entries changed since the last call, which the store writes to its
  `usage` sub-database every `USAGE_FLUSH_S` and at close (a crash loses at
  most that much recent use; an artifact never used counts from its creation).
* `conversation_totals()`: the artifacts and page bytes of the conversation contexts
  not pinned (kvgraft.conversations), kept as the book changes: what their bound counts
  (kvgraftd.store.eviction), read at every commit without a scan.
"""

from __future__ import annotations

import struct
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvgraft.errors import FailedPrecondition, NotFound

USAGE_RECORD = struct.Struct("<qQ")  # last used unix ms, reused tokens
USAGE_FLUSH_S = 30.0
CLAIM_WAIT_S = 30.0  # a lease waits this long, at most, for a removal to end either way


@dataclass
class Usage:
    """One artifact as the cache policies see it."""

    last_used_ms: int
    reused_tokens: int
    page_bytes: int
    pinned: bool
    owner: str = ""  # the tenant whose artifact it is (kvgraft.tenancy; "": the operator)
    conversation: bool = False  # a conversation context (kvgraft.conversations)
    # The cost-aware policy's priority (GreedyDual-Size-Frequency): the book's inflation
    # at the last use plus the tokens reused from it per byte (kvgraftd.store.eviction).
    priority: float = 0.0


class UsageBook:
    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._entries: dict[bytes, Usage] = {}
        self._readers: Counter[bytes] = Counter()
        self._claimed: set[bytes] = set()
        self._dirty: set[bytes] = set()
        self.inflation = 0.0  # the priority of the last artifact evicted (cost-aware)
        self._conversations = [0, 0]  # conversation contexts not pinned: artifacts, page bytes

    def _count_conversation(self, usage: Usage, sign: int) -> None:
        """Count `usage` in (+1) or out (-1) of the conversation totals (under the lock)."""
        if usage.conversation and not usage.pinned:
            self._conversations[0] += sign
            self._conversations[1] += sign * usage.page_bytes

    # ------------------------------------------------------------------
    # the catalogue, mirrored

    def added(self, aid: bytes, usage: Usage) -> None:
        with self._lock:
            usage.priority = self.inflation + usage.reused_tokens / max(1, usage.page_bytes)
            if aid in self._entries:
                self._count_conversation(self._entries[aid], -1)
            self._entries[aid] = usage
            self._count_conversation(usage, +1)

    def removed(self, aids: Iterable[bytes]) -> dict[bytes, Usage]:
        """Take artifacts out (their entries, for `restore` if the removal fails)."""
        out: dict[bytes, Usage] = {}
        with self._lock:
            for aid in aids:
                usage = self._entries.pop(aid, None)
                if usage is not None:
                    out[aid] = usage
                    self._count_conversation(usage, -1)
                self._dirty.discard(aid)
            self._lock.notify_all()
        return out

    def restore(self, entries: dict[bytes, Usage]) -> None:
        """Put back what `removed` took out: the transaction that removed them failed."""
        with self._lock:
            for aid, usage in entries.items():
                if aid in self._entries:
                    self._count_conversation(self._entries[aid], -1)
                self._entries[aid] = usage
                self._count_conversation(usage, +1)

    def set_pinned(self, aid: bytes, pinned: bool) -> None:
        with self._lock:
            usage = self._entries.get(aid)
            if usage is not None:
                self._count_conversation(usage, -1)
                usage.pinned = pinned
                self._count_conversation(usage, +1)

    # ------------------------------------------------------------------
    # use

    def used(self, aid: bytes, now_ms: int, reused_tokens: int = 0) -> None:
        with self._lock:
            usage = self._entries.get(aid)
            if usage is not None:
                usage.last_used_ms = max(usage.last_used_ms, now_ms)
                usage.reused_tokens += reused_tokens
                usage.priority = self.inflation + usage.reused_tokens / max(1, usage.page_bytes)
                self._dirty.add(aid)

    def get(self, aid: bytes) -> Usage | None:
        with self._lock:
            usage = self._entries.get(aid)
            return None if usage is None else Usage(**vars(usage))

    def dirty(self) -> dict[bytes, bytes]:
        """Usage records changed since the last call, encoded for the `usage` sub-database."""
        with self._lock:
            entries = [(aid, self._entries.get(aid)) for aid in self._dirty]
            out = {
                aid: USAGE_RECORD.pack(usage.last_used_ms, usage.reused_tokens)
                for aid, usage in entries
                if usage is not None
            }
            self._dirty.clear()
            return out

    def snapshot(self) -> dict[bytes, Usage]:
        """Every artifact a policy may evict: not pinned, not read now, not claimed."""
        with self._lock:
            return {
                aid: Usage(**vars(usage))
                for aid, usage in self._entries.items()
                if not usage.pinned and not self._readers[aid] and aid not in self._claimed
            }

    def count(self) -> int:
        return len(self._entries)

    def totals_of(self, owner: str) -> tuple[int, int]:
        """(artifacts, page bytes) of one tenant's artifacts (pages it shares with other
        artifacts counted in each: a tenant's budget holds all it references)."""
        with self._lock:
            mine = [u.page_bytes for u in self._entries.values() if u.owner == owner]
            return len(mine), sum(mine)

    def conversation_totals(self) -> tuple[int, int]:
        """(artifacts, page bytes) of the conversation contexts not pinned (pages they share
        counted in each)."""
        with self._lock:
            return self._conversations[0], self._conversations[1]

    def inflate(self, priority: float) -> None:
        """The cost-aware policy evicted an artifact of this priority (GDSF's L)."""
        with self._lock:
            self.inflation = max(self.inflation, priority)

    # ------------------------------------------------------------------
    # readers and removal

    @contextmanager
    def lease(self, aid: bytes) -> Iterator[None]:
        """A reader's hold on `aid`. An artifact claimed for a removal is waited for (up to
        CLAIM_WAIT_S): gone after it, NotFound; kept (a delete of a pinned artifact, a
        removal that failed), the lease is taken."""
        with self._lock:
            if not self._lock.wait_for(lambda: aid not in self._claimed, CLAIM_WAIT_S):
                raise NotFound(f"artifact {aid.hex()} is being removed")
            if aid not in self._entries:
                raise NotFound(f"artifact {aid.hex()} is not in the store (evicted or deleted)")
            self._readers[aid] += 1
        try:
            yield
        finally:
            with self._lock:
                self._readers[aid] -= 1
                if not self._readers[aid]:
                    del self._readers[aid]
                self._lock.notify_all()

    def claim(self, aids: Iterable[bytes]) -> list[bytes]:
        """Take for removal those of `aids` nobody reads (and nobody else claimed)."""
        with self._lock:
            taken = [
                aid
                for aid in aids
                if aid in self._entries and not self._readers[aid] and aid not in self._claimed
            ]
            self._claimed.update(taken)
            return taken

    def claim_waiting(self, aid: bytes, timeout_s: float) -> None:
        """Claim one artifact for an explicit delete, waiting up to `timeout_s` for its
        readers to finish (FailedPrecondition after that)."""
        with self._lock:
            done = self._lock.wait_for(
                lambda: not self._readers[aid] and aid not in self._claimed, timeout_s
            )
            if not done:
                raise FailedPrecondition(
                    f"artifact {aid.hex()[:16]} is being read by {self._readers[aid]} request(s) "
                    "(a graft or an export); delete it again when they finish"
                )
            self._claimed.add(aid)

    def unclaim(self, aids: Iterable[bytes]) -> None:
        with self._lock:
            self._claimed.difference_update(aids)
            self._lock.notify_all()
