"""An artifact's commit: its pages, references, catalogue record and change record in one
transaction.

`Commits` is a part the Store holds (kvgraftd.store.artifact_store offers
`commit_artifact` as its own) over the store's LMDB environment, pages, usage book
and evictor. The invariants are the Store's (kvgraftd.store.artifact_store): page
bytes are durable before the transaction that names them commits
(kvgraftd.store.page_store), and a reader sees an artifact whole or not at all.

Contract:
* Every page the manifest names must be stored, staged or sent (`records`, whose
  sizes the caller checked); otherwise nothing is written (InvalidArgument).
* Room is made first (the evictor's `make_room`) for the bytes it brings and the
  staged pages it claims (kvgraftd.store.staging: they enter the budget), one
  commit at a time from making its room to using it; an artifact already stored
  takes none.
* The usage book learns of the artifact inside its transaction (transactions are
  serialized, so the book follows the catalogue: kvgraftd.store.lifecycle); if the
  transaction fails, the book forgets it again.
* An artifact already stored keeps its record; its provenance is merged, and if
  it is quarantined, the pages it brings repair it (kvgraftd.store.quarantine).
* One logfmt line per artifact written (`event=artifact_written`): machines read it.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
from collections.abc import Callable, Mapping

import lmdb

from kvgraft.artifact import canonical_bytes, page_sizes
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store import catalog, staging, trust_index
from kvgraftd.store.catalog import ArtifactRecord, decode_record, encode_record, now_ms
from kvgraftd.store.eviction import Evictor
from kvgraftd.store.interface import CommitResult
from kvgraftd.store.lifecycle import usage_of_new
from kvgraftd.store.lmdb_env import LmdbEnv
from kvgraftd.store.owned_pages import count_owned
from kvgraftd.store.page_records import PageRecord, write_needs
from kvgraftd.store.page_store import PageStore
from kvgraftd.store.quarantine import Quarantine
from kvgraftd.store.staging import Staging
from kvgraftd.store.usage import UsageBook

log = logging.getLogger(__name__)

_U64 = struct.Struct("<Q")


class Commits:
    """The commits of the store whose environment is `env` and pages `pages`;
    `notify_change()` wakes the change feed's waiters (an artifact was added)."""

    def __init__(
        self,
        env: LmdbEnv,
        pages: PageStore,
        usage: UsageBook,
        clock: Callable[[], int],
        *,
        evictor: Evictor,
        staging: Staging,
        quarantine: Quarantine,
        notify_change: Callable[[], None],
    ) -> None:
        self._db = env.db
        self._pages = pages
        self._usage = usage
        self._clock = clock
        self._evictor = evictor
        self._staging = staging
        self._quarantine = quarantine
        self._notify_change = notify_change
        # One commit at a time from making its room to using it (see the contract).
        self._admitting = threading.Lock()

    def commit_artifact(
        self,
        manifest: pb.Manifest,
        records: Mapping[bytes, PageRecord],
        provenance: pb.Provenance = trust_index.UNRECORDED,
    ) -> CommitResult:
        """Store a validated manifest with the page records not yet stored.

        The provenance is kept (merged with an earlier one for an artifact already
        present); the artifact's pages enter the chain index only when trusted.
        """
        canonical = canonical_bytes(manifest)
        aid = hashlib.sha256(canonical).digest()
        sizes = page_sizes(manifest)
        index_bytes, file_bytes = write_needs(records[d] for d in sizes if d in records)

        def body(txn: lmdb.Transaction) -> CommitResult:
            found = txn.get(aid, db=self._db["artifacts"])
            if found is not None:
                sequence = decode_record(found).sequence
                repaired = (0, 0)
                if txn.get(aid, db=self._db["quarantine"]) is not None:
                    repaired = self._quarantine.repair_in(txn, aid, manifest, records)
                trust_index.record(txn, self._db, aid, manifest, provenance)
                return CommitResult(aid.hex(), True, *repaired, sequence)
            new = self._pages.new_pages(txn, sizes, records)
            self._pages.append(txn, new)
            for digest in sizes:
                self._reference_page(txn, digest)
            count_owned(txn, self._db["owned_pages"], manifest, +1)
            written_bytes = sum(len(record.data) for record in new.values())
            self._pages.count_bytes(txn, written_bytes)
            written = len(new)
            trust_index.record(txn, self._db, aid, manifest, provenance)
            sequence = catalog.append_change(txn, self._db["log"], pb.ChangeRecord.KIND_ADDED, aid)
            record = ArtifactRecord(now_ms(), sequence, False, canonical)
            txn.put(aid, encode_record(record), db=self._db["artifacts"])
            self._usage.added(aid, usage_of_new(manifest, self._clock()))  # see _admitting
            added.append(aid)
            return CommitResult(aid.hex(), False, written, written_bytes, sequence)

        added: list[bytes] = []

        with self._admitting:
            if self._usage.get(aid) is None:  # an artifact present takes no room
                # the staged pages it claims enter the budget too (kvgraftd.store.staging)
                claimed = self._staging.staged_disk_of(d for d in sizes if d not in records)
                self._evictor.make_room(file_bytes + claimed)
            try:
                result = self._pages.write(index_bytes + len(canonical), file_bytes, body)
            except BaseException:
                self._usage.removed(added)  # its transaction failed: not stored
                raise
        if not result.already_present:
            self._notify_change()
            log.info(  # one logfmt line per artifact written: machines read it
                "event=artifact_written artifact_id=%s sequence=%d pages_written=%d "
                "bytes_written=%d tokens=%d",
                result.artifact_id,
                result.sequence,
                result.pages_written,
                result.bytes_written,
                len(manifest.token_ids),
            )
        return result

    def _reference_page(self, txn, digest: bytes) -> None:
        """Add one reference to a stored page (a staged page is staged no more)."""
        refs = self._db["refs"]
        count = txn.get(digest, db=refs)
        if count is None:
            staging.unstage(txn, self._db, digest)
        txn.put(digest, _U64.pack(1 if count is None else _U64.unpack(count)[0] + 1), db=refs)
