"""The store as one tenant sees it: its own artifacts and the shared ones, nothing else.

`TenantView` wraps a store (a kvgraftd.store.artifact_store.Store, or the remote
tier's view of it) for one tenant (kvgraft.tenancy) and offers the part of the
store's interface that the store RPCs, the engine and the library use, each
method spelled out; a method it does not offer (the change feed's waiting,
scrubs, trust re-evaluation) fails with AttributeError, never passes through.

* Reading: an id, or a prefix, names only an artifact the tenant may see (its
  own, or a published one). Another tenant's id answers NotFound in the words an
  id nobody stored answers (kvgraftd.store.catalog.not_found), with the same
  store reads up to there: no existence oracle. Listings hold what it may see.
* Writing: delete, pin and publish need an artifact the tenant owns; a
  published artifact of another tenant is read-only (PermissionDenied, which
  names nothing the caller could not already read). A manifest it commits is
  labelled with its name (`kvgraft.tenant`); a manifest that arrived labelled
  otherwise is relabelled, which gives it another id: the signatures it carried
  signed the old id and are dropped (it is stored untrusted, as any upload).
* Pages: it is told only about pages its own artifacts reference, or that it
  staged itself (`pages_not_owned`, kvgraftd.store.owned_pages), and a commit
  must bring every other page: so an upload is received and hashed in full even
  where another tenant holds the page, and no answer says who holds what (a commit
  reports as written what it brought). On disk the page is then stored once (its
  SHA-256 names it).
* Reuse: prompts match pages in the tenant's own namespace and the shared one
  (kvgraftd.store.chains salts the chain root); the longer match wins, the own
  one on a tie. Lookup does both walks for every prompt, whoever holds what.
* Budget: `evictor` keeps the tenant within `store_budget_bytes` of its own
  artifacts (pages shared with other artifacts counted in each), evicting its own
  only, its conversation contexts first (kvgraft.conversations); the store's own
  budget, and the conversation contexts' bound, still hold all of them together.
* Figures (`stats`, which Stats and Info answer): its own only, never the whole
  store's: its artifacts and the page bytes its budget counts, the distinct pages they
  reference and the disk those take (block-aligned, as stored: a page it shares with
  another tenant counts in both), and as free disk the room its budget leaves (0
  without a budget of its own: the store's free disk would tell of others' writes).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack

import numpy as np

from kvgraft.artifact import page_sizes
from kvgraft.errors import InvalidArgument, NotFound, PermissionDenied
from kvgraft.page_buffers import block_aligned
from kvgraft.tenancy import (
    SHARED_NAMESPACE,
    is_shared,
    owned_labels,
    owner_of,
    tenant_namespace,
    visible_to,
    writable_by,
)
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store.catalog import ArtifactRecord
from kvgraftd.store.eviction import CacheBudget, Evictor
from kvgraftd.store.interface import CommitResult, StoreStats
from kvgraftd.store.page_records import Framer, PageRecord
from kvgraftd.store.trust_index import UNRECORDED, ChainMatch
from kvgraftd.store.usage import Usage

STAGED_REMEMBERED = 1 << 20  # the pages a tenant staged that it is told it holds, at most
OWN_PAGES_BATCH = 256  # records read a transaction when its figures are counted


class TenantView:
    def __init__(self, store, tenant: str, budget: CacheBudget) -> None:
        self._store = store
        self.tenant = tenant
        self.namespace = tenant_namespace(tenant)
        self.path = store.path
        self.evictor = Evictor(self, budget)
        self._staged: OrderedDict[bytes, None] = OrderedDict()  # pages it staged itself
        self._lock = threading.Lock()

    def _visible(self, labels: Mapping[str, str]) -> bool:
        return visible_to(self.tenant, labels)

    def _seen(self, id_or_prefix: str) -> str:
        """The full id of an artifact the tenant may see; NotFound as for no artifact."""
        return self._store.resolve(id_or_prefix, self._visible)

    def _owned(self, id_or_prefix: str) -> str:
        full = self._seen(id_or_prefix)
        labels = self._store.get_record(full).manifest().labels
        if not writable_by(self.tenant, labels):
            owner = owner_of(labels) or "the operator"
            raise PermissionDenied(
                f"artifact {full[:16]} is shared by {owner}: only its owner may change or "
                "delete it; graft it, or copy what you need into an artifact of your own"
            )
        return full

    # ------------------------------------------------------------------
    # pages (the engine reads pages by the digests of an artifact it was allowed)

    def missing_pages(self, digests: Sequence[bytes]) -> list[bytes]:
        """The pages none of its artifacts reference and it did not stage itself (a staged
        page collected since counts as missing again: it must be sent again)."""
        not_owned = self._store.pages_not_owned(self.tenant, digests)
        with self._lock:
            staged = [d for d in not_owned if d in self._staged]
        gone = set(self._store.missing_pages(staged)) if staged else set()
        return [d for d in not_owned if d not in staged or d in gone]

    def read_pages_into(self, digests: Sequence[bytes], dests: Sequence[np.ndarray]) -> None:
        self._store.read_pages_into(digests, dests)

    def verified_pages(self, digests: Sequence[bytes]) -> AbstractContextManager:
        return self._store.verified_pages(digests)

    def pages_to_check(self, digests: Sequence[bytes]) -> AbstractContextManager:
        return self._store.pages_to_check(digests)

    def read_page(self, digest: bytes) -> tuple[bytes, bytes]:
        return self._store.read_page(digest)

    def read_pages_framed(self, digests: Sequence[bytes], frame: Framer) -> bytes:
        return self._store.read_pages_framed(digests, frame)

    def stage_pages(self, records: Mapping[bytes, PageRecord], limit_bytes: int = 0) -> int:
        written = self._store.stage_pages(records, limit_bytes)
        with self._lock:
            self._staged.update(dict.fromkeys(records))
            while len(self._staged) > STAGED_REMEMBERED:
                self._staged.popitem(last=False)
        return written

    def uploading(self, staged: Mapping[bytes, object], for_s: float) -> AbstractContextManager:
        return self._store.uploading(staged, for_s)

    # ------------------------------------------------------------------
    # artifacts

    def resolve(self, id_or_prefix: str) -> str:
        return self._seen(id_or_prefix)

    def get_record(self, artifact_id: str) -> ArtifactRecord:
        return self._store.get_record(self._seen(artifact_id))

    def list_records(self, after: bytes, limit: int) -> list[tuple[str, ArtifactRecord]]:
        return self._store.list_records(after, limit, self._visible)

    def provenance(self, artifact_id: str) -> pb.Provenance:
        return self._store.provenance(self._seen(artifact_id))

    def trust_artifact(self, artifact_id: str, provenance: pb.Provenance) -> pb.Provenance:
        return self._store.trust_artifact(self._seen(artifact_id), provenance)

    def delete_artifact(self, artifact_id: str, wait_s: float = 30.0) -> tuple[int, int]:
        return self._store.delete_artifact(self._owned(artifact_id), wait_s)

    def set_pinned(self, artifact_id: str, pinned: bool, ttl_s: float = 0) -> ArtifactRecord:
        return self._store.set_pinned(self._owned(artifact_id), pinned, ttl_s)

    def commit_artifact(
        self,
        manifest: pb.Manifest,
        records: Mapping[bytes, PageRecord],
        provenance: pb.Provenance = UNRECORDED,
    ) -> CommitResult:
        labels = manifest.labels
        shared = is_shared(labels) and owner_of(labels) == self.tenant
        own = owned_labels(labels, self.tenant, shared)
        if dict(labels) != own:  # labelled for someone else: another artifact, unsigned
            manifest = pb.Manifest.FromString(manifest.SerializeToString())
            manifest.labels.clear()
            manifest.labels.update(own)
            provenance = pb.Provenance(
                trust=pb.Provenance.TRUST_UNTRUSTED,
                origin=provenance.origin or "upload",
                replicated_from=provenance.replicated_from,
            )
        sizes = page_sizes(manifest)
        brought = self.missing_pages(list(sizes))
        absent = [d for d in brought if d not in records]
        if absent:  # the store's words for a page nobody stored (kvgraftd.store.page_store)
            raise InvalidArgument(
                f"page {absent[0].hex()[:16]} is neither stored nor sent; ask MissingPages "
                "and send every page it returns before the manifest"
            )
        self.evictor.make_room(sum(sizes[d] for d in brought))
        result = self._store.commit_artifact(manifest, records, provenance)
        with self._lock:
            for digest in sizes:
                self._staged.pop(digest, None)
        self.evictor.evict_past_high()
        if result.already_present:
            return result
        # what it brought, not what the disk lacked: another tenant's pages make no difference
        return dataclasses.replace(
            result, pages_written=len(brought), bytes_written=sum(sizes[d] for d in brought)
        )

    # ------------------------------------------------------------------
    # prefix reuse (the engine)

    def longest_chain(
        self,
        fingerprint: bytes,
        profile: pb.ComputeProfile,
        layout: pb.KvLayout,
        token_ids: Sequence[int],
        hold: ExitStack | None = None,
    ) -> ChainMatch:
        own = self._store.longest_chain(
            fingerprint, profile, layout, token_ids, None, self.namespace
        )
        shared = self._store.longest_chain(
            fingerprint, profile, layout, token_ids, None, SHARED_NAMESPACE
        )
        namespace = self.namespace if own.tokens >= shared.tokens else SHARED_NAMESPACE
        if hold is None or not max(own.tokens, shared.tokens):
            return own if namespace == self.namespace else shared
        return self._store.longest_chain(fingerprint, profile, layout, token_ids, hold, namespace)

    def longest_untrusted(
        self,
        fingerprint: bytes,
        profile: pb.ComputeProfile,
        layout: pb.KvLayout,
        token_ids: Sequence[int],
    ) -> tuple[int, str]:
        return self._store.longest_untrusted(fingerprint, profile, layout, token_ids, self._visible)

    # ------------------------------------------------------------------
    # the cache lifecycle, for its artifacts

    def reading(self, artifact_id: str, reused_tokens: int = 0) -> AbstractContextManager:
        return self._store.reading(self._seen(artifact_id), reused_tokens)

    def usage(self, artifact_id: str) -> Usage | None:
        return self._store.usage(self._seen(artifact_id))

    def pin_expiry(self, artifact_id: str) -> int:
        return self._store.pin_expiry(self._seen(artifact_id))

    def evictable(self) -> dict[bytes, Usage]:
        return {a: u for a, u in self._store.evictable().items() if u.owner == self.tenant}

    def cache_totals(self) -> tuple[int, int]:
        return self._store.cache_totals_of(self.tenant)

    def raise_inflation(self, priority: float) -> None:
        self._store.raise_inflation(priority)

    def remove(self, aids: Iterable[bytes], reason: int) -> tuple[int, int]:
        return self._store.remove(aids, reason)

    def quarantine(self, digests: list[bytes]) -> list[str]:
        return self._store.quarantine(digests)

    def is_quarantined(self, artifact_id: str) -> bool:
        return self._store.is_quarantined(self._seen(artifact_id))

    def check_servable(self, artifact_id: str) -> None:
        self._store.check_servable(self._seen(artifact_id))

    def quarantined_ids(self) -> list[str]:
        return [aid for aid in self._store.quarantined_ids() if self._may_see(aid)]

    def _may_see(self, full_id: str) -> bool:
        try:
            self._seen(full_id)
        except NotFound:
            return False
        return True

    # ------------------------------------------------------------------
    # what the library's index reads, and what Stats and Info answer

    def changes_since(self, sequence: int, limit: int = 1000) -> list[pb.ChangeRecord]:
        """The feed's records of artifacts it may see (additions of others' left out)."""
        return [
            record
            for record in self._store.changes_since(sequence, limit)
            if record.kind != pb.ChangeRecord.KIND_ADDED or self._may_see(record.artifact_id)
        ]

    def wait_for_change(self, timeout_s: float) -> None:
        self._store.wait_for_change(timeout_s)

    def stats(self) -> StoreStats:
        """Its own figures only (see the module's contract); the staged pages, the index
        and the change feed are the whole store's: 0."""
        artifacts, page_bytes = self.cache_totals()
        pages = self._own_pages()
        budget = self.evictor.budget.bytes
        return StoreStats(
            artifacts=artifacts,
            pages=len(pages),
            page_bytes=page_bytes,
            staged_pages=0,
            map_size_bytes=0,
            map_used_bytes=0,
            segment_disk_bytes=sum(block_aligned(size) for size in pages.values()),
            disk_free_bytes=max(0, budget - page_bytes) if budget else 0,
            last_sequence=0,
        )

    def _own_pages(self) -> dict[bytes, int]:
        """The size of each distinct page its artifacts reference (a scan of the catalogue,
        as a listing by a tenant is)."""
        sizes: dict[bytes, int] = {}
        owned = lambda labels: owner_of(labels) == self.tenant  # noqa: E731
        after = b""
        while batch := self._store.list_records(after, OWN_PAGES_BATCH, owned):
            for _, record in batch:
                sizes.update(page_sizes(record.manifest()))
            after = bytes.fromhex(batch[-1][0])
        return sizes
