"""`kvgraft.Client`: typed calls to a kvgraftd daemon.

Every call carries a deadline (`timeout_s` for small calls, `transfer_timeout_s`
for whole transfers). gRPC errors are mapped to the kvgraft.errors taxonomy
in one place (`_mapped`), so callers catch `kvgraft.errors.NotFound` and
friends, never grpc.RpcError. The bulk RPCs use the hand encoding of
kvgraft.wire. Use it as a context manager to close the channel.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import grpc

from kvgraft import wire
from kvgraft.artifact import Artifact, page_sizes, parse_manifest
from kvgraft.bundle import read_bundle, write_bundle
from kvgraft.errors import ERRORS_BY_CODE, DataLoss, KvgraftError, Unavailable
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraft.v1 import kvgraft_pb2_grpc as pb_grpc

DEFAULT_SERVER = "127.0.0.1:50551"
MISSING_QUERY_BATCH = 100_000
T = TypeVar("T")


def default_server() -> str:
    return os.environ.get("KVGRAFT_SERVER") or DEFAULT_SERVER


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
        missing = self.missing_pages(page_sizes(manifest))
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
        """Fetch an artifact; every page's SHA-256 is checked on arrival."""
        request = pb.GetArtifactRequest(artifact_id=artifact_id, only_pages=list(only_pages))
        responses = self._stream(self._get(request, timeout=self.transfer_timeout_s))
        first = next(responses, None)
        if first is None:
            raise DataLoss(f"GetArtifact {artifact_id} returned no manifest")
        _, manifest_bytes = wire.decode_envelope(first, wire.GET_PAGES, wire.GET_MANIFEST)
        if manifest_bytes is None:
            raise DataLoss(f"GetArtifact {artifact_id} did not start with the manifest")
        artifact = Artifact(parse_manifest(manifest_bytes))
        partial: dict[bytes, list[bytes | memoryview]] = {}
        for raw in responses:
            chunks, _ = wire.decode_envelope(raw, wire.GET_PAGES, wire.GET_MANIFEST)
            for chunk in chunks:
                if chunk.offset == 0 and len(chunk.data) == chunk.page_bytes:
                    artifact.pages[chunk.sha256] = chunk.data
                else:
                    partial.setdefault(chunk.sha256, []).append(chunk.data)
                    if sum(len(p) for p in partial[chunk.sha256]) == chunk.page_bytes:
                        artifact.pages[chunk.sha256] = b"".join(partial.pop(chunk.sha256))
            if progress:
                progress(sum(len(c.data) for c in chunks))
        artifact.check_page_sizes()
        if not only_pages:
            artifact.verify()
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
