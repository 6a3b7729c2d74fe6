"""Budgets and eviction: the store keeps itself within `store_budget_bytes`.

What counts: the bytes of the segment files' live pages (block-aligned, the
disk the store's pages take) and, optionally, the number of artifacts. Past
the high watermark (`high` of a budget) the keeper's thread evicts unpinned
artifacts nobody is reading until the store is back under the low watermark;
a commit that would take the store past the budget itself first evicts
(`make_room`), so a write fails only when eviction cannot make room:
ResourceExhausted, saying what holds the budget (artifacts pinned, being
read, or kept by `keep`: the remote tier's, not yet uploaded).

Conversation contexts (kvgraft.conversations: what chat_cache / cache = "auto" keeps)
have a bound of their own, `conversation_bytes`: the page bytes of those not pinned
(pages they share counted in each, so the disk they take is at most that), kept by
the same watermarks; a commit first brings them back under it, the keeper after it.
The bound holds them all together, whichever tenant owns them. Whatever the policy,
they go before any other artifact, for either budget: a context the daemon kept by
itself is worth less than one somebody deposited.

Policies (the order artifacts go in, conversation contexts first; docs/architecture.md
says why):
* `lru`: least recently used first (last graft, prefix reuse or export; an
  artifact never used counts from its creation).
* `cost-aware`: GreedyDual-Size-Frequency. An artifact's priority is the
  book's inflation at its last use plus the tokens other requests reused from
  it per byte it holds; the lowest goes first and the inflation rises to its
  priority, so what was valuable long ago ages out. An artifact nobody reused
  (a one-off context kept by cache = "auto") goes before a shared prefix.

Removal is kvgraftd.store.lifecycle's (batches of `BATCH` in one transaction,
never an artifact being read). The `CacheKeeper` thread also deletes expired
pins and writes last uses every USAGE_FLUSH_S.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvgraft.errors import InvalidArgument, ResourceExhausted
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store.usage import USAGE_FLUSH_S, Usage

log = logging.getLogger(__name__)

POLICIES = ("lru", "cost-aware")
BATCH = 64  # artifacts removed per transaction
# Conversation contexts' bound when none is configured and the store has no budget: a
# tenth of the data disk, so that a busy day of chats never fills it, and at most 4 GiB
# (about 1,400 of the default model's 64-token pages; raise it for larger models).
CONVERSATION_DISK_SHARE = 10
CONVERSATION_BYTES_MOST = 4 << 30


@dataclass(frozen=True)
class CacheBudget:
    bytes: int = 0  # 0: no byte budget
    artifacts: int = 0  # 0: no count budget
    high: float = 0.95
    low: float = 0.85
    policy: str = "lru"
    conversation_bytes: int = 0  # 0: conversation contexts have no bound of their own

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidArgument(f"eviction_policy must be one of {', '.join(POLICIES)}")
        if not 0 < self.low < self.high <= 1:
            raise InvalidArgument("eviction watermarks need 0 < low < high <= 1")

    @property
    def enabled(self) -> bool:
        return bool(self.bytes or self.artifacts)


NO_BUDGET = CacheBudget()


def conversation_budget(configured: int, store_budget_bytes: int, data: Path) -> int:
    """The conversation contexts' bound: `configured` where given (not 0), else the store's
    budget where one is set (they go first within it), else a tenth of the size of the
    disk holding `data` (measured now, at start), at most CONVERSATION_BYTES_MOST."""
    if configured:
        return configured
    if store_budget_bytes:
        return store_budget_bytes
    disk = shutil.disk_usage(data).total // CONVERSATION_DISK_SHARE
    return max(1, min(disk, CONVERSATION_BYTES_MOST))


@dataclass
class EvictionCounters:
    artifacts: int = 0
    bytes: int = 0
    expired: int = 0


def eviction_order(candidates: dict[bytes, Usage], policy: str) -> list[bytes]:
    """The candidates in the order `policy` evicts them, conversation contexts first."""
    if policy == "lru":
        key = lambda aid: (  # noqa: E731
            not candidates[aid].conversation,
            candidates[aid].last_used_ms,
            aid,
        )
    else:
        key = lambda aid: (  # noqa: E731
            not candidates[aid].conversation,
            candidates[aid].priority,
            candidates[aid].last_used_ms,
            aid,
        )
    return sorted(candidates, key=key)


class Evictor:
    """Keeps `store` (a kvgraftd.store.artifact_store.Store) within `budget`."""

    def __init__(self, store, budget: CacheBudget) -> None:
        self.store = store
        self.budget = budget
        self.counters = EvictionCounters()
        # What must not be evicted yet, besides pins and readers (the remote tier's
        # artifacts not yet uploaded), and what a refused write says of them: a phrase
        # following "N artifacts (B bytes)", then what to do.
        self.keep: Callable[[bytes], bool] = lambda aid: False
        self.kept_because = ("", "")
        # (artifacts, page bytes) of the conversation contexts not pinned: the store's
        # Lifecycle sets it from its usage book (kvgraftd.store.lifecycle); a tenant's
        # view has none of its own (the store's bound holds every tenant's).
        self.conversation_totals: Callable[[], tuple[int, int]] = lambda: (0, 0)

    def over(self, fraction: float, incoming_bytes: int = 0, incoming_artifacts: int = 0) -> bool:
        artifacts, live = self.store.cache_totals()
        budget = self.budget
        return bool(
            (budget.bytes and live + incoming_bytes > fraction * budget.bytes)
            or (budget.artifacts and artifacts + incoming_artifacts > self._count(fraction))
        )

    def _count(self, fraction: float) -> int:
        """A watermark of the artifact budget, in whole artifacts (at least one)."""
        return max(1, int(fraction * self.budget.artifacts))

    def conversations_over(self, fraction: float) -> bool:
        """Whether the conversation contexts are past `fraction` of their bound."""
        return self._conversation_excess(fraction)[0] > 0

    def _conversation_excess(self, fraction: float) -> tuple[float, int]:
        bound = self.budget.conversation_bytes
        return (self.conversation_totals()[1] - fraction * bound if bound else 0), 0

    def make_room(self, incoming_bytes: int) -> None:
        """Before a commit of `incoming_bytes` of new pages: conversation contexts past
        their bound back under its low watermark; then evict down to the low watermark if
        the commit would pass the budget; ResourceExhausted if nothing more can go."""
        if self.conversations_over(1.0):  # never refused for them: the keeper tries again
            self.evict_conversations(self.budget.low)
        if not self.budget.enabled or not self.over(1.0, incoming_bytes, 1):
            return
        if self.budget.bytes and incoming_bytes > self.budget.bytes:
            raise ResourceExhausted(
                f"this artifact's {incoming_bytes} new bytes exceed store_budget_bytes="
                f"{self.budget.bytes}: raise the budget to keep contexts this long"
            )
        artifacts, live = self.store.cache_totals()
        evictable = self.store.evictable()
        candidates = {aid: u for aid, u in evictable.items() if not self.keep(aid)}
        most = sum(usage.page_bytes for usage in candidates.values())  # shared pages: less
        if (self.budget.bytes and live - most + incoming_bytes > self.budget.bytes) or (
            self.budget.artifacts and artifacts - len(candidates) + 1 > self.budget.artifacts
        ):  # evicting everything evictable would not make room
            raise ResourceExhausted(self._held_by(evictable, candidates))
        self.evict(self.budget.low, incoming_bytes, 1, candidates)
        if self.over(1.0, incoming_bytes, 1):
            evictable = self.store.evictable()
            raise ResourceExhausted(
                self._held_by(evictable, {a: u for a, u in evictable.items() if not self.keep(a)})
            )

    def _candidates(self) -> dict[bytes, Usage]:
        return {aid: u for aid, u in self.store.evictable().items() if not self.keep(aid)}

    def _held_by(self, evictable: dict[bytes, Usage], candidates: dict[bytes, Usage]) -> str:
        """Why a write finds no room: what holds the budget, and what to do."""
        kept = [u for aid, u in evictable.items() if aid not in candidates]
        fixed = self.store.cache_totals()[0] - len(evictable)  # pinned, read or going
        holders, remedies = [], []
        if kept:
            phrase, remedy = self.kept_because
            kept_bytes = sum(u.page_bytes for u in kept)
            holders.append(f"{len(kept)} artifacts ({kept_bytes} bytes) {phrase}")
            remedies.append(remedy)
        if fixed or not kept:
            holders.append(f"pinned artifacts and ones being read ({fixed})")
            remedies.append("unpin some (kvgraft pin --off ID)")
        return (
            f"the store's budget (store_budget_bytes={self.budget.bytes}, "
            f"store_budget_artifacts={self.budget.artifacts}) is held by "
            f"{' and by '.join(holders)}: {'; '.join(remedies)}; or raise a budget"
        )

    def evict(
        self,
        fraction: float,
        incoming_bytes: int = 0,
        incoming_artifacts: int = 0,
        candidates: dict[bytes, Usage] | None = None,
    ) -> int:
        """Evict in policy order until under `fraction` of the budgets; returns artifacts.
        The candidates (default: every artifact evictable now) are ordered once; one read or
        claimed since is skipped by `remove`."""
        if candidates is None:
            candidates = self._candidates()
        return self._evict_in_order(
            candidates, lambda: self._excess(fraction, incoming_bytes, incoming_artifacts)
        )

    def evict_conversations(self, fraction: float) -> int:
        """Evict conversation contexts in policy order until under `fraction` of their
        bound; returns artifacts (those being read stay: the keeper tries again)."""
        candidates = {aid: u for aid, u in self._candidates().items() if u.conversation}
        excess = lambda: self._conversation_excess(fraction)  # noqa: E731
        return self._evict_in_order(candidates, excess, "conversation contexts")

    def _excess(self, fraction: float, incoming_bytes: int, incoming: int) -> tuple[float, int]:
        """(bytes, artifacts) past `fraction` of the budgets, with what is incoming."""
        artifacts, live = self.store.cache_totals()
        budget = self.budget
        excess_bytes = live + incoming_bytes - fraction * budget.bytes if budget.bytes else 0
        excess_count = artifacts + incoming - self._count(fraction) if budget.artifacts else 0
        return excess_bytes, excess_count

    def _evict_in_order(
        self,
        candidates: dict[bytes, Usage],
        excess: Callable[[], tuple[float, int]],
        what: str = "artifacts",
    ) -> int:
        """Remove `candidates` in policy order, in batches, while `excess()` is above zero."""
        queue = deque(eviction_order(candidates, self.budget.policy))
        evicted = 0
        # No lock: the keeper and a commit making room may evict at once (each claims its
        # own victims, and the store's transactions are serialized).
        while queue:
            excess_bytes, excess_count = excess()
            if excess_bytes <= 0 and excess_count <= 0:
                break
            batch = _victims(queue, candidates, excess_bytes, excess_count)
            if self.budget.policy == "cost-aware":  # GDSF: the rest age past this one
                self.store.raise_inflation(max(candidates[aid].priority for aid in batch))
            count, freed = self.store.remove(batch, pb.ChangeRecord.REASON_EVICTED)
            self.counters.artifacts += count
            self.counters.bytes += freed
            evicted += count
        if evicted:
            log.info("evicted %d %s (%s policy)", evicted, what, self.budget.policy)
        return evicted

    def evict_past_high(self) -> int:
        evicted = 0
        if self.conversations_over(self.budget.high):
            evicted += self.evict_conversations(self.budget.low)
        if self.budget.enabled and self.over(self.budget.high):
            evicted += self.evict(self.budget.low)
        return evicted


def _victims(
    queue: deque[bytes], candidates: dict[bytes, Usage], excess_bytes: float, excess_count: int
) -> list[bytes]:
    """The next at most BATCH artifacts of `queue` (at least one) that cover the excess
    (counting each one's page bytes as freed: shared pages are not, so a pass may need
    another)."""
    batch: list[bytes] = []
    while queue and len(batch) < BATCH and (excess_bytes > 0 or excess_count > 0 or not batch):
        aid = queue.popleft()
        batch.append(aid)
        excess_bytes -= candidates[aid].page_bytes
        excess_count -= 1
    return batch


class CacheKeeper:
    """The store's maintenance thread: eviction past the high watermark, expired pins,
    evicted pages' holes punched (every second), last uses written (every 30 s). Wakes on
    every change to the store, at least every second."""

    def __init__(self, store, evictor: Evictor) -> None:
        self.store = store
        self.evictor = evictor
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cache-keeper", daemon=True)

    def start(self) -> CacheKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.store.wake()
        self._thread.join()

    def _run(self) -> None:
        flushed = ticked = time.monotonic()
        while not self._stop.is_set():
            try:
                self.evictor.evict_past_high()  # every commit: a budget is kept at once
                if time.monotonic() - ticked >= 1.0:  # pins expire to the second
                    self.evictor.counters.expired += self.store.expire_due()
                    self.store.give_back()
                    ticked = time.monotonic()
                if time.monotonic() - flushed >= USAGE_FLUSH_S:
                    self.store.flush_usage()
                    flushed = time.monotonic()
            except ResourceExhausted as exc:  # a full disk: said in a line, tried again
                log.warning("cache maintenance could not write, trying again: %s", exc)
                self._stop.wait(1.0)
            except Exception:  # a pass that fails is tried again at the next wake
                log.exception("cache maintenance failed; trying again")
                self._stop.wait(1.0)
            self.store.wait_for_change(1.0)
