"""What a replication did: its summary, and the ledger that keeps it from many threads.

`ReplicationSummary` is what `Replicator.sync`/`follow` return and what
`kvgraft replicate` prints (JSON with --json); its `mode` says which way the
bytes went ("relay": through the caller, "pull": the target copied straight
from the source) and stays client-side. A pull's summary travels as the proto
message, which carries the fields both have (`to_proto`/`from_proto`).
`ReplicationLedger` is the only writer of a summary while a replication runs:
the replicator's workers count into it under one lock, and it drives the
caller's progress bar (an object with tqdm's `total` and `update(n)`) and
`on_change(outcome, artifact_id)` hook.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace

from kvgraft.errors import KvgraftError
from kvgraft.v1 import kvgraft_pb2 as pb

log = logging.getLogger(__name__)

MAX_REASONS = 20  # retry reasons kept in a summary


@dataclass
class ReplicationSummary:
    """What a replication did. Bytes are page bytes; `*_moved` counts every send."""

    source: str = ""
    target: str = ""
    artifacts_added: int = 0  # committed on the target by this replication
    artifacts_repaired: int = 0  # quarantined on the target, made whole again (see repaired)
    artifacts_present: int = 0  # the target held them already
    expired_not_restored: int = 0  # the target's TTL pin deleted them: not copied back
    artifacts_deleted: int = 0
    deletes_kept_pinned: int = 0  # deleted on the source, pinned on the target: kept
    deletes_kept_foreign: int = 0  # deleted on the source, not replicated from it: kept
    artifacts_vanished: int = 0  # deleted on the source before they could be copied
    artifacts_failed: int = 0  # gave up after max_attempts (see failures)
    pages_moved: int = 0  # pages forwarded to the target, resends included
    bytes_moved: int = 0
    pages_resent: int = 0  # pages forwarded again by a retry of the same artifact
    bytes_resent: int = 0
    pages_written: int = 0  # pages the target stored anew at commit (staged ones excluded)
    bytes_written: int = 0
    retries: int = 0
    last_sequence: int = 0  # the source's feed is applied up to here
    elapsed_s: float = 0.0
    retry_reasons: list[str] = field(default_factory=list)  # the last few
    failures: dict[str, str] = field(default_factory=dict)  # artifact id -> last error
    repaired: list[str] = field(default_factory=list)  # the artifacts repaired
    mode: str = "relay"  # "relay" (through the caller) or "pull" (Replicate); client-side only

    def as_dict(self) -> dict:
        return asdict(self)

    def to_proto(self) -> pb.ReplicationSummary:
        values = self.as_dict()
        for name in _CLIENT_SIDE:
            del values[name]
        return pb.ReplicationSummary(**values)

    @classmethod
    def from_proto(cls, message: pb.ReplicationSummary) -> ReplicationSummary:
        """The summary a daemon sent; `mode` stays its default (the caller sets it)."""
        values = {}
        for f in fields(cls):
            if f.name in _CLIENT_SIDE:
                continue
            value = getattr(message, f.name)
            if isinstance(value, Mapping):
                value = dict(value)
            elif not isinstance(value, str | int | float):
                value = list(value)  # a repeated field
            values[f.name] = value
        return cls(**values)


# Fields of ReplicationSummary the proto message lacks ("mode", and any field the proto
# does not have yet): they stay where the summary was made.
_ON_THE_WIRE = frozenset(pb.ReplicationSummary.DESCRIPTOR.fields_by_name)
_CLIENT_SIDE = frozenset(f.name for f in fields(ReplicationSummary)) - _ON_THE_WIRE


class ReplicationLedger:
    """Counts into a ReplicationSummary from any thread."""

    def __init__(
        self,
        summary: ReplicationSummary,
        progress=None,
        on_change: Callable[[str, str], None] | None = None,
    ) -> None:
        self.summary = summary
        self._progress = progress
        self._on_change = on_change
        self._lock = threading.Lock()

    def snapshot(self) -> ReplicationSummary:
        """A copy of the summary as it stands, consistent while workers count into it."""
        with self._lock:
            s = self.summary
            return replace(
                s,
                retry_reasons=list(s.retry_reasons),
                failures=dict(s.failures),
                repaired=list(s.repaired),
            )

    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.summary, name, getattr(self.summary, name) + delta)

    def planned(self, page_bytes: int) -> None:
        """Bytes a pass expects to move (the progress bar's total grows by them)."""
        if self._progress is not None:
            with self._lock:
                self._progress.total = (self._progress.total or 0) + page_bytes

    def moved(self, page_bytes: int, pages: int, resent_pages: int, resent_bytes: int) -> None:
        with self._lock:
            s = self.summary
            s.bytes_moved += page_bytes
            s.pages_moved += pages
            s.pages_resent += resent_pages
            s.bytes_resent += resent_bytes
            if self._progress is not None:
                self._progress.update(page_bytes)

    def skipped(self, page_bytes: int) -> None:
        """Planned bytes that did not have to move (the target held those pages)."""
        if self._progress is not None and page_bytes > 0:
            with self._lock:
                self._progress.update(page_bytes)

    def retry(self, what: str, error: KvgraftError) -> None:
        reason = f"{what[:16]}: {error.code}: {error}"
        log.info("retrying %s", reason)
        with self._lock:
            self.summary.retries += 1
            self.summary.retry_reasons = [*self.summary.retry_reasons, reason][-MAX_REASONS:]

    def repaired(self, artifact_id: str) -> None:
        with self._lock:
            self.summary.artifacts_repaired += 1
            self.summary.repaired = [*self.summary.repaired, artifact_id]

    def failed(self, artifact_id: str, error: KvgraftError) -> None:
        with self._lock:
            self.summary.artifacts_failed += 1
            self.summary.failures[artifact_id] = f"{error.code}: {error}"
        self.changed("failed", artifact_id)

    def position(self, sequence: int, on_position: Callable[[int], None] | None = None) -> None:
        with self._lock:
            self.summary.last_sequence = sequence
        if on_position is not None:
            on_position(sequence)

    def changed(self, outcome: str, artifact_id: str) -> None:
        if self._on_change is not None:
            self._on_change(outcome, artifact_id)
