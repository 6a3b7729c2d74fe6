"""Replication: make a target store hold what a source store holds, byte for byte, verified.

Artifacts are immutable and content-addressed, so replication is set
reconciliation plus verified transfer (docs/architecture.md, "Replication"), all over the
daemons' ordinary gRPC API:

* What to do. The source's change feed (Watch, from a sequence number to its
  end) gives each artifact's last change; List adds every artifact the source
  holds that the target lacks, so a change record lost or altered in transit
  is healed by the next pass. The source is the truth: an artifact is copied
  when the source holds it, and deleted on the target only when the source,
  asked again, does not.
* Copying one artifact (kvgraft.replication.artifact_copy). Fetch its
  manifest (its SHA-256 must be the id), ask the target MissingPages, and
  stream just those pages from the source's GetArtifact into the target's
  PutArtifact as they arrive (a message or two in memory per worker), the
  manifest last with its expected id. Pages are
  checked here on arrival (the xxh3-128 the source sends) and again, SHA-256,
  by the target, which commits pages and manifest in one transaction: a
  partial artifact is never visible and a wrong byte is never accepted.
* Faults. Any failure (a cut connection, a corrupt page, an altered manifest
  or feed record) retries the artifact with backoff. When the source stream
  breaks, the put is ended without a manifest, so the target keeps (stages)
  the verified pages it has received and the retry sends only what is still
  missing: of what had arrived, at most the messages in flight are sent
  again (gRPC hands a server whole messages only). A connection that goes
  silent is noticed by kvgraft.replication.stream_guard and replaced; a put or
  get that ran out of time is retried like a cut, over a new connection.

Deletes: an artifact the source deleted is deleted on the target unless the
target pinned it (an operator's explicit protection there, counted in
`deletes_kept_pinned`); one the source evicted to stay within its budget
(reason `evicted` in its feed) is not deleted: each store's budget is its own.
Expired TTL pins are deletes like any other. A target's quarantined artifacts
(a scrub found them corrupt) are copied again: the missing pages are sent, the
artifact is whole again, and the summary counts and names it (`repaired`). Pins are
not replicated, and a TTL pin that expired on the target is the target's decision: a
pass does not copy that artifact back (the listing heals lost records, not expiries)
unless the source's feed shows it added again after the expiry (by the records'
clocks); a live record in follow mode is such an addition. An artifact present on
both whose source copy carries signatures the target's lacks has its manifest sent
again with them, so a signature added since (a Verify on the source) reaches the
target and upgrades its trust there. Replicating twice, or from two sources at once,
leaves one copy: puts are idempotent and pages shared.

The target is anything with the `Target` methods: `ClientTarget` (another
daemon over gRPC) here, or the daemon's own store in its follow mode
(kvgraftd.replication.follower). The source's listing and feed are read and checked by
kvgraft.replication.feed; kvgraft.replication.session runs a Replicator between
two daemons given as clients or addresses. This module must not import the daemon.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvgraft.errors import DataLoss, KvgraftError, Unavailable
from kvgraft.replication.artifact_copy import ArtifactCopier, Retries, retry_cannot_fix
from kvgraft.replication.endpoint import Endpoint
from kvgraft.replication.feed import (
    ADDED,
    DELETED,
    Listed,
    check_record,
    read_feed,
    read_listing,
)
from kvgraft.replication.stream_guard import StreamGuard
from kvgraft.replication.summary import ReplicationLedger, ReplicationSummary
from kvgraft.replication.target import Holdings, Target
from kvgraft.v1 import kvgraft_pb2 as pb

log = logging.getLogger(__name__)


def evicted(record: pb.ChangeRecord) -> bool:
    return record.kind == DELETED and record.reason == pb.ChangeRecord.REASON_EVICTED


FOLLOW_MIN_BACKOFF_S = 0.5  # follow mode reconnects after 0.5 s, 1 s, 2 s, ... 30 s
FOLLOW_MAX_BACKOFF_S = 30.0


class Replicator:
    """Copies artifacts and deletes from a source daemon to a target.

    `workers` artifacts are copied at once during a catch-up (on 2 cores, 2
    keep the source, this process and the target busy while one artifact
    commits). `progress` is an object with tqdm's `total` and `update(n)`;
    `on_change(outcome, artifact_id)` hears of every artifact handled.
    """

    def __init__(
        self,
        source: Endpoint,
        target: Target,
        *,
        workers: int = 2,
        max_attempts: int = 8,
        backoff_s: float = 0.05,
        max_backoff_s: float = 5.0,
        progress=None,
        on_change: Callable[[str, str], None] | None = None,
        probe_interval_s: float = 20.0,
    ) -> None:
        self.source = source
        self.target = target
        self.workers = max(1, workers)
        self.retries = Retries(max(1, max_attempts), backoff_s, max_backoff_s)
        self.probe_interval_s = probe_interval_s
        self.summary = ReplicationSummary(source=source.address)
        self._ledger = ReplicationLedger(self.summary, progress, on_change)
        self._stop = threading.Event()
        # Open source streams: stop, or a stall (a connection gone silent), cancels them.
        self._guard = StreamGuard(
            self._behind,
            self._progress_marker,
            probe_interval_s,
            f"replication from {source.address}",
        )
        self._opened = self._guard.opened
        self._copier = ArtifactCopier(
            source, target, self._ledger, self._opened, lambda: self._stop.is_set(), self.retries
        )

    # ------------------------------------------------------------------
    # modes

    def sync(self, from_sequence: int = 1) -> ReplicationSummary:
        """One pass: the source's feed from `from_sequence` to its end, plus its listing."""
        began = time.monotonic()
        done = threading.Event()
        self._guard.watch(done)
        try:
            for attempt in range(1, self.retries.max_attempts + 1):
                try:
                    position, _ = self._catch_up(from_sequence)
                    self._ledger.position(position)
                    break
                except KvgraftError as exc:
                    if retry_cannot_fix(exc) or attempt == self.retries.max_attempts:
                        raise
                    self._ledger.retry("the feed", exc)
                    time.sleep(self.retries.delay(attempt))
        finally:
            done.set()
        self.summary.elapsed_s = round(time.monotonic() - began, 3)
        return self.summary

    def stop(self) -> None:
        """End a pass early, from any thread: no retry starts after this."""
        self._stop.set()

    def snapshot(self) -> ReplicationSummary:
        """The summary so far, read from any thread while the pass runs."""
        return self._ledger.snapshot()

    def follow(
        self,
        from_sequence: int = 1,
        *,
        stop: threading.Event,
        on_position: Callable[[int], None] | None = None,
        max_failures: int | None = None,
    ) -> ReplicationSummary:
        """Catch up, then apply the source's changes as they happen, until `stop` is set.

        After an error it backs off (0.5 s, doubling to 30 s) and resumes from
        the last sequence applied, which `on_position(sequence)` hears of (save
        it to resume there after a restart); after `max_failures` errors in a
        row it raises instead, so the caller can open a fresh connection. A
        connection gone silent (no progress while the source is ahead, probed
        every probe_interval_s) counts as an error.
        """
        self._stop = stop
        began = time.monotonic()
        position = max(from_sequence, 1) - 1
        self._guard.watch(stop)
        failures = 0
        while not stop.is_set():
            try:
                position, failed = self._catch_up(position + 1)
                self._ledger.position(position, on_position)
                if failed:
                    raise KvgraftError(f"{failed} artifacts could not be copied yet")
                failures = 0
                with self._opened(self.source.watch(position + 1, follow=True)) as feed:
                    for record in feed:
                        if stop.is_set():
                            break
                        check_record(record, position + 1)
                        self._apply(record)
                        position = record.sequence
                        self._ledger.position(position, on_position)
                    else:
                        raise Unavailable(f"the change feed of {self.source.address} ended")
            except KvgraftError as exc:  # fatal ones too: a full disk may be freed
                if stop.is_set():
                    break
                failures += 1
                if max_failures is not None and failures >= max_failures:
                    raise
                delay = min(FOLLOW_MAX_BACKOFF_S, FOLLOW_MIN_BACKOFF_S * 2 ** (failures - 1))
                log.warning(
                    "replication from %s: %s; resuming from sequence %d in %.1f s",
                    self.source.address,
                    exc,
                    position + 1,
                    delay,
                )
                stop.wait(delay)
        self.summary.elapsed_s = round(time.monotonic() - began, 3)
        return self.summary

    # ------------------------------------------------------------------
    # passes

    def _catch_up(self, from_sequence: int) -> tuple[int, int]:
        """Apply the feed from `from_sequence` to its end and copy whatever the source
        lists and the target lacks. Returns (last sequence applied, artifacts failed)."""
        last = self.source.stats().last_sequence
        if from_sequence > last + 1:
            log.warning(
                "the feed of %s ends at sequence %d, before %d: its store was replaced; "
                "replicating it from the start",
                self.source.address,
                last,
                from_sequence,
            )
            from_sequence = 1
        listed = read_listing(self.source)
        records = read_feed(self.source, from_sequence)
        held = self.target.holdings()
        present = held.present
        latest: dict[str, pb.ChangeRecord] = {}  # artifact id -> its last record, in order
        for record in records:
            latest.pop(record.artifact_id, None)
            if not evicted(record):  # the source's budget is not the target's: keep copies
                latest[record.artifact_id] = record
        wanted = [a for a, record in latest.items() if record.kind == ADDED]
        wanted += [a for a in listed if a not in latest]
        adds, repairs, resigned = self._plan_copies(wanted, listed, latest, held)
        # The feed touched these, and the target holds them or the source no longer
        # lists them: deleted on the source, unless the source, asked again, has them.
        deletes = [
            a
            for a, record in latest.items()
            if (record.kind == DELETED and (a in present or a in listed))
            or (record.kind == ADDED and a in present and a not in listed)
        ]

        def page_bytes(artifact_id: str) -> int:
            return listed[artifact_id].page_bytes if artifact_id in listed else 0

        self._ledger.planned(sum(map(page_bytes, adds + repairs)))
        failed = 0
        jobs = [(self._copy_job, a, page_bytes(a)) for a in adds]
        jobs += [(self._repair_job, a, page_bytes(a)) for a in repairs]
        jobs += [(self._copy_job, a, 0) for a in resigned]  # the manifest only
        jobs += [(self._delete_job, a, 0) for a in deletes]
        with ThreadPoolExecutor(self.workers, thread_name_prefix="replicate") as pool:
            for ok in pool.map(lambda job: job[0](job[1], job[2]), jobs):
                failed += not ok
        position = records[-1].sequence if records else from_sequence - 1
        return (from_sequence - 1 if failed else position), failed

    def _plan_copies(
        self,
        wanted: list[str],
        listed: dict[str, Listed],
        latest: dict[str, pb.ChangeRecord],
        held: Holdings,
    ) -> tuple[list[str], list[str], list[str]]:
        """Of the artifacts the source holds (`wanted`): those to copy, to repair (the
        target's copy is quarantined) and to send again for their signatures (the
        target's copy lacks one); the rest are counted present, or left expired."""
        absent = [a for a in wanted if a not in held.present]
        expired = self.target.expired() if absent else {}
        # A TTL that expired on the target stays expired, unless the source added the
        # artifact again since (its record is later than the expiry).
        left = {
            a
            for a in absent
            if a in expired and (a not in latest or latest[a].unix_ms <= expired[a])
        }
        repairs = [a for a in wanted if a in held.quarantined]
        no_signers: frozenset[bytes] = frozenset()
        resigned = [
            a
            for a in wanted
            if a in held.present
            and a not in held.quarantined
            and a in listed
            and not listed[a].signers <= held.signers.get(a, no_signers)
        ]
        self._ledger.count(
            artifacts_present=len(wanted) - len(absent) - len(repairs) - len(resigned),
            expired_not_restored=len(left),
        )
        return [a for a in absent if a not in left], repairs, resigned

    def _apply(self, record: pb.ChangeRecord) -> None:
        if evicted(record):
            return  # evicted there for room; a copy here stays (its own budget evicts it)
        if record.kind == ADDED:
            outcome = self._copier.copy(record.artifact_id)
        else:
            outcome = self._copier.delete(record.artifact_id)
        if outcome in ("vanished", "absent"):
            # Usual after quick changes on the source; also what a record whose id was
            # altered in transit looks like: read it again before moving past it.
            with self._opened(self.source.watch(record.sequence)) as stream:
                again = next(stream, None)
            if again != record:
                raise DataLoss(f"change record {record.sequence} differs when read again")

    def _copy_job(self, artifact_id: str, planned_bytes: int) -> bool:
        return self._job(lambda: self._copier.copy(artifact_id, planned_bytes), artifact_id)

    def _repair_job(self, artifact_id: str, planned_bytes: int) -> bool:
        return self._job(
            lambda: self._copier.copy(artifact_id, planned_bytes, repair=True), artifact_id
        )

    def _delete_job(self, artifact_id: str, _: int) -> bool:
        return self._job(lambda: self._copier.delete(artifact_id), artifact_id)

    def _job(self, run: Callable[[], str], artifact_id: str) -> bool:
        try:
            run()
        except KvgraftError as exc:
            if not self._stop.is_set():  # stopped: the calls were ended on purpose
                log.warning("artifact %s was not replicated: %s", artifact_id[:16], exc)
            self._ledger.failed(artifact_id, exc)
            return False
        return True

    # ------------------------------------------------------------------
    # streams

    def _behind(self) -> bool:
        """The source holds changes not applied yet, or does not answer."""
        try:
            return self.source.stats().last_sequence > self.summary.last_sequence
        except KvgraftError:
            return True

    def _progress_marker(self) -> tuple[int, ...]:
        s = self.summary
        return (
            s.last_sequence,
            s.bytes_moved,
            s.retries,
            s.artifacts_added + s.artifacts_repaired + s.artifacts_present + s.artifacts_vanished,
            s.artifacts_deleted
            + s.deletes_kept_pinned
            + s.deletes_kept_foreign
            + s.artifacts_failed,
        )
