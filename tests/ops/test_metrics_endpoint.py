"""The /metrics endpoint against clients that connect and say nothing.

* A connection that says nothing, or half a request, is closed after the idle timeout
  with a DEBUG line: socketserver printed a TimeoutError traceback for each (67 from 300
  connections on a running daemon).
* With TLS, a client that connects and never starts its handshake held up every scrape
  for as long as it stayed (Python's TLS sockets handshake in accept(), on the one
  thread that accepts): the handshake now runs on the connection's own thread.

The endpoint runs in-process here (a short idle timeout); the daemon's own endpoint is
tested the same way below and in tests/server/test_hostile_input.py.
"""

from __future__ import annotations

import logging
import socket
import ssl
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from kvgraftd.ops.metrics_endpoint import MetricsEndpoint, tls_context
from tests.support.certs import Pki
from tests.support.metrics_scrape import probe_registry


@contextmanager
def _serving(tls: ssl.SSLContext | None = None, idle_s: float = 0.3) -> Iterator[MetricsEndpoint]:
    # every connection here comes from 127.0.0.1: all of them within its host's cap
    # (the cap has tests of its own, tests/ops/test_slow_clients.py)
    endpoint = MetricsEndpoint(
        "127.0.0.1", 0, probe_registry(), tls, idle_s=idle_s, connections_per_host=16
    )
    endpoint.start()
    try:
        yield endpoint
    finally:
        endpoint.stop()


def _closed_by_the_server(connection: socket.socket) -> bool:
    """Whether the server closed `connection`: it reads to end of file, or is reset (what
    the server sent first, e.g. a TLS alert, is read past; a server that never closes it
    fails the test by the timeout)."""
    connection.settimeout(30)
    try:
        while connection.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def test_idle_connections_are_closed_without_a_traceback(capfd, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="kvgraftd.ops.metrics_endpoint")
    with _serving() as endpoint:
        port = endpoint.server_port
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        halves = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        for connection in halves:
            connection.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
        for connection in silent + halves:
            assert _closed_by_the_server(connection)
            connection.close()
        url = f"http://127.0.0.1:{port}/metrics"
        assert b"probe_scrapes_total 1.0" in urllib.request.urlopen(url, timeout=10).read()
    assert capfd.readouterr().err == ""  # socketserver printed a traceback for each
    said = [r for r in caplog.records if r.name == "kvgraftd.ops.metrics_endpoint"]
    assert [r.levelno for r in said] == [logging.DEBUG] * 8
    assert all(r.getMessage().endswith("closed: timed out") for r in said)


def test_a_silent_tls_client_does_not_hold_up_scrapes(pki: Pki, capfd) -> None:
    tls = tls_context(str(pki.server_cert), str(pki.server_key))
    trusting = ssl.create_default_context(cafile=str(pki.ca))
    with _serving(tls, idle_s=30) as endpoint:  # the silent one outlives the scrape
        port = endpoint.server_port
        silent = socket.create_connection(("127.0.0.1", port))
        try:
            url = f"https://127.0.0.1:{port}/metrics"
            with urllib.request.urlopen(url, context=trusting, timeout=10) as response:
                assert b"probe_scrapes_total 1.0" in response.read()  # was: a handshake timeout
            plain = socket.create_connection(("127.0.0.1", port))
            plain.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")  # not TLS: refused, quietly
            assert _closed_by_the_server(plain)
            plain.close()
        finally:
            silent.close()
    assert capfd.readouterr().err == ""
