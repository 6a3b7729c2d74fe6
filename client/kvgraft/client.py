"""`kvgraft.Client`: typed calls to a kvgraftd daemon.

Every call carries a deadline (`timeout_s` for small calls, `transfer_timeout_s`
for whole transfers). gRPC errors are mapped to the kvgraft.errors taxonomy
in one place (`_mapped`), so callers catch `kvgraft.errors.NotFound` and
friends, never grpc.RpcError. The bulk RPCs use the hand encoding of
kvgraft.wire. Use it as a context manager to close the channel.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import grpc

from kvgraft import wire
from kvgraft.artifact import Artifact, page_sizes, parse_manifest
from kvgraft.bundle import read_bundle, write_bundle
from kvgraft.errors import ERRORS_BY_CODE, DataLoss, InvalidArgument, KvgraftError, Unavailable
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraft.v1 import kvgraft_pb2_grpc as pb_grpc

DEFAULT_SERVER = "127.0.0.1:50551"
MISSING_QUERY_BATCH = 100_000
PUT_ATTEMPTS = 3  # a put whose held pages a concurrent Delete freed is sent again
T = TypeVar("T")


def default_server() -> str:
    return os.environ.get("KVGRAFT_SERVER") or DEFAULT_SERVER


class _PageVerifier:
    """SHA-256 of received pages on a helper thread, while the next messages arrive.

    hashlib releases the GIL on large buffers, so verification overlaps the
    transfer instead of following it. `finish` waits for every submitted page
    and raises DataLoss naming the first corrupt one.
    """

    def __init__(self, artifact_id: str) -> None:
        self._artifact_id = artifact_id
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # lists of (sha256, data); None ends
        self._corrupt: bytes | None = None
        self._error: BaseException | None = None
        self._abandoned = False
        self._thread = threading.Thread(target=self._run, name="kvgraft-verify", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (pages := self._queue.get()) is not None:
            if self._corrupt is not None or self._error is not None or self._abandoned:
                continue  # drain without hashing
            try:
                for digest, data in pages:
                    if hashlib.sha256(data).digest() != digest:
                        self._corrupt = digest
                        break
            except BaseException as exc:  # surfaced by finish()
                self._error = exc

    def submit(self, pages: list[tuple[bytes, bytes | memoryview]]) -> None:
        if self._corrupt is not None:  # stop the transfer early
            self.finish()
        if pages:
            self._queue.put(pages)

    def finish(self) -> None:
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._corrupt is not None:
            raise DataLoss(
                f"page {self._corrupt.hex()[:16]} of artifact {self._artifact_id[:16]} is "
                "corrupt (its bytes do not hash to its name); nothing was returned: fetch it again"
            )

    def abandon(self) -> None:
        self._abandoned = True
        self._queue.put(None)
        self._thread.join()


class Client:
    """A connection to one kvgraftd."""

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout_s: float = 30.0,
        transfer_timeout_s: float = 3600.0,
    ) -> None:
        self.address = address or default_server()
        self.timeout_s = timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self._channel = grpc.insecure_channel(self.address)
        self._stub = pb_grpc.KvgraftStub(self._channel)
        method = f"/{pb.DESCRIPTOR.services_by_name['Kvgraft'].full_name}/"
        self._put = self._channel.stream_unary(
            method + "PutArtifact",
            request_serializer=None,  # requests are wire bytes already
            response_deserializer=pb.PutArtifactResponse.FromString,
        )
        self._get = self._channel.unary_stream(
            method + "GetArtifact",
            request_serializer=pb.GetArtifactRequest.SerializeToString,
            response_deserializer=None,  # responses are parsed by kvgraft.wire
        )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------
    @contextmanager
    def _mapped(self) -> Iterator[None]:
        """Turn grpc.RpcError into the kvgraft.errors class of its status code."""
        try:
            yield
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            details = (exc.details() if hasattr(exc, "details") else "") or str(exc)
            cls = ERRORS_BY_CODE.get(code.name, KvgraftError)
            if cls is Unavailable:
                details = (
                    f"cannot reach kvgraftd at {self.address} ({details}); is it running? "
                    "Start it with `make serve` or `kvgraft serve`, or set --server/KVGRAFT_SERVER"
                )
            raise cls(details) from None

    def _unary(self, call: Callable[..., T], request) -> T:
        with self._mapped():
            return call(request, timeout=self.timeout_s)

    def _stream(self, responses: Iterable[T]) -> Iterator[T]:
        with self._mapped():
            yield from responses

    # ------------------------------------------------------------------
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
            yield wire.encode_submessage(
                wire.PUT_MANIFEST, manifest.SerializeToString(deterministic=True)
            )

        with self._mapped():
            return self._put(requests(), timeout=self.transfer_timeout_s)

    def get_artifact(
        self,
        artifact_id: str,
        *,
        only_pages: Iterable[bytes] = (),
        progress: Callable[[int], None] | None = None,
    ) -> Artifact:
        """Fetch an artifact; every page's SHA-256 is checked on arrival.

        That includes the pages of an `only_pages` fetch. The hashing runs on a
        helper thread while the next messages arrive (bench/store_bench.py).
        """
        wanted = list(only_pages)
        request = pb.GetArtifactRequest(artifact_id=artifact_id, only_pages=wanted)
        responses = self._stream(self._get(request, timeout=self.transfer_timeout_s))
        first = next(responses, None)
        if first is None:
            raise DataLoss(f"GetArtifact {artifact_id} returned no manifest")
        _, manifest_bytes = wire.decode_envelope(first, wire.GET_PAGES, wire.GET_MANIFEST)
        if manifest_bytes is None:
            raise DataLoss(f"GetArtifact {artifact_id} did not start with the manifest")
        artifact = Artifact(parse_manifest(manifest_bytes))
        partial: dict[bytes, list[bytes | memoryview]] = {}
        verifier = _PageVerifier(artifact_id)
        try:
            for raw in responses:
                chunks, _ = wire.decode_envelope(raw, wire.GET_PAGES, wire.GET_MANIFEST)
                whole: list[tuple[bytes, bytes | memoryview]] = []
                for chunk in chunks:
                    if chunk.offset == 0 and len(chunk.data) == chunk.page_bytes:
                        whole.append((chunk.sha256, chunk.data))
                    else:
                        partial.setdefault(chunk.sha256, []).append(chunk.data)
                        if sum(len(p) for p in partial[chunk.sha256]) == chunk.page_bytes:
                            whole.append((chunk.sha256, b"".join(partial.pop(chunk.sha256))))
                artifact.pages.update(whole)
                verifier.submit(whole)
                if progress:
                    progress(sum(len(c.data) for c in chunks))
        except BaseException:
            verifier.abandon()
            raise
        verifier.finish()  # raises DataLoss if a page is corrupt
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
        token = ""
        while True:
            request = pb.ListRequest(
                page_size=1000, page_token=token, label_selector=label_selector
            )
            response = self._unary(self._stub.List, request)
            yield from response.artifacts
            token = response.next_page_token
            if not token:
                return

    def stat(self, artifact_id: str, *, include_manifest: bool = False) -> pb.StatResponse:
        request = pb.StatRequest(artifact_id=artifact_id, include_manifest=include_manifest)
        return self._unary(self._stub.Stat, request)

    def delete(self, artifact_id: str) -> pb.DeleteResponse:
        return self._unary(self._stub.Delete, pb.DeleteRequest(artifact_id=artifact_id))

    def pin(self, artifact_id: str, pinned: bool = True) -> pb.ArtifactInfo:
        return self._unary(
            self._stub.Pin, pb.PinRequest(artifact_id=artifact_id, pinned=pinned)
        ).info

    def watch(self, from_sequence: int = 1, *, follow: bool = False) -> Iterator[pb.ChangeRecord]:
        request = pb.WatchRequest(from_sequence=from_sequence, follow=follow)
        timeout = None if follow else self.timeout_s
        return self._stream(self._stub.Watch(request, timeout=timeout))

    # ------------------------------------------------------------------
    def export_bundle(self, artifact_id: str, path: Path, progress=None) -> str:
        """Write an artifact to a safetensors bundle; returns the full id."""
        artifact = self.get_artifact(artifact_id, progress=progress)
        write_bundle(artifact, Path(path))
        return artifact.id

    def import_bundle(self, path: Path, progress=None) -> pb.PutArtifactResponse:
        """Store the artifact of a safetensors bundle (its hashes are checked first)."""
        return self.put_artifact(read_bundle(Path(path)), progress=progress)
