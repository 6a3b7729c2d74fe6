"""The HTTP listener of the OpenAI-compatible API: uvicorn on a thread of its own.

`HttpServer.start(config, app)` binds `http_listen` itself (so a port in use is an
OSError saying why, in the main thread, before the daemon reports ready, and port 0
picks one), then runs uvicorn's server (h11, asyncio) on a thread with TLS from the
daemon's certificate when it has one (mutual when tls_client_ca is set). `stop` asks
uvicorn to stop taking connections and waits up to drain_s for the requests in flight,
as the gRPC server drains. uvicorn installs no signal handler off the main thread: the
daemon's own stop signals (kvgraftd.main) stay in charge.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time

import uvicorn

from kvgraftd.config import DaemonConfig
from kvgraftd.server.bind_errors import why_not_bound

log = logging.getLogger(__name__)
# uvicorn's own lines ("Started server process", ...) repeat what kvgraftd.main logs; its
# warnings (a malformed request) and errors stay.
logging.getLogger("uvicorn.error").setLevel(logging.WARNING)

START_TIMEOUT_S = 30.0
KEEP_ALIVE_S = 5


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
            http="h11",
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
