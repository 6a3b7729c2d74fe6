"""The HTTP(S) endpoint that serves /metrics: connections bounded, idle ones closed, quiet.

Contract:
* At most METRICS_CONNECTIONS connections are served at once, each on a thread of its
  own, and at most METRICS_CONNECTIONS_PER_HOST of them from one client host; one more
  is closed at once. So slow clients of one host leave slots to the others' scrapes.
* A connection idle for METRICS_IDLE_S is closed, and so is one whose request line and
  headers (with TLS, its handshake too) have not all come METRICS_HEADER_DEADLINE_S after
  the accept, however often bytes come: a client that trickles a byte at a time would
  otherwise hold its slot for ever (the idle timeout is per read).
* With TLS, the handshake runs on the connection's thread, never on the thread that
  accepts connections: a client that connects and says nothing would otherwise hold up
  every scrape (Python's TLS sockets handshake in accept()).
* What a client does to its own connection (a timeout, a reset, a failed handshake, a
  request that does not parse) is no event of the daemon's: a DEBUG line, never a
  traceback on stderr (socketserver prints one per such connection by default).
* It holds no lock of the store: the collector it serves reads its figures.
"""

from __future__ import annotations

import io
import logging
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import make_wsgi_app
from prometheus_client.registry import CollectorRegistry

log = logging.getLogger(__name__)
T = TypeVar("T")

# A scraper needs one connection; each open one costs a thread.
METRICS_CONNECTIONS = 16
METRICS_IDLE_S = 10.0
# A quarter of the slots: a host with two scrapers and a curl has room, and slow clients
# must come from four hosts to hold every slot (each for at most the header deadline).
METRICS_CONNECTIONS_PER_HOST = 4
# Half of Prometheus's default scrape_timeout (10 s): a scraper sends its request (a few
# hundred bytes) at once, so it comes in one round trip (a TLS handshake in two more);
# a client that takes seconds to send it is no scraper.
METRICS_HEADER_DEADLINE_S = 5.0


class _HeaderDeadline:
    """A connection's reads under the idle timeout and, until its request's headers are
    in, under the deadline counted from its accept: each read waits at most what is left."""

    def __init__(self, connection: socket.socket, deadline_s: float, idle_s: float) -> None:
        self._connection = connection
        self._deadline_s = deadline_s
        self._idle_s = idle_s
        self._ends: float | None = time.monotonic() + deadline_s

    def call(self, operation: Callable[..., T], *args) -> T:
        """`operation(*args)` (a read, or the TLS handshake) within the time left."""
        if self._ends is None:
            return operation(*args)
        left_s = self._ends - time.monotonic()
        if left_s >= self._idle_s:
            self._connection.settimeout(self._idle_s)
            return operation(*args)
        if left_s > 0:
            self._connection.settimeout(left_s)  # an SSL socket's handshake: its whole time
            try:
                return operation(*args)
            except TimeoutError:
                pass
        raise TimeoutError(
            f"its request line and headers took longer than {self._deadline_s:g} s"
        ) from None

    def lift(self) -> None:
        """The headers are in: the body and the answer have the idle timeout alone."""
        self._ends = None
        self._connection.settimeout(self._idle_s)


class _DeadlineReader(io.RawIOBase):
    """The connection's bytes, each read under its _HeaderDeadline (the handler's rfile)."""

    def __init__(self, connection: socket.socket, deadline: _HeaderDeadline) -> None:
        self._connection = connection
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        return self._deadline.call(self._connection.recv_into, buffer)


class _QuietHandler(WSGIRequestHandler):
    """wsgiref's handler (one request a connection), its reads under a _HeaderDeadline."""

    def __init__(self, request, client_address, server, deadline: _HeaderDeadline) -> None:
        self._deadline = deadline
        super().__init__(request, client_address, server)  # serves the request

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the socket's own reader: replaced, its reference let go
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, self._deadline))

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # the headers are read
        self._deadline.lift()
        return parsed

    def log_message(self, format: str, *args) -> None:
        """No line per request: a scrape every few seconds would fill the log."""


class MetricsEndpoint(WSGIServer):
    """The /metrics server of `registry` on `host`:`port` (0: any free port)."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        tls: ssl.SSLContext | None = None,
        *,
        connections: int = METRICS_CONNECTIONS,
        idle_s: float = METRICS_IDLE_S,
        connections_per_host: int = METRICS_CONNECTIONS_PER_HOST,
        header_deadline_s: float = METRICS_HEADER_DEADLINE_S,
    ) -> None:
        family, _, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self.address_family = family
        super().__init__((address[0], port), _QuietHandler)
        self.set_app(_logged(make_wsgi_app(registry)))
        if tls is not None:
            self.socket = tls.wrap_socket(
                self.socket, server_side=True, do_handshake_on_connect=False
            )
        self._slots = threading.BoundedSemaphore(connections)
        self._idle_s = idle_s
        self._per_host = connections_per_host
        self._header_deadline_s = header_deadline_s
        self._hosts: Counter[str] = Counter()  # open connections by client host
        self._hosts_lock = threading.Lock()  # taken on accept, released on connection threads
        self._thread = threading.Thread(target=self.serve_forever, name="metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def process_request(self, request: socket.socket, client_address) -> None:
        deadline = _HeaderDeadline(request, self._header_deadline_s, self._idle_s)
        if not self._admit(client_address[0]):
            self.shutdown_request(request)
            return
        request.settimeout(self._idle_s)
        try:
            threading.Thread(
                target=self._serve,
                args=(request, client_address, deadline),
                name="metrics",
                daemon=True,
            ).start()
        except RuntimeError:  # no thread to be had: this connection is dropped (handle_error)
            self._leave(client_address[0])
            raise

    def _admit(self, host: str) -> bool:
        """Whether a connection from `host` may have a slot (then it holds one, and counts)."""
        with self._hosts_lock:
            if self._hosts[host] >= self._per_host or not self._slots.acquire(blocking=False):
                log.debug("metrics connection from %s closed: no slot for it", host)
                return False
            self._hosts[host] += 1
            return True

    def _leave(self, host: str) -> None:
        with self._hosts_lock:
            self._hosts[host] -= 1
            if not self._hosts[host]:
                del self._hosts[host]
            self._slots.release()

    def _serve(self, request: socket.socket, client_address, deadline: _HeaderDeadline) -> None:
        try:
            if isinstance(request, ssl.SSLSocket):
                deadline.call(request.do_handshake)
            _QuietHandler(request, client_address, self, deadline)
        except OSError as exc:  # the client's doing: timeouts, resets, TLS failures
            log.debug("metrics connection from %s closed: %s", client_address[0], exc)
        except Exception:  # a bug of ours: said in the log with its traceback
            log.exception("metrics connection from %s failed", client_address[0])
        finally:
            self.shutdown_request(request)
            self._leave(client_address[0])

    def handle_error(self, request, client_address) -> None:
        """What socketserver caught (a thread that would not start): in the log, where
        socketserver's own would print to stderr."""
        log.exception("metrics connection from %s failed", client_address[0])


def _logged(app):
    """The WSGI app with its failures in the log (wsgiref prints them to stderr)."""

    def logged_app(environ, start_response):
        try:
            return app(environ, start_response)
        except Exception:  # a collector's bug: the scrape fails, the endpoint goes on
            log.exception("a scrape of /metrics failed")
            start_response("500 Internal Server Error", [("Content-Type", "text/plain")])
            return [b"the scrape failed: see the daemon's log\n"]

    return logged_app


def tls_context(cert: str, key: str, client_ca: str = "") -> ssl.SSLContext:
    """The daemon's certificate; with `client_ca`, a client certificate it signed required."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    if client_ca:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
