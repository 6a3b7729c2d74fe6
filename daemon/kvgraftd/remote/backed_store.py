"""The local store seen through the remote tier: the seam between LMDB and the bucket.

`RemoteBackedStore` wraps a kvgraftd.store.artifact_store.Store and implements the
store's declared interface, kvgraftd.store.interface.ArtifactStore (and so the
engine's, EngineStore), each method spelled out with the Store's signature (a test
holds both classes to every member of the Protocol); it passes every call through,
except these:

* `commit_artifact` commits locally first, then, in write-through mode,
  uploads the artifact before returning (kvgraftd.remote.transfer); an upload
  that fails, or is not tried because the remote tier is not answering (its
  breaker is open), raises Unavailable saying the artifact *is* stored
  locally, no longer held against eviction, and to retry the call: the local
  commit stands, since the local tier is complete on its own and every upload
  is idempotent. In write-back mode it queues the id
  (kvgraftd.remote.push_queue) and returns at once. Either way it is held
  against eviction from before its commit to the end of its upload
  (`uploads.committing`: the caller passes the queue or uploads whose `holds`
  the store's evictor keeps).
* `longest_chain` (read-through views only) continues a local prefix match
  in the bucket: the chain object of the first page not found locally names
  an artifact; its manifest is fetched and verified (id = SHA-256 of its
  bytes), its chain entries recomputed, and every further page of the prompt
  that it holds is taken from it; the next miss asks the bucket again. The
  pages this store lacks are fetched, SHA-256-verified and staged locally
  (so the next read is local), and the match stops at the first page that
  could not be had intact. A daemon with an empty store thus reuses the
  pages another daemon deposited, and the grafted bytes are the same bytes.
* `resolve` (read-through views only): an id unknown locally is looked up in
  the bucket and imported whole (verified) before the engine grafts it.

Only the engine gets a read-through view; the store RPCs (Stat, Delete,
GetArtifact, ...) see the local store, so a Delete never downloads anything.
Remote reads never raise: a miss, a dead server or a corrupt object shorten
the match and the engine computes the rest, so the receipt is the same. A
view's tier is RemoteTier.on_request_path's (one attempt per S3 request), and
nothing is asked while the breaker is open.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack

import numpy as np

from kvgraft.artifact import artifact_id, parse_manifest
from kvgraft.errors import KvgraftError, NotFound
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.remote.push_queue import PushesUnderWay, WriteBackQueue
from kvgraftd.remote.tier import RemoteTier
from kvgraftd.remote.transfer import find_remote, import_artifact, push_through
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.catalog import ArtifactRecord, Visible
from kvgraftd.store.chains import ChainEntry, chain_keys, manifest_entries
from kvgraftd.store.interface import CommitResult, StoreStats
from kvgraftd.store.page_records import Framer, PageRecord, page_records_of
from kvgraftd.store.signing import TrustPolicy
from kvgraftd.store.trust_index import NO_MATCH, UNRECORDED, ChainMatch, is_trusted
from kvgraftd.store.usage import Usage

log = logging.getLogger(__name__)

MANIFEST_CACHE = 64  # verified remote manifests kept (their chain entries), by id
CHAIN_DEADLINE_FACTOR = 3  # a remote prefix match takes at most this many request timeouts


class RemoteBackedStore:
    """`store` as the components see it through the remote tier (an ArtifactStore)."""

    def __init__(
        self,
        store: Store,
        remote: RemoteTier,
        trust: TrustPolicy,
        *,
        read_through: bool,
        uploads: WriteBackQueue | PushesUnderWay,  # the holds the store's evictor keeps
    ) -> None:
        self._store = store
        self._remote = remote
        self._trust = trust
        self._read_through = read_through
        self._uploads = uploads
        self._write_back = isinstance(uploads, WriteBackQueue)
        # verified remote manifests of trusted artifacts: their chain entries, and who vouches
        self._entries: OrderedDict[str, tuple[dict[bytes, ChainEntry], pb.Provenance]] = (
            OrderedDict()
        )
        self._lock = threading.Lock()
        self.path = store.path
        self.evictor = store.evictor

    # ------------------------------------------------------------------
    # the Store's interface (kvgraftd.store.interface.ArtifactStore), passed through

    def close(self) -> None:
        self._store.close()

    def missing_pages(self, digests: Sequence[bytes]) -> list[bytes]:
        return self._store.missing_pages(digests)

    def pages_not_owned(self, tenant: str, digests: Sequence[bytes]) -> list[bytes]:
        return self._store.pages_not_owned(tenant, digests)

    def read_pages_into(self, digests: Sequence[bytes], dests: Sequence[np.ndarray]) -> None:
        self._store.read_pages_into(digests, dests)

    def verified_pages(self, digests: Sequence[bytes]) -> AbstractContextManager[list[np.ndarray]]:
        return self._store.verified_pages(digests)

    def pages_to_check(self, digests: Sequence[bytes]) -> AbstractContextManager:
        return self._store.pages_to_check(digests)

    def read_page(self, digest: bytes) -> tuple[bytes, bytes]:
        return self._store.read_page(digest)

    def read_pages_framed(self, digests: Sequence[bytes], frame: Framer) -> bytes:
        return self._store.read_pages_framed(digests, frame)

    def stage_pages(self, records: Mapping[bytes, PageRecord], limit_bytes: int = 0) -> int:
        return self._store.stage_pages(records, limit_bytes)

    def collect_staged(self, older_than_s: float) -> int:
        return self._store.collect_staged(older_than_s)

    def uploading(
        self, staged: Mapping[bytes, object], for_s: float = math.inf
    ) -> AbstractContextManager[None]:
        return self._store.uploading(staged, for_s)

    def provenance(self, artifact_id: str) -> pb.Provenance:
        return self._store.provenance(artifact_id)

    def reevaluate_trust(self, policy: TrustPolicy) -> tuple[int, int] | None:
        return self._store.reevaluate_trust(policy)

    def signer_keys(self, artifact_ids: Iterable[str]) -> dict[str, frozenset[bytes]]:
        return self._store.signer_keys(artifact_ids)

    def longest_untrusted(
        self,
        fingerprint: bytes,
        profile: pb.ComputeProfile,
        layout: pb.KvLayout,
        token_ids: Sequence[int],
        visible: Visible | None = None,
    ) -> tuple[int, str]:
        return self._store.longest_untrusted(fingerprint, profile, layout, token_ids, visible)

    def trust_artifact(self, artifact_id: str, provenance: pb.Provenance) -> pb.Provenance:
        return self._store.trust_artifact(artifact_id, provenance)

    def delete_artifact(self, artifact_id: str, wait_s: float = 20.0) -> tuple[int, int]:
        return self._store.delete_artifact(artifact_id, wait_s)

    def set_pinned(self, artifact_id: str, pinned: bool, ttl_s: float = 0) -> ArtifactRecord:
        return self._store.set_pinned(artifact_id, pinned, ttl_s)

    # the cache lifecycle (kvgraftd.store.lifecycle, kvgraftd.store.quarantine)

    def reading(self, artifact_id: str, reused_tokens: int = 0) -> AbstractContextManager[None]:
        return self._store.reading(artifact_id, reused_tokens)

    def usage(self, artifact_id: str) -> Usage | None:
        return self._store.usage(artifact_id)

    def evictable(self) -> dict[bytes, Usage]:
        return self._store.evictable()

    def cache_totals(self) -> tuple[int, int]:
        return self._store.cache_totals()

    def cache_totals_of(self, tenant: str) -> tuple[int, int]:
        return self._store.cache_totals_of(tenant)

    def give_back(self) -> None:
        self._store.give_back()

    def raise_inflation(self, priority: float) -> None:
        self._store.raise_inflation(priority)

    def remove(self, aids: Iterable[bytes], reason: int) -> tuple[int, int]:
        return self._store.remove(aids, reason)

    def flush_usage(self) -> int:
        return self._store.flush_usage()

    def pin_expiry(self, artifact_id: str) -> int:
        return self._store.pin_expiry(artifact_id)

    def due_expiries(self) -> list[bytes]:
        return self._store.due_expiries()

    def expire_due(self) -> int:
        return self._store.expire_due()

    def hash_batch(self, after: bytes, limit: int) -> tuple[bytes, int, int, list[bytes]]:
        return self._store.hash_batch(after, limit)

    def quarantine(self, digests: list[bytes]) -> list[str]:
        return self._store.quarantine(digests)

    def is_quarantined(self, artifact_id: str) -> bool:
        return self._store.is_quarantined(artifact_id)

    def quarantined_ids(self) -> list[str]:
        return self._store.quarantined_ids()

    def check_servable(self, artifact_id: str) -> None:
        self._store.check_servable(artifact_id)

    def meta_time(self, name: bytes) -> int:
        return self._store.meta_time(name)

    def set_meta_time(self, name: bytes, unix_ms: int) -> None:
        self._store.set_meta_time(name, unix_ms)

    def wake(self) -> None:
        self._store.wake()

    def get_record(self, artifact_id: str) -> ArtifactRecord:
        return self._store.get_record(artifact_id)

    def list_records(
        self, after: bytes, limit: int, visible: Visible | None = None
    ) -> list[tuple[str, ArtifactRecord]]:
        return self._store.list_records(after, limit, visible)

    def changes_since(self, sequence: int, limit: int = 1000) -> list[pb.ChangeRecord]:
        return self._store.changes_since(sequence, limit)

    def wait_for_change(self, timeout_s: float) -> None:
        self._store.wait_for_change(timeout_s)

    def stats(self) -> StoreStats:
        return self._store.stats()

    # ------------------------------------------------------------------
    # writes

    def commit_artifact(
        self,
        manifest: pb.Manifest,
        records: Mapping[bytes, PageRecord],
        provenance: pb.Provenance = UNRECORDED,
    ) -> CommitResult:
        full_id = artifact_id(manifest)
        stored = lambda: self._store.usage(full_id) is not None  # noqa: E731
        with self._uploads.committing(full_id, stored):  # held from before the commit
            result = self._store.commit_artifact(manifest, records, provenance)
            if not self._write_back:
                push_through(self._store, self._remote, result.artifact_id, records)
        return result

    # ------------------------------------------------------------------
    # reads

    def resolve(self, id_or_prefix: str, visible: Visible | None = None) -> str:
        """A tenant's id (`visible` given) is looked up locally only: an import would
        take the time of another tenant's artifact, and store it."""
        try:
            return self._store.resolve(id_or_prefix, visible)
        except NotFound:
            if visible is not None or not self._read_through:
                raise
            if not self._remote.breaker.available():
                raise
            try:
                found = find_remote(self._remote, id_or_prefix)
            except KvgraftError:
                found = None  # the remote failed: the local answer stands
            if found is None:
                raise
        fingerprint, full = found
        import_artifact(self._store, self._remote, fingerprint, full, self._trust)
        return self._store.resolve(full)

    def longest_chain(
        self,
        fingerprint: bytes,
        profile: pb.ComputeProfile,
        layout: pb.KvLayout,
        token_ids: Sequence[int],
        hold: ExitStack | None = None,
        namespace: str = "",
    ) -> ChainMatch:
        found = self._store.longest_chain(fingerprint, profile, layout, token_ids, hold, namespace)
        page_tokens = profile.page_tokens
        max_pages = len(token_ids) // page_tokens
        whole = found.tokens // page_tokens  # the bucket holds whole pages only
        if not self._read_through or whole >= max_pages or not self._remote.breaker.available():
            return found
        try:
            more = self._remote_chain(
                fingerprint, profile, layout, token_ids, whole, max_pages, namespace
            )
        except KvgraftError as exc:  # e.g. the local disk is full: serve what is local
            log.warning("remote prefix match abandoned: %s", exc)
            more = NO_MATCH
        if not more.entries:
            return found
        # The bucket continues the whole local pages, past a page used here only in part:
        # the artifact vouching for that page holds the ones before it.
        local = [
            pb.GraftedArtifact(
                artifact_id=g.artifact_id,
                tokens=whole * page_tokens,
                trust=g.trust,
                vouched_by=g.vouched_by,
                owner=g.owner,
            )
            for g in found.grafted[:1]
            if whole
        ]
        return ChainMatch(
            found.entries[:whole] + more.entries,
            whole * page_tokens + more.tokens,
            local + more.grafted,
        )

    def _remote_chain(
        self,
        fingerprint: bytes,
        profile: pb.ComputeProfile,
        layout: pb.KvLayout,
        token_ids: Sequence[int],
        start: int,
        max_pages: int,
        namespace: str,
    ) -> ChainMatch:
        deadline = time.monotonic() + CHAIN_DEADLINE_FACTOR * self._remote.settings.timeout_s
        pages = chain_keys(fingerprint, profile, layout, token_ids, max_pages, namespace)
        keys = [key for _, key in pages]
        page_tokens = profile.page_tokens
        out: list[ChainEntry] = []
        vouchers: list[tuple[str, pb.Provenance, int]] = []  # artifact, provenance, pages
        page = start
        while page < max_pages and time.monotonic() < deadline:
            artifact_id = self._remote.get_chain(fingerprint, keys[page])
            known = self._chain_entries(fingerprint, artifact_id) if artifact_id else None
            entries, provenance = known if known else (None, None)
            progressed = False
            while page < max_pages and entries:
                entry = entries.get(keys[page])
                wanted = tuple(token_ids[page * page_tokens : (page + 1) * page_tokens])
                if entry is None or entry.token_ids != wanted or entry.page_index != page:
                    break
                out.append(entry)
                page += 1
                progressed = True
            if not progressed:
                break  # a miss, or an object naming an artifact that does not hold the key
            vouchers.append((artifact_id, provenance, page))
        kept = self._localize(fingerprint, out, deadline)
        end = start + len(kept)
        grafted = [
            pb.GraftedArtifact(
                artifact_id=aid,
                tokens=min(pages, end) * page_tokens,
                trust=provenance.trust,
                vouched_by=provenance.vouched_by,
            )
            for aid, provenance, pages in vouchers
            if min(pages, end) > start
        ]
        return ChainMatch(kept, len(kept) * page_tokens, grafted)

    def _chain_entries(
        self, fingerprint: bytes, artifact_id: str
    ) -> tuple[dict[bytes, ChainEntry], pb.Provenance] | None:
        """The chain entries of a remote artifact this daemon trusts (None otherwise)."""
        with self._lock:
            cached = self._entries.get(artifact_id)
            if cached is not None:
                self._entries.move_to_end(artifact_id)
                return cached
        canonical = self._remote.get_manifest(fingerprint, artifact_id)  # verified against the id
        if canonical is None:
            return None
        try:
            manifest = parse_manifest(canonical)
        except KvgraftError as exc:
            log.error("event=remote_data_loss artifact_id=%s: %s", artifact_id, exc)
            return None
        if manifest.model_fingerprint != fingerprint:
            return None
        signatures = self._remote.get_signatures(fingerprint, artifact_id)
        provenance = self._trust.received(artifact_id, signatures, "remote")
        if not is_trusted(provenance):
            return None  # nobody this daemon trusts vouches for it: never grafted
        known = (dict(manifest_entries(manifest)), provenance)
        with self._lock:
            self._entries[artifact_id] = known
            while len(self._entries) > MANIFEST_CACHE:
                self._entries.popitem(last=False)
        return known

    def _localize(
        self, fingerprint: bytes, entries: list[ChainEntry], deadline: float
    ) -> list[ChainEntry]:
        """Fetch and stage the pages of `entries` this store lacks; the entries now all local."""
        if not entries:
            return []
        digests = [d for entry in entries for d in entry.page_sha256]
        missing = self._store.missing_pages(list(dict.fromkeys(digests)))
        fetched = self._remote.get_pages(
            fingerprint, missing, timeout_s=max(0.0, deadline - time.monotonic())
        )
        if fetched:
            self._store.stage_pages(page_records_of(fetched))
        absent = set(missing) - set(fetched)
        for index, entry in enumerate(entries):
            if absent.intersection(entry.page_sha256):
                return entries[:index]
        return entries
