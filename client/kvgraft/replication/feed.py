"""What a replication source says to do: its listing and its change feed, read and checked;
and what a target's own feed says it expired.

The source is not trusted to be well-formed. Its listing must advance in id order
(Endpoint.list_artifacts, as kvgraft.Client answers it) and name only artifact ids, at most
MAX_LISTED_ARTIFACTS of them (a pass holds them in memory). Its feed is read twice
and must agree, each record the next sequence number naming an artifact: a
record altered in transit would otherwise copy or delete the wrong artifact.
Anything else is DataLoss, which the replicator retries.

`expiries` reads a target's own feed for the artifacts whose TTL pin expired there: the
target's decision, which a replication pass does not undo.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from kvgraft.errors import DataLoss
from kvgraft.replication.endpoint import Endpoint
from kvgraft.v1 import kvgraft_pb2 as pb

log = logging.getLogger(__name__)

ADDED, DELETED = pb.ChangeRecord.KIND_ADDED, pb.ChangeRecord.KIND_DELETED
EXPIRED = pb.ChangeRecord.REASON_EXPIRED
# A pass holds the source's listing in memory (~200 bytes an artifact): a bound on it.
MAX_LISTED_ARTIFACTS = 4_000_000


@dataclass(frozen=True)
class Listed:
    """An artifact a source holds: its page bytes and the public keys of its signatures."""

    page_bytes: int
    signers: frozenset[bytes]


def read_listing(source: Endpoint) -> dict[str, Listed]:
    """Artifact id -> what the source lists of it, for everything the source holds."""
    listed: dict[str, Listed] = {}
    for info in source.list_artifacts():  # in strict id order, or DataLoss
        signers = frozenset(s.public_key for s in info.provenance.signatures)
        listed[info.artifact_id] = Listed(info.page_bytes, signers)
        if len(listed) > MAX_LISTED_ARTIFACTS:
            raise DataLoss(
                f"{source.address} lists more than {MAX_LISTED_ARTIFACTS} artifacts, "
                "more than one replication pass takes"
            )
    if not all(map(is_artifact_id, listed)):
        raise DataLoss(f"the listing of {source.address} arrived altered")
    return listed


def read_feed(source: Endpoint, from_sequence: int) -> list[pb.ChangeRecord]:
    """The feed from `from_sequence` to its end, read twice: a record altered in transit
    (another artifact id) would otherwise copy or delete the wrong one."""
    records = list(source.watch(from_sequence))
    again = list(source.watch(from_sequence))
    if again[: len(records)] != records:
        raise DataLoss(f"two reads of the change feed of {source.address} differ")
    if records and records[0].sequence > from_sequence:
        # Only a feed whose start was trimmed does this; the listing covers additions.
        log.warning(
            "the feed of %s starts at sequence %d, after %d: deletes in between are not known here",
            source.address,
            records[0].sequence,
            from_sequence,
        )
    for previous, record in itertools.pairwise(records):
        check_record(record, previous.sequence + 1)
    if records:
        check_record(records[0], records[0].sequence)
    return records


def check_record(record: pb.ChangeRecord, sequence: int) -> None:
    """A change record must be the next one and name an artifact: else it was altered."""
    if (
        record.sequence != sequence
        or record.kind not in (ADDED, DELETED)
        or not is_artifact_id(record.artifact_id)
    ):
        raise DataLoss(f"change record {record.sequence} is not the expected {sequence}")


def is_artifact_id(text: str) -> bool:
    return len(text) == 64 and not text.strip("0123456789abcdef")


def expiries(records: Iterable[pb.ChangeRecord]) -> dict[str, int]:
    """Artifact id -> when (unix ms) its TTL pin expired, for every artifact whose last
    record in `records` (a store's own feed, in order) is that expiry."""
    expired: dict[str, int] = {}
    for record in records:
        if record.kind == DELETED and record.reason == EXPIRED:
            expired[record.artifact_id] = record.unix_ms
        else:
            expired.pop(record.artifact_id, None)
    return expired
