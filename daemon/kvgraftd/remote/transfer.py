"""Moving whole artifacts between the local store and the remote tier.

Push order is pages, then chain objects, then the manifest. The manifest is
the commit point: a manifest in the bucket means every page and chain object
of that artifact is there too, so "is it uploaded?" is one HEAD, and a push
cut at any point (server killed, daemon killed) is simply pushed again: every
write is idempotent. A chain object may name an artifact whose manifest is
not there yet (a push in progress, or one that died): readers treat that as a
miss, and the next push of an artifact holding that page overwrites it.
A write-through push (`push_through`) is not tried while the breaker is open,
and its failure says the artifact is stored locally but not held there (a
budget may evict it): a retry of the call is what uploads it.

Pull (import) is the reverse: the manifest, verified against its id and
parsed like any received manifest; then the pages this store lacks, each
verified against its hash, staged in batches so memory stays bounded; then
one local commit. Nothing enters the store unverified; an import that cannot
get every page stores no artifact (the pages it staged are collected later,
or claimed by a retry).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from kvgraft.artifact import page_sizes, parse_manifest
from kvgraft.errors import DataLoss, KvgraftError, NotFound, Unavailable
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.remote.tier import RemoteTier
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.chains import manifest_entries
from kvgraftd.store.page_records import PageRecord, page_records_of
from kvgraftd.store.signing import TrustPolicy
from kvgraftd.store.trust_index import is_trusted

log = logging.getLogger(__name__)

IMPORT_BATCH_BYTES = 64 << 20  # page bytes fetched before they are staged


@dataclass
class Moved:
    artifacts: int = 0
    pages: int = 0
    bytes: int = 0
    already: int = 0  # artifacts that were there already

    def add(self, other: Moved) -> None:
        self.artifacts += other.artifacts
        self.pages += other.pages
        self.bytes += other.bytes
        self.already += other.already


def push_artifact(
    store: Store,
    remote: RemoteTier,
    artifact_id: str,
    records: Mapping[bytes, PageRecord] | None = None,
) -> Moved:
    """Upload one local artifact unless the bucket has it (NotFound if it is not local).

    `records` (store records of pages just committed) spares reading them back.
    """
    record = store.get_record(artifact_id)
    manifest = record.manifest()
    fingerprint = manifest.model_fingerprint
    if remote.has_manifest(fingerprint, artifact_id):
        return Moved(already=1)
    store.check_servable(artifact_id)  # DataLoss for a quarantined one: stays queued
    held = records or {}

    def source(digest: bytes):
        found = held.get(digest)
        if found is not None:
            return found.data
        return lambda: store.read_page(digest)[0]

    sizes = page_sizes(manifest)
    written = remote.put_pages(fingerprint, ((d, source(d)) for d in sizes))
    provenance = store.provenance(artifact_id)
    if is_trusted(provenance):  # an untrusted upload must not repoint the fleet's prefixes
        keys = (key for key, _ in manifest_entries(manifest))
        remote.put_chains(fingerprint, keys, artifact_id)
    signatures = provenance.signatures
    if signatures:  # before the manifest, whose presence means complete
        remote.put_signatures(fingerprint, artifact_id, signatures)
    remote.put_manifest(fingerprint, artifact_id, record.canonical)
    remote.counters.add(artifacts_up=1)
    moved = Moved(1, sum(1 for w in written if w), sum(written))
    log.info(
        "event=remote_pushed artifact_id=%s pages_written=%d bytes_written=%d",
        artifact_id,
        moved.pages,
        moved.bytes,
    )
    return moved


def push_through(
    store: Store, remote: RemoteTier, artifact_id: str, records: Mapping[bytes, PageRecord]
) -> None:
    """Write-through: upload an artifact just committed, or raise Unavailable saying it is
    stored locally, unheld, and to retry. A server not answering (breaker open) is not waited on."""
    try:
        remote.breaker.require()
        push_artifact(store, remote, artifact_id, records)
    except NotFound:
        pass  # deleted meanwhile: nothing to upload
    except KvgraftError as exc:
        raise Unavailable(
            f"artifact {artifact_id} is stored locally, but the remote tier "
            f'(write = "through") did not take it: {exc}. Retry this call once the remote '
            "answers (`kvgraft remote status`): until uploaded, the local copy may be evicted "
            "like any other"
        ) from None


def find_remote(remote: RemoteTier, id_or_prefix: str) -> tuple[bytes, str] | None:
    """(fingerprint, full id) of the one remote artifact whose id starts with `id_or_prefix`."""
    wanted = id_or_prefix.lower()
    found: list[tuple[bytes, str]] = []
    for fingerprint in remote.fingerprints():
        for full in remote.manifest_ids(fingerprint, wanted):
            found.append((fingerprint, full))
            if len(found) > 1:
                return None  # ambiguous: the local error (not found) stands
    return found[0] if found else None


def import_artifact(
    store: Store, remote: RemoteTier, fingerprint: bytes, artifact_id: str, trust: TrustPolicy
) -> Moved:
    """Copy one remote artifact into the local store, every byte verified first; trusted
    if the bucket keeps a signature of it by a key this daemon trusts."""
    canonical = remote.get_manifest(fingerprint, artifact_id)
    if canonical is None:
        remote.breaker.require()
        raise NotFound(
            f"artifact {artifact_id[:16]} is neither local nor readable in the remote tier"
        )
    manifest = parse_manifest(canonical)
    if manifest.model_fingerprint != fingerprint:
        raise DataLoss(
            f"the remote manifest of {artifact_id[:16]} lies under model "
            f"{fingerprint.hex()[:16]} but names model {manifest.model_fingerprint.hex()[:16]}; "
            "it was not imported"
        )
    sizes = page_sizes(manifest)
    missing = store.missing_pages(list(sizes))
    moved = Moved(artifacts=1)
    batch: list[bytes] = []
    batch_bytes = 0
    for digest in missing:
        batch.append(digest)
        batch_bytes += sizes[digest]
        if batch_bytes >= IMPORT_BATCH_BYTES:
            _fetch_and_stage(store, remote, manifest, artifact_id, batch, moved)
            batch, batch_bytes = [], 0
    if batch:
        _fetch_and_stage(store, remote, manifest, artifact_id, batch, moved)
    signatures = remote.get_signatures(fingerprint, artifact_id)
    provenance = trust.received(artifact_id, signatures, "remote")
    result = store.commit_artifact(manifest, {}, provenance)
    log.info(
        "event=remote_imported artifact_id=%s pages_fetched=%d bytes_fetched=%d",
        result.artifact_id,
        moved.pages,
        moved.bytes,
    )
    return moved


def _fetch_and_stage(
    store: Store,
    remote: RemoteTier,
    manifest: pb.Manifest,
    artifact_id: str,
    digests: list[bytes],
    moved: Moved,
) -> None:
    fetched = remote.get_pages(manifest.model_fingerprint, digests)
    sizes = page_sizes(manifest)
    absent = [d for d in digests if d not in fetched or len(fetched[d]) != sizes[d]]
    if absent:
        if fetched:  # keep what was verified: a retry need not fetch it again
            store.stage_pages(page_records_of({d: fetched[d] for d in fetched if d not in absent}))
        remote.breaker.require()
        raise DataLoss(
            f"page {absent[0].hex()[:16]} of artifact {artifact_id[:16]} could not be read "
            f"from the remote tier intact ({len(absent)} of {len(digests)} pages missing or "
            "corrupt there); nothing was imported: `kvgraft remote status` says more"
        )
    store.stage_pages(page_records_of(fetched))
    moved.pages += len(fetched)
    moved.bytes += sum(len(data) for data in fetched.values())
