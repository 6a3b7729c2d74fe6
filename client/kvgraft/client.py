"""`kvgraft.Client`: typed calls to a kvgraftd daemon.

Every call carries a deadline (`timeout_s` for small calls, `transfer_timeout_s`
for whole transfers), and a connection gone silent under an open call is
dropped after an unanswered keepalive ping, so the next call reconnects. gRPC
errors are mapped to the kvgraft.errors taxonomy in one place (`_mapped`), so
callers catch `kvgraft.errors.NotFound` and friends, never grpc.RpcError. The
bulk RPCs use the hand encoding of kvgraft.wire. Use it as a context manager to
close the channel. TLS, mutual TLS and the bearer token are kvgraft.channel's
(arguments or KVGRAFT_* variables).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np
import xxhash

from kvgraft import wire
from kvgraft.artifact import Artifact, page_sizes, parse_manifest
from kvgraft.bundle import read_bundle, write_bundle
from kvgraft.channel import Security
from kvgraft.engine_calls import EngineCalls
from kvgraft.errors import (
    ERRORS_BY_CODE,
    Cancelled,
    DataLoss,
    InvalidArgument,
    KvgraftError,
    Unavailable,
)
from kvgraft.page_buffers import page_slots
from kvgraft.replication_calls import ReplicationCalls
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraft.v1 import kvgraft_pb2_grpc as pb_grpc

DEFAULT_SERVER = "127.0.0.1:50551"
MISSING_QUERY_BATCH = 100_000
# What gRPC says when no connection could be made (as opposed to a daemon that
# answered UNAVAILABLE itself, e.g. while its model loads or it shuts down) ...
_UNREACHABLE = ("failed to connect", "Connection refused", "DNS resolution failed", "unreachable")
# ... and when a connection closed under a call: a daemon that stopped, a network
# that cut, or (when it happens at once) a failed TLS handshake.
_CLOSED = ("Socket closed", "Ssl handshake failed")
_TLS_HINT = {
    True: "; over TLS the same happens when the handshake fails: check --tls-ca (the CA of "
    "the daemon's certificate) and, if it requires one, the client certificate "
    "(--tls-cert, --tls-key)",
    False: "; if the daemon serves TLS, give --tls-ca (KVGRAFT_TLS_CA)",
}
# ... and when a keepalive ping went unanswered: the connection went silent.
_SILENT = ("ping timeout", "keepalive watchdog timeout")
PUT_ATTEMPTS = 3  # a put whose held pages a concurrent Delete freed is sent again
T = TypeVar("T")


def default_server() -> str:
    return os.environ.get("KVGRAFT_SERVER") or DEFAULT_SERVER


class Client(EngineCalls, ReplicationCalls):
    """A connection to one kvgraftd (the engine's calls: kvgraft.engine_calls)."""

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout_s: float = 30.0,
        transfer_timeout_s: float = 3600.0,
        token: str | None = None,
        token_file: str | os.PathLike | None = None,
        tls: bool | None = None,
        tls_ca: str | os.PathLike | None = None,
        tls_cert: str | os.PathLike | None = None,
        tls_key: str | os.PathLike | None = None,
        tls_server_name: str | None = None,
        keepalive_s: float = 20.0,
        keepalive_timeout_s: float = 10.0,
    ) -> None:
        self.address = address or default_server()
        self.timeout_s = timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        security = Security.resolve(
            token=token,
            token_file=token_file,
            tls=tls,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls_server_name=tls_server_name,
        )
        self._tls = security.tls
        options = [
            *wire.CHANNEL_OPTIONS,
            *_keepalive(keepalive_s, keepalive_timeout_s),
            # gRPC shares connections between channels to one address by default:
            # a replacement channel would get the broken connection back.
            ("grpc.use_local_subchannel_pool", 1),
        ]
        self._connect = lambda: _Connection(security, self.address, options)
        self._connection = self._connect()
        self._connection_lock = threading.Lock()

    # The calls of the current connection (a broken one is replaced: _mapped).
    @property
    def _stub(self) -> pb_grpc.KvgraftStub:
        return self._connection.stub

    @property
    def _put(self) -> grpc.StreamUnaryMultiCallable:
        return self._connection.put

    @property
    def _get(self) -> grpc.UnaryStreamMultiCallable:
        return self._connection.get

    def close(self) -> None:
        self._connection.channel.close()

    def _replace_connection(self, broken: _Connection) -> None:
        """A new connection for the calls that follow; the broken one is closed."""
        with self._connection_lock:
            if self._connection is not broken:
                return  # another call replaced it already
            self._connection = self._connect()
        broken.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------
    @contextmanager
    def _mapped(self) -> Iterator[None]:
        """Turn grpc.RpcError into the kvgraft.errors class of its status code.

        INTERNAL is what gRPC reports when the HTTP/2 or HPACK state of the
        connection is broken (a header damaged on the way is remembered in
        the connection's header table, so every later call on it fails too);
        a ping timeout, when it went silent. Either way the connection is
        replaced, and the next call opens a new one (gRPC itself may take
        its time to give up on the old one).
        """
        connection = self._connection
        try:
            yield
        except ValueError as exc:
            text = str(exc).lower()  # "...on closed channel!", "...: Channel closed!"
            if "cannot invoke rpc" not in text or "closed" not in text:
                raise
            # close() from another thread (a pull whose caller left) under a call
            raise Cancelled(f"the connection to {self.address} was closed under the call") from None
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            details = (exc.details() if hasattr(exc, "details") else "") or str(exc)
            cls = ERRORS_BY_CODE.get(code.name, KvgraftError)
            if code == grpc.StatusCode.INTERNAL or any(sign in details for sign in _SILENT):
                self._replace_connection(connection)
                details += "; the next call opens a new connection"
            if cls is Unavailable and any(sign in details for sign in _UNREACHABLE):
                details = (
                    f"cannot reach kvgraftd at {self.address} ({details}); is it running? "
                    "Start it with `make serve` or `kvgraft serve`, or set --server/KVGRAFT_SERVER"
                    + _TLS_HINT[self._tls]
                )
            elif cls is Unavailable and any(sign in details for sign in _CLOSED):
                details = (
                    f"the connection to kvgraftd at {self.address} closed ({details}): the daemon "
                    "stopped or the network cut the call; retry. If it closes at once, "
                    + (
                        "the TLS handshake failed: check --tls-ca and the client certificate "
                        "(--tls-cert, --tls-key)"
                        if self._tls
                        else "the daemon may serve TLS: give --tls-ca (KVGRAFT_TLS_CA)"
                    )
                )
            raise cls(details) from None

    def _unary(self, call: Callable[..., T], request, timeout_s: float | None = None) -> T:
        """call(request) under the short deadline, or `timeout_s` (the transfer one)."""
        with self._mapped():
            return call(request, timeout=timeout_s or self.timeout_s)

    def _open(self, call: Callable[..., T], request, timeout_s: float | None) -> T:
        """Start a server-streaming call; an error at once is mapped like any other."""
        with self._mapped():
            return call(request, timeout=timeout_s)

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
            canonical = manifest.SerializeToString(deterministic=True)
            # The expected id: the daemon refuses a manifest altered on the way.
            yield wire.encode_put_manifest(
                canonical, hashlib.sha256(canonical).hexdigest(), artifact.signatures
            )

        with self._mapped():
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
        responses = self._stream(self._open(self._get, request, self.transfer_timeout_s))
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
        filled: dict[bytes, int] = {}  # bytes received of pages still arriving
        for raw in responses:
            chunks, _ = wire.decode_envelope(raw, wire.GET_PAGES, wire.GET_MANIFEST)
            for chunk in chunks:
                page = _place(slots, filled, chunk)
                if page is not None:
                    _check_page(artifact_id, chunk, page, check_sha256)
                    artifact.pages[chunk.sha256] = memoryview(page)
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

    def pin(self, artifact_id: str, pinned: bool = True) -> pb.ArtifactInfo:
        return self._unary(
            self._stub.Pin, pb.PinRequest(artifact_id=artifact_id, pinned=pinned)
        ).info

    # ------------------------------------------------------------------
    def export_bundle(self, artifact_id: str, path: Path, progress=None) -> str:
        """Write an artifact to a safetensors bundle; returns the full id."""
        artifact = self.get_artifact(artifact_id, progress=progress)
        write_bundle(artifact, Path(path))
        return artifact.id

    def import_bundle(self, path: Path, progress=None) -> pb.PutArtifactResponse:
        """Store the artifact of a safetensors bundle (its hashes are checked first)."""
        return self.put_artifact(read_bundle(Path(path)), progress=progress)


class _Connection:
    """One channel to the daemon, and the calls made on it."""

    def __init__(self, security: Security, address: str, options: list) -> None:
        self.channel = security.channel(address, options)
        self.stub = pb_grpc.KvgraftStub(self.channel)
        method = f"/{pb.DESCRIPTOR.services_by_name['Kvgraft'].full_name}/"
        self.put = self.channel.stream_unary(
            method + "PutArtifact",
            request_serializer=None,  # requests are wire bytes already
            response_deserializer=pb.PutArtifactResponse.FromString,
        )
        self.get = self.channel.unary_stream(
            method + "GetArtifact",
            request_serializer=pb.GetArtifactRequest.SerializeToString,
            response_deserializer=None,  # responses are parsed by kvgraft.wire
        )


def _keepalive(every_s: float, timeout_s: float) -> list[tuple[str, int]]:
    """Ping while calls are open, and drop a connection whose ping goes unanswered.

    A connection can go silent without closing (a peer gone, a bit flipped in an
    HTTP/2 frame's length so the reader waits for bytes that never come). Without
    pings every call on it waits for its deadline, and so does every retry,
    since gRPC keeps using the connection. kvgraftd accepts a ping every 10 s.
    """
    return [
        ("grpc.keepalive_time_ms", int(every_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
        # gRPC 1.85 waits for a ping's answer up to ping_timeout_ms: set both.
        ("grpc.http2.ping_timeout_ms", int(timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 0),
    ]


def _place(
    slots: dict[bytes, np.ndarray], filled: dict[bytes, int], chunk: wire.Chunk
) -> np.ndarray | None:
    """Copy a piece of a page into its slot; the page once its last byte has arrived."""
    slot = slots.get(chunk.sha256)
    if slot is None or chunk.page_bytes != len(slot):
        raise DataLoss(
            f"page {chunk.sha256.hex()[:16]} arrived but the artifact does not name it at "
            f"{chunk.page_bytes} bytes; fetch the artifact again"
        )
    at = filled.pop(chunk.sha256, 0)
    end = at + len(chunk.data)
    if chunk.offset != at or end > len(slot):
        raise DataLoss(f"page {chunk.sha256.hex()[:16]} arrived with chunks out of order")
    slot[at:end] = np.frombuffer(chunk.data, np.uint8)
    if end < len(slot):
        filled[chunk.sha256] = end
        return None
    return slot


def _check_page(artifact_id: str, chunk: wire.Chunk, data, check_sha256: bool) -> None:
    intact = xxhash.xxh3_128_digest(data) == chunk.xxh3 if chunk.xxh3 else True
    if intact and (check_sha256 or not chunk.xxh3):
        intact = hashlib.sha256(data).digest() == chunk.sha256
    if not intact:
        raise DataLoss(
            f"page {chunk.sha256.hex()[:16]} of artifact {artifact_id[:16]} arrived corrupt; "
            "nothing was returned: fetch it again"
        )
