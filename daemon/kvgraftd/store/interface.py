"""The store's interfaces: what each kind of caller may call on a store, declared.

Three Protocols, each a part of the next:

* `PageSource`: page reads, every page verified (or handed out with its xxh3-128
  for a reader that checks it as it reads: `pages_to_check`). The tiers'
  host cache (kvgraftd.tiers.host_cache) and the engine's KV context need no more.
* `EngineStore`: what the engine and the library call on the store they are
  given: prefix lookups, leases, records, trust, deposits and deletes.
* `ArtifactStore`: the whole interface of kvgraftd.store.artifact_store.Store,
  which the store RPCs (kvgraftd.store.service), replication, the cache keeper
  and the scrubber call.

kvgraftd.store.artifact_store.Store implements `ArtifactStore`; so does
kvgraftd.remote.backed_store.RemoteBackedStore, the same store seen through the
remote tier, which main hands to the store RPCs and to the engine in its place;
kvgraftd.store.tenant_view.TenantView, one tenant's view of either, implements
`EngineStore`. tests/remote and tests/store hold each class to every member of
its Protocol, signatures included. A method added to the Store is declared here
first, or the test fails: a caller typed against a Protocol never reaches a
method that only the local store has.

This module declares; it implements nothing, and imports no store module that
imports it (the results below, `CommitResult` and `StoreStats`, are defined here).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store.catalog import ArtifactRecord, Visible
from kvgraftd.store.eviction import Evictor
from kvgraftd.store.page_records import Framer, InPlacePage, PageRecord
from kvgraftd.store.signing import TrustPolicy
from kvgraftd.store.trust_index import ChainMatch
from kvgraftd.store.usage import Usage


@dataclass(frozen=True)
class CommitResult:
    artifact_id: str
    already_present: bool
    pages_written: int
    bytes_written: int
    sequence: int


@dataclass(frozen=True)
class StoreStats:
    artifacts: int
    pages: int
    page_bytes: int
    staged_pages: int
    map_size_bytes: int
    map_used_bytes: int
    segment_disk_bytes: int
    disk_free_bytes: int
    last_sequence: int


@runtime_checkable
class PageSource(Protocol):
    """Stored pages, read by their SHA-256; a corrupt one raises DataLoss (CorruptPage)."""

    def read_pages_into(self, digests: Sequence[bytes], dests: Sequence[np.ndarray]) -> None:
        """Read each page into its uint8 destination and verify it there."""

    def verified_pages(self, digests: Sequence[bytes]) -> AbstractContextManager[list[np.ndarray]]:
        """The pages, each read into an array of its own and verified there."""

    def pages_to_check(
        self, digests: Sequence[bytes]
    ) -> AbstractContextManager[list[tuple[bytes, InPlacePage | np.ndarray]]]:
        """(xxh3-128, the page where it lies, or a copy) of each page, not yet checked, for
        the caller to check (kvgraftd.store.page_records.unchecked_pages)."""

    def read_page(self, digest: bytes) -> tuple[bytes, bytes]:
        """One page's bytes and xxh3-128, verified."""


@runtime_checkable
class EngineStore(PageSource, Protocol):
    """What the engine and the library call on their store."""

    def resolve(self, id_or_prefix: str) -> str:
        """The full id of the one artifact whose id starts with `id_or_prefix`."""

    def get_record(self, artifact_id: str) -> ArtifactRecord: ...

    def provenance(self, artifact_id: str) -> pb.Provenance: ...

    def trust_artifact(self, artifact_id: str, provenance: pb.Provenance) -> pb.Provenance:
        """Record more trust in a stored artifact; the provenance it now has."""

    def longest_chain(
        self,
        fingerprint: bytes,
        profile: pb.ComputeProfile,
        layout: pb.KvLayout,
        token_ids: Sequence[int],
        hold: ExitStack | None = None,
    ) -> ChainMatch:
        """The longest stored trusted prefix of `token_ids`, its voucher leased in `hold`."""

    def longest_untrusted(
        self,
        fingerprint: bytes,
        profile: pb.ComputeProfile,
        layout: pb.KvLayout,
        token_ids: Sequence[int],
    ) -> tuple[int, str]:
        """(tokens, id) of the longest prefix an untrusted artifact holds."""

    def check_servable(self, artifact_id: str) -> None:
        """DataLoss for a quarantined artifact."""

    def reading(self, artifact_id: str, reused_tokens: int = 0) -> AbstractContextManager[None]:
        """A lease: the artifact is not removed while it is held (NotFound if gone)."""

    def missing_pages(self, digests: Sequence[bytes]) -> list[bytes]: ...

    def commit_artifact(
        self,
        manifest: pb.Manifest,
        records: Mapping[bytes, PageRecord],
        provenance: pb.Provenance = ...,
    ) -> CommitResult: ...

    def delete_artifact(self, artifact_id: str, wait_s: float = ...) -> tuple[int, int]: ...

    def changes_since(self, sequence: int, limit: int = 1000) -> list[pb.ChangeRecord]: ...


@runtime_checkable
class ArtifactStore(EngineStore, Protocol):
    """The whole store: kvgraftd.store.artifact_store.Store's interface."""

    path: Path
    evictor: Evictor

    def close(self) -> None: ...

    # pages and uploads (kvgraftd.store.staging)
    def pages_not_owned(self, tenant: str, digests: Sequence[bytes]) -> list[bytes]: ...

    def read_pages_framed(self, digests: Sequence[bytes], frame: Framer) -> bytes: ...

    def stage_pages(self, records: Mapping[bytes, PageRecord], limit_bytes: int = 0) -> int: ...

    def uploading(
        self, staged: Mapping[bytes, object], for_s: float = ...
    ) -> AbstractContextManager[None]: ...

    def collect_staged(self, older_than_s: float) -> int: ...

    # artifacts, and prefixes, as some tenant sees them (kvgraftd.store.tenant_view)
    def resolve(self, id_or_prefix: str, visible: Visible | None = None) -> str: ...

    def longest_chain(
        self,
        fingerprint: bytes,
        profile: pb.ComputeProfile,
        layout: pb.KvLayout,
        token_ids: Sequence[int],
        hold: ExitStack | None = None,
        namespace: str = "",
    ) -> ChainMatch: ...

    def longest_untrusted(
        self,
        fingerprint: bytes,
        profile: pb.ComputeProfile,
        layout: pb.KvLayout,
        token_ids: Sequence[int],
        visible: Visible | None = None,
    ) -> tuple[int, str]: ...

    def list_records(
        self, after: bytes, limit: int, visible: Visible | None = None
    ) -> list[tuple[str, ArtifactRecord]]: ...

    def set_pinned(self, artifact_id: str, pinned: bool, ttl_s: float = 0) -> ArtifactRecord: ...

    def stats(self) -> StoreStats: ...

    def meta_time(self, name: bytes) -> int: ...

    def set_meta_time(self, name: bytes, unix_ms: int) -> None: ...

    # the change feed
    def wake(self) -> None: ...

    def wait_for_change(self, timeout_s: float) -> None: ...

    # trust (kvgraftd.store.trusted_prefixes)
    def reevaluate_trust(self, policy: TrustPolicy) -> tuple[int, int] | None: ...

    def signer_keys(self, artifact_ids: Iterable[str]) -> dict[str, frozenset[bytes]]: ...

    # the cache lifecycle (kvgraftd.store.lifecycle)
    def usage(self, artifact_id: str) -> Usage | None: ...

    def evictable(self) -> dict[bytes, Usage]: ...

    def cache_totals(self) -> tuple[int, int]: ...

    def cache_totals_of(self, tenant: str) -> tuple[int, int]: ...

    def raise_inflation(self, priority: float) -> None: ...

    def remove(self, aids: Iterable[bytes], reason: int) -> tuple[int, int]: ...

    def give_back(self) -> None: ...

    def flush_usage(self) -> int: ...

    def pin_expiry(self, artifact_id: str) -> int: ...

    def due_expiries(self) -> list[bytes]: ...

    def expire_due(self) -> int: ...

    # quarantine (kvgraftd.store.quarantine)
    def hash_batch(self, after: bytes, limit: int) -> tuple[bytes, int, int, list[bytes]]: ...

    def quarantine(self, digests: list[bytes]) -> list[str]: ...

    def is_quarantined(self, artifact_id: str) -> bool: ...

    def quarantined_ids(self) -> list[str]: ...
