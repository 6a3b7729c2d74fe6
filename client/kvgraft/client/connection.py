"""The connection under every call of kvgraft.Client: channel, deadlines, and errors mapped.

`Connection` holds one gRPC channel to a daemon (TLS, mutual TLS and the
bearer token are kvgraft.client.channel's: arguments or KVGRAFT_* variables)
and the deadline every call carries, by kind of call: `timeout_s` for the store's
small calls (30 s), `compute_timeout_s` for calls that compute (deposit, generate,
graft, verify, lookup, ask, library_add: 1 h, the daemon's own `max_call_s`) and
`transfer_timeout_s` for whole transfers and long-running streams (1 h); only a
following `watch` has none, as it is meant to run until cancelled. A
connection gone silent under an open call is dropped after an unanswered
keepalive ping, and one whose HTTP/2 state broke is replaced, so the next call
reconnects. gRPC errors become the kvgraft.errors taxonomy in one place
(`_mapped`, used by `_unary`, `_open` and `_stream`), so callers catch
`kvgraft.errors.NotFound` and friends, never grpc.RpcError; kvgraft.client.failures
words the failures of the connection itself (unreachable, TLS, a deadline).

An address without a port gets the daemon's port, 50551 (`with_default_port`).

The calls themselves are classes, one per group of RPCs
(kvgraft.client.store_calls, engine_calls, library_calls, replication_calls),
each written against `Connected`, the Protocol that declares what a group needs
of the connection it runs on (the channel's calls, the deadlines, the error
mapping), never against `Connection` itself. `Connection` implements `Connected`;
kvgraft.client.client.Client joins the groups with a `Connection`.
"""

from __future__ import annotations

import ipaddress
import os
import threading
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol, Self, TypeVar

import grpc

from kvgraft import wire
from kvgraft.client.channel import Security
from kvgraft.client.failures import explain
from kvgraft.errors import ERRORS_BY_CODE, Cancelled, KvgraftError, Unavailable
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraft.v1 import kvgraft_pb2_grpc as pb_grpc

DEFAULT_PORT = 50551
DEFAULT_SERVER = f"127.0.0.1:{DEFAULT_PORT}"
DEFAULT_TIMEOUT_S = 30.0  # the store's small calls: info, ls, stat, pin, ...
# Calls that compute wait as long as the daemon lets a call run (its max_call_s):
# a long deposit on a CPU takes minutes, and a request may queue behind others.
DEFAULT_COMPUTE_TIMEOUT_S = 3600.0
DEFAULT_TRANSFER_TIMEOUT_S = 3600.0
# The kinds of call, named by the Client argument that sets their deadline.
STORE, COMPUTE, TRANSFER = "timeout_s", "compute_timeout_s", "transfer_timeout_s"
# What gRPC says when a keepalive ping went unanswered: the connection went silent.
_SILENT = ("ping timeout", "keepalive watchdog timeout")
# What gRPC says when a deadline passed on this side (the daemon's own DEADLINE_EXCEEDED,
# past its max_call_s or put_idle_s, says why in its words: its connection answers).
_RAN_OUT = "Deadline Exceeded"
# gRPC target schemes, which name their own port (or none: unix sockets).
_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")
T = TypeVar("T")


def default_server() -> str:
    return with_default_port(os.environ.get("KVGRAFT_SERVER") or DEFAULT_SERVER)


def with_default_port(address: str) -> str:
    """`address` with the daemon's port when it names none: "host" and "[::1]" (or a
    bare IPv6 literal, "::1") get :50551; "host:port" and gRPC targets ("unix:PATH",
    "dns:///host:port") stay as they are."""
    address = address.strip()
    if address.startswith(_SCHEMES):
        return address
    if address.startswith("["):  # [v6] or [v6]:port
        return address if "]:" in address else f"{address}:{DEFAULT_PORT}"
    if address.count(":") > 1:  # more than one colon: a bare IPv6 literal, or nothing known
        try:
            return f"[{ipaddress.IPv6Address(address)}]:{DEFAULT_PORT}"
        except ValueError:
            return address
    return address if ":" in address else f"{address}:{DEFAULT_PORT}"


def _deadline(value: float | None, default: float, name: str) -> float:
    if value is None:
        return default
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name} must be a number of seconds above 0, not {value!r}")
    return float(value)


class Connected(Protocol):
    """What a group of calls needs of the connection it runs on. A group subclasses it
    (its methods are abstract there: a class that joins groups without a Connection
    cannot be made); `Connection` implements it."""

    address: str  # "host:port", as the calls' errors name it
    timeout_s: float  # the deadline of each kind of call (STORE, COMPUTE, TRANSFER)
    compute_timeout_s: float
    transfer_timeout_s: float

    @property
    @abstractmethod
    def _stub(self) -> pb_grpc.KvgraftStub:
        """The calls of the current connection (the generated stub)."""

    @property
    @abstractmethod
    def _put(self) -> grpc.StreamUnaryMultiCallable:
        """PutArtifact taking requests that are wire bytes already (kvgraft.wire)."""

    @property
    @abstractmethod
    def _get(self) -> grpc.UnaryStreamMultiCallable:
        """GetArtifact giving responses as bytes, for kvgraft.wire to parse."""

    @abstractmethod
    def _mapped(self, kind: str | None = None) -> AbstractContextManager[None]:
        """Inside: grpc.RpcError becomes the kvgraft.errors class of its status code."""

    @abstractmethod
    def _unary(self, call: Callable[..., T], request, kind: str = STORE) -> T:
        """call(request) under the deadline of its kind of call."""

    @abstractmethod
    def _open(self, call: Callable[..., T], request, kind: str | None) -> T:
        """Start a server-streaming call under the deadline of its kind."""

    @abstractmethod
    def _stream(self, responses: Iterable[T], kind: str | None) -> Iterator[T]:
        """The messages of a call opened with `_open`, its errors mapped."""

    @abstractmethod
    def _progress_stream(self, call: Callable[..., Iterable[T]], request, progress, total) -> T:
        """The last message of a server-streamed progress, which must be `done`."""


class Connection(Connected):
    """One daemon's channel, its deadlines, and the error mapping of every call (the
    arguments are documented on kvgraft.Client)."""

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        compute_timeout_s: float | None = DEFAULT_COMPUTE_TIMEOUT_S,
        transfer_timeout_s: float | None = DEFAULT_TRANSFER_TIMEOUT_S,
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
        self.address = with_default_port(address) if address else default_server()
        # None: the default (the command line passes None when --timeout is not given)
        self.timeout_s = _deadline(timeout_s, DEFAULT_TIMEOUT_S, STORE)
        self.compute_timeout_s = _deadline(compute_timeout_s, DEFAULT_COMPUTE_TIMEOUT_S, COMPUTE)
        self.transfer_timeout_s = _deadline(
            transfer_timeout_s, DEFAULT_TRANSFER_TIMEOUT_S, TRANSFER
        )
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
        self._connect = lambda: _Channel(security, self.address, options)
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

    def _replace_connection(self, broken: _Channel, close: bool = True) -> None:
        """A new connection for the calls that follow; the broken one is closed (`close`),
        else left to the calls still open on it, to end as they would."""
        with self._connection_lock:
            if self._connection is not broken:
                return  # another call replaced it already
            self._connection = self._connect()
        if close:
            broken.channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------
    @contextmanager
    def _mapped(self, kind: str | None = None) -> Iterator[None]:
        """Turn grpc.RpcError into the kvgraft.errors class of its status code, with
        kvgraft.client.failures' words (`kind`: the call's kind, to name its deadline).

        INTERNAL is what gRPC reports when the HTTP/2 or HPACK state of the
        connection is broken (a header damaged on the way is remembered in
        the connection's header table, so every later call on it fails too);
        a ping timeout, when it went silent. Either way the connection is
        replaced, and the next call opens a new one (gRPC itself may take
        its time to give up on the old one). So it is after a transfer whose
        deadline passed on this side: a connection gone half-open (no ping
        sent yet, or its answer not yet overdue) would otherwise hold every
        retry until its deadline too, and a transfer's deadline is long (puts
        are idempotent: a retry on the new connection sends what is still
        missing). A connection replaced as broken is closed, and the calls still
        open on it end (CANCELLED); one replaced after a deadline is left to them
        (it may be healthy and slow: another worker's transfer, a follow stream).
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
            ran_out = code == grpc.StatusCode.DEADLINE_EXCEEDED and details == _RAN_OUT
            if code == grpc.StatusCode.INTERNAL or any(sign in details for sign in _SILENT):
                self._replace_connection(connection)
                details += "; the next call opens a new connection"
            deadline = (kind, getattr(self, kind)) if kind else None
            details = explain(
                code.name, details, address=self.address, tls=self._tls, deadline=deadline
            )
            if ran_out and kind == TRANSFER:  # the advice stays: give it longer
                self._replace_connection(connection, close=False)
            raise cls(details) from None

    def _unary(self, call: Callable[..., T], request, kind: str = STORE) -> T:
        """call(request) under the deadline of its kind of call (STORE, COMPUTE, TRANSFER)."""
        with self._mapped(kind):
            return call(request, timeout=getattr(self, kind))

    def _open(self, call: Callable[..., T], request, kind: str | None) -> T:
        """Start a server-streaming call under the deadline of its kind (None: no deadline,
        for a watch that follows until cancelled); an error at once is mapped too."""
        with self._mapped(kind):
            return call(request, timeout=getattr(self, kind) if kind else None)

    def _stream(self, responses: Iterable[T], kind: str | None) -> Iterator[T]:
        """The messages of a call opened with `_open(..., kind)`, its errors mapped."""
        with self._mapped(kind):
            yield from responses

    def _progress_stream(self, call: Callable[..., Iterable[T]], request, progress, total) -> T:
        """Follow a server-streamed progress (messages with `bytes_done` and `done`) to its
        last message, which must be `done`; `progress` (tqdm's `total` and `update(n)`, or
        None) follows `total(message)` and `bytes_done`. It runs under the transfer
        deadline."""
        last, done = None, 0
        for last in self._stream(self._open(call, request, TRANSFER), TRANSFER):
            if progress is not None:
                progress.total = total(last)
                progress.update(last.bytes_done - done)
            done = last.bytes_done
        if last is None or not last.done:
            name = type(request).__name__.removesuffix("Request")
            raise Unavailable(f"the {name} stream of {self.address} ended before its results")
        return last


class _Channel:
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
