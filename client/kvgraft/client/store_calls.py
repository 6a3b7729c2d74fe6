"""The store calls of kvgraft.Client: artifacts put, fetched, listed, pinned and deleted,
bundles, and the remote tier behind the store.

`put_artifact` sends only the pages the daemon lacks (kvgraft.wire's hand
encoding); `get_artifact` checks every page as it arrives (kvgraft.chunks).
Small calls take the store's deadline (`timeout_s`); transfers, scrub and remote_sync
the transfer one (`transfer_timeout_s`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

from kvgraft import wire
from kvgraft.artifact import Artifact, page_sizes, parse_manifest
from kvgraft.bundle import read_bundle, write_bundle
from kvgraft.chunks import PageChunks
from kvgraft.client.connection import TRANSFER, Connected
from kvgraft.errors import DataLoss, InvalidArgument
from kvgraft.page_buffers import page_slots
from kvgraft.v1 import kvgraft_pb2 as pb

MISSING_QUERY_BATCH = 100_000
PUT_ATTEMPTS = 3  # a put whose held pages a concurrent Delete freed is sent again


class StoreCalls(Connected):
    def info(self) -> pb.InfoResponse:
        return self._unary(self._stub.Info, pb.InfoRequest())

    def stats(self) -> pb.StatsResponse:
        return self._unary(self._stub.Stats, pb.StatsRequest())

    def missing_pages(self, digests: Iterable[bytes]) -> list[bytes]:
        digests = list(digests)
        missing: list[bytes] = []
        for start in range(0, len(digests), MISSING_QUERY_BATCH):
            request = pb.MissingPagesRequest(sha256=digests[start : start + MISSING_QUERY_BATCH])
            missing += self._unary(self._stub.MissingPages, request).missing
        return missing

    def put_artifact(
        self, artifact: Artifact, progress: Callable[[int], None] | None = None
    ) -> pb.PutArtifactResponse:
        """Store `artifact`, sending only the pages the daemon lacks.

        `progress(n)` is called with the byte count of each message sent.
        """
        manifest = artifact.manifest
        for attempt in range(1, PUT_ATTEMPTS + 1):
            missing = self.missing_pages(page_sizes(manifest))
            try:
                return self._put_once(artifact, missing, progress)
            except InvalidArgument:
                # Pages the daemon held when asked may have been freed since by a
                # Delete of the last artifact naming them: then ask again, resend.
                vanished = set(self.missing_pages(page_sizes(manifest))) - set(missing)
                if not vanished or attempt == PUT_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    def _put_once(
        self,
        artifact: Artifact,
        missing: list[bytes],
        progress: Callable[[int], None] | None,
    ) -> pb.PutArtifactResponse:
        manifest = artifact.manifest
        pages = [(digest, artifact.pages[digest]) for digest in missing]

        def requests() -> Iterator[bytes]:
            for chunks in wire.split_pages(pages):
                message = wire.encode_page_block(wire.PUT_PAGES, chunks)
                yield message
                if progress:
                    progress(sum(len(c.data) for c in chunks))
            canonical = manifest.SerializeToString(deterministic=True)
            # The expected id: the daemon refuses a manifest altered on the way.
            yield wire.encode_put_manifest(
                canonical, hashlib.sha256(canonical).hexdigest(), artifact.signatures
            )

        with self._mapped(TRANSFER):
            return self._put(requests(), timeout=self.transfer_timeout_s)

    def get_artifact(
        self,
        artifact_id: str,
        *,
        only_pages: Iterable[bytes] = (),
        check_sha256: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> Artifact:
        """Fetch an artifact (or `only_pages` of it), every page checked on arrival.

        The daemon sends each page's stored xxh3-128, so the bytes are checked
        for damage in transit at memory speed; the daemon itself checked them
        against the store. `check_sha256` also recomputes every page's SHA-256
        (its identity), as for bytes from an untrusted source; pages that come
        without an xxh3 (another server) always get it.
        """
        wanted = list(only_pages)
        request = pb.GetArtifactRequest(artifact_id=artifact_id, only_pages=wanted)
        responses = self._stream(self._open(self._get, request, TRANSFER), TRANSFER)
        first = next(responses, None)
        if first is None:
            raise DataLoss(f"GetArtifact {artifact_id} returned no manifest")
        _, manifest_bytes = wire.decode_envelope(first, wire.GET_PAGES, wire.GET_MANIFEST)
        if manifest_bytes is None:
            raise DataLoss(f"GetArtifact {artifact_id} did not start with the manifest")
        artifact = Artifact(parse_manifest(manifest_bytes))
        artifact.signatures = wire.decode_signatures(first, wire.GET_SIGNATURES)
        sizes = page_sizes(artifact.manifest)
        slots = page_slots({d: sizes[d] for d in wanted if d in sizes} if wanted else sizes)
        arriving = PageChunks(
            {d: len(slot) for d, slot in slots.items()},
            also_sha256=check_sha256,
            hint=f" (artifact {artifact_id[:16]}); nothing was returned: fetch it again",
        )
        for raw in responses:
            chunks, _ = wire.decode_envelope(raw, wire.GET_PAGES, wire.GET_MANIFEST)
            for chunk in chunks:
                complete = arriving.add(chunk)  # checked before its bytes are placed
                slot = slots[chunk.sha256]
                slot[chunk.offset : chunk.offset + len(chunk.data)] = np.frombuffer(
                    chunk.data, np.uint8
                )
                if complete:
                    artifact.pages[chunk.sha256] = memoryview(slot)
            if progress:
                progress(sum(len(c.data) for c in chunks))
        artifact.check_page_sizes()
        absent = [d for d in (wanted or page_sizes(artifact.manifest)) if d not in artifact.pages]
        if absent:
            raise DataLoss(
                f"page {absent[0].hex()[:16]} of artifact {artifact_id[:16]} is missing from the "
                "GetArtifact stream; fetch it again"
            )
        return artifact

    def list_artifacts(
        self, label_selector: Mapping[str, str] | None = None
    ) -> Iterator[pb.ArtifactInfo]:
        """The daemon's artifacts in id order, page by page. A listing that does not
        advance (an id not above the one before: a page sent again, a page token that
        loops) is DataLoss, so a faulty or hostile daemon cannot keep a reader listing
        for ever."""
        token, last = "", ""
        while True:
            request = pb.ListRequest(
                page_size=1000, page_token=token, label_selector=label_selector
            )
            response = self._unary(self._stub.List, request)
            for info in response.artifacts:
                if info.artifact_id <= last:
                    raise DataLoss(
                        f"the listing of {self.address} does not advance (artifact "
                        f"{info.artifact_id[:16]} after {last[:16]}): it is not in id order"
                    )
                last = info.artifact_id
                yield info
            token = response.next_page_token
            if not token:
                return
            if not response.artifacts:
                raise DataLoss(f"the listing of {self.address} sent an empty page before its end")

    def stat(self, artifact_id: str, *, include_manifest: bool = False) -> pb.StatResponse:
        request = pb.StatRequest(artifact_id=artifact_id, include_manifest=include_manifest)
        return self._unary(self._stub.Stat, request)

    def delete(self, artifact_id: str) -> pb.DeleteResponse:
        return self._unary(self._stub.Delete, pb.DeleteRequest(artifact_id=artifact_id))

    def pin(self, artifact_id: str, pinned: bool = True, ttl_s: float = 0) -> pb.ArtifactInfo:
        """Pin (never deleted nor evicted) or unpin; with `ttl_s` the pin expires that many
        seconds from now and the artifact is then deleted."""
        request = pb.PinRequest(artifact_id=artifact_id, pinned=pinned, ttl_s=math.ceil(ttl_s))
        return self._unary(self._stub.Pin, request).info

    def publish(self, artifact_id: str, *, withdraw: bool = False) -> pb.ArtifactInfo:
        """Publish one of the caller's artifacts to the shared namespace (every tenant may
        graft it and reuse its pages; only its owner may delete it): the published
        artifact. With `withdraw`, delete the published one: what it was."""
        request = pb.PublishRequest(artifact_id=artifact_id, withdraw=withdraw)
        return self._unary(self._stub.Publish, request).info

    def scrub(self, bytes_per_s: int = 0, progress=None) -> pb.ScrubProgress:
        """Recompute the SHA-256 of every stored page (at most `bytes_per_s`; 0: the
        daemon's scrub_bytes_per_s); corrupt pages' artifacts are quarantined. `progress`
        has tqdm's `total` and `update(n)`. Returns the findings."""
        request = pb.ScrubRequest(bytes_per_s=bytes_per_s)
        return self._progress_stream(
            self._stub.Scrub, request, progress, lambda last: last.bytes_total
        )

    def export_bundle(self, artifact_id: str, path: Path, progress=None) -> str:
        """Write an artifact to a safetensors bundle; returns the full id."""
        artifact = self.get_artifact(artifact_id, progress=progress)
        write_bundle(artifact, Path(path))
        return artifact.id

    def import_bundle(self, path: Path, progress=None) -> pb.PutArtifactResponse:
        """Store the artifact of a safetensors bundle (its hashes are checked first)."""
        return self.put_artifact(read_bundle(Path(path)), progress=progress)

    def remote_status(self) -> pb.RemoteStatusResponse:
        """The daemon's remote tier: configuration, reachability, backlog, counters."""
        return self._unary(self._stub.RemoteStatus, pb.RemoteStatusRequest())

    def remote_sync(self, *, push: bool = True, pull: bool = True) -> pb.RemoteSyncResponse:
        """Push local artifacts the bucket lacks and/or pull the bucket's missing ones."""
        request = pb.RemoteSyncRequest(push=push, pull=pull)
        return self._unary(self._stub.RemoteSync, request, TRANSFER)
