"""One artifact made to match the source on the target: copied, or deleted, with retries.

`ArtifactCopier.copy` fetches the manifest (its SHA-256 must be the id), asks the
target which pages it lacks and relays just those from the source's GetArtifact
into the target's PutArtifact (kvgraft.replication.page_relay), the manifest last;
a failure retries with backoff (`Retries`), sending only what is still missing.
`delete` deletes on the target only when the source, asked again, does not hold
the artifact, and keeps what the target pinned or did not get from this source.
Every outcome, retry and byte is told to the run's ledger
(kvgraft.replication.summary). The streams it opens pass through the run's
guard (`opened`), so a stop or a stall cancels them.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from kvgraft import wire
from kvgraft.artifact import page_sizes, parse_manifest
from kvgraft.errors import (
    DataLoss,
    FailedPrecondition,
    KvgraftError,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
)
from kvgraft.replication.endpoint import Endpoint
from kvgraft.replication.page_relay import PageRelay, manifest_of
from kvgraft.replication.summary import ReplicationLedger
from kvgraft.replication.target import Target
from kvgraft.stream import Stream
from kvgraft.v1 import kvgraft_pb2 as pb

log = logging.getLogger(__name__)

# Errors a retry cannot fix; anything else (a cut, a corrupt byte) is retried.
# DEADLINE_EXCEEDED too, as a cut: a put or get that ran out of time may have met a
# connection gone half-open, which the client then gives up (kvgraft.client.connection),
# so the retry goes over a new one; a put is idempotent (content-addressed) and the
# retry sends only the pages still missing.
# UNIMPLEMENTED is retried too: a request damaged on the way reads as one (gRPC answers
# "requires exactly one request message"); a daemon that really lacks the RPC still
# fails the artifact after max_attempts, with the same message.
FATAL_ERRORS = (FailedPrecondition, ResourceExhausted, Unauthenticated)
# ... except a message "larger than max": replication frames every message under the
# limit, so the daemon read a length prefix damaged on the way.
_DAMAGED_LENGTH = "Received message larger than max"


def retry_cannot_fix(exc: KvgraftError) -> bool:
    """Whether a retry cannot fix `exc` (FATAL_ERRORS, bar damage on the way)."""
    return isinstance(exc, FATAL_ERRORS) and _DAMAGED_LENGTH not in str(exc)


@dataclass(frozen=True)
class Retries:
    """Attempts per artifact (and per pass over the feed), and the backoff between them."""

    max_attempts: int = 8
    backoff_s: float = 0.05
    max_backoff_s: float = 5.0

    def delay(self, attempt: int) -> float:
        base = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
        return base * (0.5 + random.random())


class ArtifactCopier:
    def __init__(
        self,
        source: Endpoint,
        target: Target,
        ledger: ReplicationLedger,
        opened: Callable[[Stream | None], AbstractContextManager],
        stopped: Callable[[], bool],
        retries: Retries,
    ) -> None:
        self.source = source
        self.target = target
        self._ledger = ledger
        self._opened = opened
        self._stopped = stopped
        self._retries = retries

    def copy(self, artifact_id: str, planned_bytes: int = 0, repair: bool = False) -> str:
        """Make the target hold the artifact: "added", "present" or "vanished"; with
        `repair` (the target's copy is quarantined), "repaired" once the pages it lacked
        are sent and it committed them.

        Retries up to max_attempts, then raises the last error.
        """
        sent: set[bytes] = set()  # pages forwarded by earlier attempts
        moved = [0]  # page bytes forwarded for this artifact
        for attempt in range(1, self._retries.max_attempts + 1):
            try:
                outcome = self._copy_once(artifact_id, sent, moved)
                break
            except NotFound as exc:
                if not self.source_has(artifact_id):
                    outcome = "vanished"
                    break
                error: KvgraftError = exc
            except KvgraftError as exc:
                if retry_cannot_fix(exc):
                    raise
                error = exc
            if attempt == self._retries.max_attempts or self._stopped():
                raise error
            self._ledger.retry(artifact_id, error)
            time.sleep(self._retries.delay(attempt))
        self._ledger.skipped(planned_bytes - moved[0])
        if repair and outcome == "present":
            outcome = "repaired"
            self._ledger.repaired(artifact_id)
        else:
            counter = {"added": "artifacts_added", "present": "artifacts_present"}
            self._ledger.count(**{counter.get(outcome, "artifacts_vanished"): 1})
        self._ledger.changed(outcome, artifact_id)
        return outcome

    def _copy_once(self, artifact_id: str, sent: set[bytes], moved: list[int]) -> str:
        manifest_bytes, signatures = self._fetch_manifest(artifact_id)
        sizes = page_sizes(parse_manifest(manifest_bytes))
        missing = self.target.missing_pages(list(sizes))
        if not set(missing) <= sizes.keys():
            raise DataLoss("MissingPages answered hashes that were not asked; asking again")
        stream = (
            self.source.get_artifact_messages(artifact_id, only_pages=missing) if missing else None
        )

        def forwarded(data_bytes: int, done: list[bytes]) -> None:
            again = [digest for digest in done if digest in sent]
            sent.update(done)
            moved[0] += data_bytes
            self._ledger.moved(data_bytes, len(done), len(again), sum(sizes[d] for d in again))

        relay = PageRelay(
            artifact_id,
            manifest_bytes,
            signatures,
            sizes,
            missing,
            stream,
            forwarded,
            relayed_from=self.source.address,
        )
        try:
            with self._opened(stream):
                response = self.target.put_parts(relay.parts())
        except KvgraftError:
            if relay.source_error is not None:
                raise relay.source_error from None  # the cause; the put only ended early
            raise
        if relay.source_error is not None:
            raise relay.source_error
        if response.artifact_id != artifact_id:
            raise DataLoss(
                f"the target stored {response.artifact_id[:16]} for {artifact_id[:16]}; "
                "the put response was altered on the way"
            )
        self._ledger.count(
            pages_written=response.pages_written, bytes_written=response.bytes_written
        )
        return "present" if response.already_present else "added"

    def _fetch_manifest(self, artifact_id: str) -> tuple[bytes, list[pb.ArtifactSignature]]:
        """The artifact's manifest bytes (checked against its id) and its signatures."""
        with self._opened(self.source.get_artifact_messages(artifact_id, manifest_only=True)) as s:
            first = next(s, None)
        manifest = manifest_of(first, artifact_id)
        return manifest, wire.decode_signatures(first, wire.GET_SIGNATURES)

    def delete(self, artifact_id: str) -> str:
        """Delete the artifact on the target, if the source no longer holds it.

        Returns "deleted", "absent", "kept-pinned", "kept-foreign", or what `copy`
        returns when the source holds it after all.
        """
        for attempt in range(1, self._retries.max_attempts + 1):
            try:
                if self.source_has(artifact_id):  # re-added since, or the record was altered
                    return self.copy(artifact_id)
                outcome = self.target.delete_artifact(artifact_id)
                kept = outcome in ("pinned", "foreign")
                if not kept and self.target.has_artifact(artifact_id):
                    raise DataLoss(f"artifact {artifact_id[:16]} is still on the target")
                break
            except KvgraftError as exc:
                if retry_cannot_fix(exc):
                    raise
                if attempt == self._retries.max_attempts or self._stopped():
                    raise
                self._ledger.retry(artifact_id, exc)
                time.sleep(self._retries.delay(attempt))
        if outcome == "pinned":
            outcome = "kept-pinned"
            log.info("artifact %s was deleted on the source but is pinned here: kept", artifact_id)
        elif outcome == "foreign":  # a source may delete only what came from it
            outcome = "kept-foreign"
            log.info(
                "artifact %s was deleted on %s, which it did not come from: kept",
                artifact_id,
                self.source.address,
            )
        counter = {
            "deleted": "artifacts_deleted",
            "kept-pinned": "deletes_kept_pinned",
            "kept-foreign": "deletes_kept_foreign",
        }
        if outcome in counter:
            self._ledger.count(**{counter[outcome]: 1})
        self._ledger.changed(outcome, artifact_id)
        return outcome

    def source_has(self, artifact_id: str) -> bool:
        try:
            self.source.stat(artifact_id)
        except NotFound:
            return False
        return True
