"""The HTTP listener of the OpenAI-compatible API: uvicorn on a thread of its own.

`HttpServer.start(config, app)` binds `http_listen` itself (so a port in use is an
OSError saying why, in the main thread, before the daemon reports ready, and port 0
picks one), then runs uvicorn's server (h11, asyncio) on a thread with TLS from the
daemon's certificate when it has one (mutual when tls_client_ca is set). `stop` asks
uvicorn to stop taking connections and waits up to drain_s for the requests in flight,
as the gRPC server drains. uvicorn installs no signal handler off the main thread: the
daemon's own stop signals (kvgraftd.main) stay in charge.

Slow clients (uvicorn has no read deadline; `GuardedH11Protocol`, its h11 protocol):
* a request's line and headers must all come within HEADER_DEADLINE_S, counted from the
  accept or, on a keep-alive connection, from the previous answer; else the connection is
  closed, however often bytes come. Only the headers: a body and an answer (an SSE stream)
  take as long as they take; an idle keep-alive connection is closed after KEEP_ALIVE_S.
* a client host has at most connections_per_host(config) connections open; one more is
  closed at once. Both are a client's own doing: a DEBUG line, not a warning.
With TLS, asyncio bounds the handshake (60 s, the whole of it) before either applies.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import time
from collections import Counter
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvgraftd.config import DaemonConfig
from kvgraftd.server.bind_errors import why_not_bound

log = logging.getLogger(__name__)
# uvicorn's own lines ("Started server process", ...) repeat what kvgraftd.main logs; its
# warnings (a malformed request) and errors stay.
logging.getLogger("uvicorn.error").setLevel(logging.WARNING)

START_TIMEOUT_S = 30.0
KEEP_ALIVE_S = 5
# Clients send a request's line and headers (a few hundred bytes) in one write: they come
# in one round trip. Twice the keep-alive time leaves a slow network seconds to spare,
# and a client that trickles them a byte at a time holds its connection no longer.
HEADER_DEADLINE_S = 10.0
# What a browser opens to one server (six), and then some: the least a host may have open.
MIN_CONNECTIONS_PER_HOST = 8


def connections_per_host(config: DaemonConfig) -> int:
    """Connections one client host may have open: one for each call it may have in flight
    (max_concurrent_rpcs: the daemon refuses more calls anyway) and as many idle in its
    keep-alive pool. A reverse proxy is one host: it can carry every call the daemon takes."""
    return max(MIN_CONNECTIONS_PER_HOST, 2 * config.max_concurrent_rpcs)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers and a cap on each
    client host's connections. `for_server` makes the class of one server: its count of
    connections by host is its own, kept on the event loop's thread alone (no lock)."""

    per_host: ClassVar[int] = 0
    header_deadline_s: ClassVar[float] = HEADER_DEADLINE_S
    hosts: ClassVar[Counter[str]] = Counter()

    @classmethod
    def for_server(cls, per_host: int, header_deadline_s: float) -> type[GuardedH11Protocol]:
        namespace = {"per_host": per_host, "header_deadline_s": header_deadline_s}
        return type(cls.__name__, (cls,), {**namespace, "hosts": Counter()})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._host: str | None = None  # counted in `hosts` while set
        self._headers_due: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        host = self.client[0] if self.client else ""  # "": a Unix socket's clients, one host
        if self.hosts[host] >= self.per_host:
            log.debug(
                "HTTP connection from %s closed: %d open from it already", host, self.per_host
            )
            transport.close()
            return
        self.hosts[host] += 1
        self._host = host
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._stop_watching()
        if self._host is not None:
            self.hosts[self._host] -= 1
            if not self.hosts[self._host]:
                del self.hosts[self._host]
            self._host = None

    def handle_events(self) -> None:
        super().handle_events()
        self._watch_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # a pipelined request's headers may be read here
        self._watch_headers()

    def _watch_headers(self) -> None:
        """A deadline while the connection waits for a request's headers (h11's client
        state IDLE: before its first request, and after each answer), none otherwise."""
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self._headers_due is None:
            self._headers_due = self.loop.call_later(self.header_deadline_s, self._headers_late)
        elif not waiting:
            self._stop_watching()

    def _stop_watching(self) -> None:
        if self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None

    def _headers_late(self) -> None:
        self._headers_due = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.debug(
                "HTTP connection from %s closed: its request line and headers took longer "
                "than %g s",
                self._host,
                self.header_deadline_s,
            )
            self.transport.close()


class HttpServer:
    def __init__(self, server: uvicorn.Server, sock: socket.socket, scheme: str) -> None:
        self._server = server
        self._socket = sock
        self.port = sock.getsockname()[1]
        self.scheme = scheme
        self._thread = threading.Thread(target=self._run, name="http", daemon=True)

    @classmethod
    def start(cls, config: DaemonConfig, app) -> HttpServer:
        """Bind http_listen and serve `app` (an ASGI application) on a thread."""
        sock = _bind(config.http_listen)
        tls = bool(config.tls_cert)
        settings = uvicorn.Config(
            app,
            http=GuardedH11Protocol.for_server(connections_per_host(config), HEADER_DEADLINE_S),
            ws="none",  # the API has no WebSocket route; an upgrade would leave the guard
            loop="asyncio",
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=config.drain_s,
            ssl_certfile=config.tls_cert or None,
            ssl_keyfile=config.tls_key or None,
            ssl_ca_certs=config.tls_client_ca or None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if config.tls_client_ca else ssl.CERT_NONE,
        )
        server = cls(uvicorn.Server(settings), sock, "https" if tls else "http")
        server._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server._server.started:
            if not server._thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the HTTP server on {config.http_listen} did not start; see the log")
            time.sleep(0.01)
        return server

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        except BaseException:  # logged here: the thread has no one else to tell
            log.exception("the HTTP server stopped on an error")

    def stop(self, drain_s: float) -> None:
        """Stop taking connections; wait up to drain_s for the requests in flight."""
        self._server.should_exit = True
        self._thread.join(drain_s + 5)
        self._socket.close()


def _bind(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, int(port)), family=family, backlog=1024)
    except (OSError, ValueError):
        raise OSError(why_not_bound(address, "--http-listen")) from None
    sock.set_inheritable(False)
    return sock
