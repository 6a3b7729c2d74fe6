"""The store RPCs: what each call does, independent of gRPC.

Each method takes a request message (or, for the bulk RPCs, raw wire bytes)
and returns a response message (or raw wire bytes). Failures raise the
kvgraft.errors taxonomy; kvgraftd.server.grpc_server maps them to status codes. Every
request is validated here before it touches the store.
"""

from __future__ import annotations

import copy
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass, fields

from kvgraft import __version__, wire
from kvgraft.artifact import DIGEST_BYTES, artifact_id, page_sizes
from kvgraft.errors import DataLoss, InvalidArgument, KvgraftError, Unavailable
from kvgraft.tenancy import writable_by
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.config import FIELDS, DaemonConfig
from kvgraftd.store import publishing
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.catalog import artifact_info
from kvgraftd.store.intake import PageIntake
from kvgraftd.store.interface import StoreStats
from kvgraftd.store.lmdb_env import unreachable_store
from kvgraftd.store.migration import STORE_FORMAT_VERSION
from kvgraftd.store.read_ahead import read_ahead
from kvgraftd.store.scrub import Scrubber
from kvgraftd.store.signing import Signer, TrustPolicy
from kvgraftd.store.upload_limits import UploadBounds

MAX_MISSING_QUERY = 100_000
MAX_LIST_PAGE = 1000
DEFAULT_LIST_PAGE = 100
WATCH_POLL_S = 0.5
READ_AHEAD_MESSAGES = 2  # PutArtifact messages taken ahead of the one being stored

MIN_SCRUB_BYTES_PER_S = 1 << 20
MAX_PIN_TTL_S = 10 * 365 * 86400


def _default(name: str):
    """The daemon's default of setting `name` (kvgraftd.config: the one place it is set)."""
    return FIELDS[name].default


@dataclass(frozen=True)
class ServiceLimits:
    """The settings of kvgraftd.config the store RPCs enforce (see their help there)."""

    spill_bytes: int = _default("spill_bytes")
    staged_max_bytes: int = _default("staged_max_bytes")
    staged_max_bytes_per_connection: int = _default("staged_max_bytes_per_connection")
    staged_ttl_s: float = _default("staged_ttl_s")
    upload_memory_bytes: int = _default("upload_memory_bytes")
    max_call_s: float = _default("max_call_s")  # an upload's pages are kept that long at most
    block_payload_bytes: int = wire.BLOCK_PAYLOAD_BYTES

    @classmethod
    def of(cls, config: DaemonConfig) -> ServiceLimits:
        return cls(**{name: getattr(config, name) for name in _CONFIGURED})


_CONFIGURED = [f.name for f in fields(ServiceLimits) if f.name in FIELDS]


class StoreService:
    """Info, PutArtifact, GetArtifact, MissingPages, List, Stat, Delete, Pin, Stats, Watch."""

    def __init__(
        self,
        store: Store,
        limits: ServiceLimits = ServiceLimits(),
        trust: TrustPolicy | None = None,
        scrubber: Scrubber | None = None,
        cache_mode: str = "explicit",
    ) -> None:
        self._store = store
        self._limits = limits
        self._uploads = UploadBounds.of(  # shared by every PutArtifact (store.upload_limits)
            spill_bytes=limits.spill_bytes,
            staged_max_bytes=limits.staged_max_bytes,
            staged_ttl_s=limits.staged_ttl_s,
            memory_bytes=limits.upload_memory_bytes,
            staged_per_connection=limits.staged_max_bytes_per_connection,
            budget_bytes=store.evictor.budget.bytes,
            running_s=limits.max_call_s,
        )
        self._scrubber = scrubber or Scrubber(store, 64 << 20)
        self._cache_mode = cache_mode
        # Decides what arriving artifacts are worth (kvgraftd.store.signing); tests that build a
        # service alone get a key of their own.
        self.trust = trust or TrustPolicy(Signer.generate())
        self._stopping = threading.Event()
        self.tenant = ""  # whose calls it answers (scoped), "": the operator's
        # Drawn per daemon start: replication tells a source that is its own target by it.
        self.instance_id = secrets.token_hex(16)

    def scoped(self, store, tenant: str) -> StoreService:
        """The same service over `store` as `tenant` sees it (kvgraftd.store.tenant_view):
        the upload bounds, trust, scrubs and instance are this one's, shared."""
        view = copy.copy(self)
        view._store, view.tenant = store, tenant
        return view

    def publish(self, request: pb.PublishRequest) -> pb.PublishResponse:
        """Publish or withdraw (kvgraftd.store.publishing)."""
        if request.withdraw:
            target = publishing.withdraw(self._store, self.tenant, request.artifact_id)
            record = self._store.get_record(target)
            info = self._info(target, record, record.manifest())
            self._store.delete_artifact(target)
            return pb.PublishResponse(info=info)
        shared = publishing.publish(self._store, self.tenant, self.trust, request.artifact_id)
        record = self._store.get_record(shared)
        return pb.PublishResponse(info=self._info(shared, record, record.manifest()))

    def stop_watches(self) -> None:
        """End follow Watch streams (shutdown): they never finish by themselves, so a
        drain would otherwise wait its whole grace period for them."""
        self._stopping.set()

    # ------------------------------------------------------------------
    def info(self, request: pb.InfoRequest) -> pb.InfoResponse:
        return pb.InfoResponse(
            version=__version__,
            store_format_version=STORE_FORMAT_VERSION,
            instance_id=self.instance_id,
            signing_key=self.trust.signer.public_key,
            tiers=[self._lmdb_tier(self._store_stats())],
            cache=self.cache_info(),
            scrub=self._scrubber.progress(),
        )

    def cache_info(self) -> pb.CacheInfo:
        evictor = self._store.evictor
        return pb.CacheInfo(
            budget_bytes=evictor.budget.bytes,
            budget_artifacts=evictor.budget.artifacts,
            policy=evictor.budget.policy,
            mode=self._cache_mode,
            evicted_artifacts=evictor.counters.artifacts,
            evicted_bytes=evictor.counters.bytes,
            expired_artifacts=evictor.counters.expired,
            quarantined_artifacts=len(self._store.quarantined_ids()),
        )

    def scrub(self, request: pb.ScrubRequest, is_active: Callable[[], bool]) -> Iterator:
        """Scrub the store (on a thread of its own: a caller that leaves does not stop it),
        its progress about twice a second, its findings last."""
        if request.bytes_per_s and request.bytes_per_s < MIN_SCRUB_BYTES_PER_S:
            raise InvalidArgument(
                "Scrub bytes_per_s is at least 1 MiB/s (0: the daemon's scrub_bytes_per_s)"
            )
        outcome: list = []
        finished = threading.Event()

        def work() -> None:
            try:
                outcome.append(self._scrubber.run(request.bytes_per_s))
            except BaseException as exc:  # handed to the caller below
                outcome.append(exc)
            finally:
                finished.set()

        threading.Thread(target=work, name="scrub-call", daemon=True).start()
        while not finished.wait(0.5):
            if not is_active():
                return
            yield self._scrubber.progress()
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        yield outcome[0]

    @staticmethod
    def _lmdb_tier(stats: StoreStats) -> pb.TierInfo:
        return pb.TierInfo(
            name="lmdb",
            capacity_bytes=stats.segment_disk_bytes + stats.map_used_bytes + stats.disk_free_bytes,
            used_bytes=stats.page_bytes,
            holding_bytes=stats.page_bytes,
            peak_bytes=stats.segment_disk_bytes + stats.map_used_bytes,
        )

    def _store_stats(self) -> StoreStats:
        """The store's figures; FailedPrecondition in words where its files cannot be
        reached (the data directory deleted or unmounted under the daemon): that is no
        bug of the daemon's, and INTERNAL would say it is."""
        try:
            return self._store.stats()
        except OSError as exc:
            raise unreachable_store(exc) from None

    def stats(self, request: pb.StatsRequest) -> pb.StatsResponse:
        s = self._store_stats()
        return pb.StatsResponse(
            artifacts=s.artifacts,
            pages=s.pages,
            page_bytes=s.page_bytes,
            staged_pages=s.staged_pages,
            map_size_bytes=s.map_size_bytes,
            map_used_bytes=s.map_used_bytes,
            segment_disk_bytes=s.segment_disk_bytes,
            disk_free_bytes=s.disk_free_bytes,
            last_sequence=s.last_sequence,
            tiers=[self._lmdb_tier(s)],
        )

    # ------------------------------------------------------------------
    def put_artifact(
        self, messages: Iterable[bytes], connection: str = ""
    ) -> pb.PutArtifactResponse:
        """PutArtifact from its raw PutArtifactRequest messages, sent from `connection` (the
        peer's host: what its uploads may stage is bounded; see put_parts)."""
        return self.put_parts(map(wire.decode_put, messages), connection=connection)

    def put_parts(
        self,
        parts: Iterable[wire.PutPart],
        origin: str = "upload",
        source: str = "",
        connection: str = "",
    ) -> pb.PutArtifactResponse:
        """Receive pages then a manifest; commit them together. The artifact is trusted
        if it carries a valid signature by a trusted key, else stored untrusted (`origin`
        says how it arrived).

        Verified pages of a stream that is cut (the iterator raises something
        other than a kvgraft error) or ends without a manifest are staged so a
        retry need not resend them, within the bounds of staged pages
        (kvgraftd.store.upload_limits); so are those of a manifest that does not
        hash to the sender's expected_artifact_id (altered on the way: DATA_LOSS).
        """
        with PageIntake(self._store, self._uploads, connection) as intake:
            try:
                # Taken off the connection while the previous message is hashed and
                # stored; what was taken survives a cut call (kvgraftd.store.read_ahead).
                with closing(read_ahead(parts, READ_AHEAD_MESSAGES)) as received:
                    manifest, last = intake.receive(received)
            except KvgraftError:
                raise
            except Exception:
                intake.keep()  # the caller is gone: a refusal to keep them has no one to tell
                raise
            if manifest is None:
                refused = intake.keep()
                kept = "the pages sent are kept for a retry"
                if refused:
                    kept = f"the pages sent were not kept: {refused}"
                raise InvalidArgument(
                    f"PutArtifact ended without a manifest; no artifact was stored ({kept}); "
                    "send the manifest as the last message"
                )
            expected_id = last.expected_artifact_id
            if expected_id and artifact_id(manifest) != expected_id:
                intake.keep()  # the pages were verified; only the manifest is in doubt
                raise DataLoss(
                    f"the manifest arrived altered: it hashes to {artifact_id(manifest)[:16]}, "
                    f"not to the expected {expected_id[:16]}; no artifact was stored: resend it"
                )
            intake.check_against(manifest)
            if last.relayed_from and not source:
                # A client relaying a replication names its source: information for the
                # origin only (no trust, and no say in which deletes apply: replicated_from).
                origin = f"replicated from {last.relayed_from} via a client"
            provenance = self.trust.received(artifact_id(manifest), last.signatures, origin)
            if source:  # a pull or a follower: a delete from there will apply to it
                provenance.replicated_from.append(source)
            result = self._store.commit_artifact(manifest, intake.records, provenance)
            intake.committed(manifest)
        return pb.PutArtifactResponse(
            artifact_id=result.artifact_id,
            already_present=result.already_present,
            pages_written=result.pages_written,
            bytes_written=result.bytes_written,
        )

    def get_artifact(self, request: pb.GetArtifactRequest) -> Iterator[bytes]:
        """The manifest, then the requested pages, framed as GetArtifactResponse bytes."""
        record = self._store.get_record(request.artifact_id)
        manifest = record.manifest()
        sizes = page_sizes(manifest)
        wanted = list(sizes)  # distinct pages in manifest order
        if request.only_pages:
            unknown = [d for d in request.only_pages if d not in sizes]
            if unknown:
                raise InvalidArgument(
                    f"page {bytes(unknown[0]).hex()[:16]} is not part of artifact "
                    f"{request.artifact_id}"
                )
            asked = set(request.only_pages)
            wanted = [d for d in wanted if d in asked]
        full_id = artifact_id(manifest)
        signatures = self._store.provenance(full_id).signatures
        first = wire.encode_submessage(wire.GET_MANIFEST, record.canonical)
        first += wire.encode_signatures(wire.GET_SIGNATURES, signatures)
        if request.manifest_only:  # the manifest of a quarantined artifact is intact
            yield first
            return
        self._store.check_servable(full_id)
        with self._store.reading(full_id):  # an export is a use; never evicted while read
            yield first
            yield from self._page_messages(wanted, sizes)

    def _page_messages(self, digests: list[bytes], sizes: dict[bytes, int]) -> Iterator[bytes]:
        budget = self._limits.block_payload_bytes
        batch: list[bytes] = []
        used = 0
        for digest in digests:
            size = sizes[digest]
            cost = wire.chunk_overhead_bytes(size) + size
            if batch and used + cost > budget:
                yield self._framed(batch, sizes)
                batch, used = [], 0
            if cost > budget:  # a page larger than one message travels in pieces
                data, checksum = self._store.read_page(digest)
                for chunks in wire.split_pages([(digest, data)], budget, {digest: checksum}):
                    yield wire.encode_page_block(wire.GET_PAGES, chunks)
                continue
            batch.append(digest)
            used += cost
        if batch:
            yield self._framed(batch, sizes)

    def _framed(self, digests: list[bytes], sizes: dict[bytes, int]) -> bytes:
        """One GetArtifactResponse holding whole pages, framed as they are read."""
        placeholder = b"\0" * 16  # xxh3 is read with the page; its length is fixed
        prefixes = [wire.chunk_prefix(d, 0, sizes[d], sizes[d], placeholder) for d in digests]
        block_bytes = sum(map(len, prefixes)) + sum(sizes[d] for d in digests)
        head = wire.envelope_prefix(wire.GET_PAGES, block_bytes)

        def frame(index: int, digest: bytes, checksum: bytes, size: int) -> bytes:
            prefix = wire.chunk_prefix(digest, 0, size, size, checksum)
            return head + prefix if index == 0 else prefix

        return self._store.read_pages_framed(digests, frame)

    def missing_pages(self, request: pb.MissingPagesRequest) -> pb.MissingPagesResponse:
        if len(request.sha256) > MAX_MISSING_QUERY:
            raise InvalidArgument(
                f"MissingPages takes at most {MAX_MISSING_QUERY} hashes per call; split the query"
            )
        if any(len(d) != DIGEST_BYTES for d in request.sha256):
            raise InvalidArgument("MissingPages hashes must be 32-byte SHA-256 digests")
        return pb.MissingPagesResponse(missing=self._store.missing_pages(list(request.sha256)))

    # ------------------------------------------------------------------
    def list(self, request: pb.ListRequest) -> pb.ListResponse:
        size = request.page_size or DEFAULT_LIST_PAGE
        if size > MAX_LIST_PAGE:
            raise InvalidArgument(f"List page_size is at most {MAX_LIST_PAGE}")
        after = _decode_page_token(request.page_token)
        selector = dict(request.label_selector)
        response = pb.ListResponse()
        while len(response.artifacts) < size:
            batch = self._store.list_records(after, size)
            if not batch:
                after = b""
                break
            for aid, record in batch:
                after = bytes.fromhex(aid)
                manifest = record.manifest()
                if all(manifest.labels.get(k) == v for k, v in selector.items()):
                    response.artifacts.append(self._info(aid, record, manifest))
                    if len(response.artifacts) == size:
                        break
        response.next_page_token = after.hex() if len(response.artifacts) == size else ""
        return response

    def stat(self, request: pb.StatRequest) -> pb.StatResponse:
        aid = self._store.resolve(request.artifact_id)
        record = self._store.get_record(aid)
        manifest = record.manifest()
        response = pb.StatResponse(info=self._info(aid, record, manifest))
        if request.include_manifest:
            response.manifest.CopyFrom(manifest)
        return response

    def delete(self, request: pb.DeleteRequest) -> pb.DeleteResponse:
        freed, freed_bytes = self._store.delete_artifact(request.artifact_id)
        return pb.DeleteResponse(pages_freed=freed, bytes_freed=freed_bytes)

    def pin(self, request: pb.PinRequest) -> pb.PinResponse:
        if request.ttl_s > MAX_PIN_TTL_S:
            raise InvalidArgument(f"Pin ttl_s is at most {MAX_PIN_TTL_S} (ten years)")
        if request.ttl_s and not request.pinned:
            raise InvalidArgument("a TTL goes with a pin: set pinned, or leave ttl_s at 0")
        aid = self._store.resolve(request.artifact_id)
        record = self._store.set_pinned(aid, request.pinned, request.ttl_s)
        return pb.PinResponse(info=self._info(aid, record, record.manifest()))

    def _info(self, aid: str, record, manifest: pb.Manifest) -> pb.ArtifactInfo:
        info = artifact_info(aid, record, manifest)
        if self.tenant:  # the store-wide change feed's number would count others' changes
            info.sequence = 0
        info.provenance.CopyFrom(self._store.provenance(aid))
        info.pin_expires_unix_ms = self._store.pin_expiry(aid)
        usage = self._store.usage(aid)
        # a published artifact's uses are every tenant's: its owner's to see, no one else's
        if usage is not None and writable_by(self.tenant, manifest.labels):
            info.last_used_unix_ms, info.reused_tokens = usage.last_used_ms, usage.reused_tokens
        info.quarantined = self._store.is_quarantined(aid)
        return info

    def watch(
        self, request: pb.WatchRequest, is_active: Callable[[], bool]
    ) -> Iterator[pb.ChangeRecord]:
        """Change records from `from_sequence` on; with `follow`, wait for new ones."""
        sequence = max(request.from_sequence, 1)
        while is_active():
            records = self._store.changes_since(sequence)
            yield from records
            if records:
                sequence = records[-1].sequence + 1
                continue
            if not request.follow:
                return
            if self._stopping.is_set():
                raise Unavailable(
                    f"kvgraftd is shutting down; watch again from sequence {sequence} "
                    "once it is back"
                )
            self._store.wait_for_change(WATCH_POLL_S)


def _decode_page_token(token: str) -> bytes:
    if not token:
        return b""
    try:
        after = bytes.fromhex(token)
    except ValueError:
        after = b""
    if len(after) != DIGEST_BYTES:
        raise InvalidArgument("List page_token is not one this daemon returned; start from ''")
    return after
