"""The HTTP(S) endpoint that serves /metrics: connections bounded, idle ones closed, quiet.

Contract:
* At most METRICS_CONNECTIONS connections are served at once, each on a thread of its
  own; one more is closed at once. A connection idle for METRICS_IDLE_S is closed.
* With TLS, the handshake runs on the connection's thread, under the same idle timeout,
  never on the thread that accepts connections: a client that connects and says
  nothing would otherwise hold up every scrape (Python's TLS sockets handshake in
  accept()).
* What a client does to its own connection (a timeout, a reset, a failed handshake, a
  request that does not parse) is no event of the daemon's: a DEBUG line, never a
  traceback on stderr (socketserver prints one per such connection by default).
* It holds no lock of the store: the collector it serves reads its figures.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import make_wsgi_app
from prometheus_client.registry import CollectorRegistry

log = logging.getLogger(__name__)

# A scraper needs one connection; each open one costs a thread.
METRICS_CONNECTIONS = 16
METRICS_IDLE_S = 10.0


class _QuietHandler(WSGIRequestHandler):
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
        self._thread = threading.Thread(target=self.serve_forever, name="metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def process_request(self, request: socket.socket, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        request.settimeout(self._idle_s)
        try:
            threading.Thread(
                target=self._serve, args=(request, client_address), name="metrics", daemon=True
            ).start()
        except RuntimeError:  # no thread to be had: this connection is dropped (handle_error)
            self._slots.release()
            raise

    def _serve(self, request: socket.socket, client_address) -> None:
        try:
            if isinstance(request, ssl.SSLSocket):
                request.do_handshake()
            self.finish_request(request, client_address)
        except OSError as exc:  # the client's doing: timeouts, resets, TLS failures
            log.debug("metrics connection from %s closed: %s", client_address[0], exc)
        except Exception:  # a bug of ours: said in the log with its traceback
            log.exception("metrics connection from %s failed", client_address[0])
        finally:
            self.shutdown_request(request)
            self._slots.release()

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
