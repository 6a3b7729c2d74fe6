"""Slow clients for the tests of the daemon's HTTP ports: a header trickler and its reads.

`Trickler(address, head, source_host)` connects from `source_host` (any 127.0.0.0/8
address is a host of its own on Linux loopback) and sends `head` at once, then one byte
every `interval_s` (of `tail`, then of a last header that never ends), on a thread of
its own, until the server closes the connection. Each byte comes sooner than any idle
timeout, so only a deadline on the whole request closes it. `closed_after_s()` reads
until the server closes it (end of file or a reset) and says how long after the connect
it was (at least the time from the server's accept); a server that never closes it fails
the test by `wait_s`. `get(address, path, source_host)` is a plain request from a host.
"""

from __future__ import annotations

import errno
import http.client
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

# A request that never ends: its last header grows by a byte at a time.
GET_METRICS = b"GET /metrics HTTP/1.1\r\nHost: kvgraft\r\nX-Slow: "
GET_HEALTH = b"GET /health HTTP/1.1\r\nHost: kvgraft\r\nX-Slow: "


class Trickler:
    def __init__(
        self,
        address: tuple[str, int],
        head: bytes,
        source_host: str = "127.0.0.1",
        interval_s: float = 1.0,
        tail: bytes = b"",
    ) -> None:
        self.connected_at = time.monotonic()  # before the connect: the server accepts after it
        self.socket = socket.create_connection(address, timeout=30, source_address=(source_host, 0))
        self.bytes_sent = 0
        self._head = head
        self._tail = tail
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, name="trickler", daemon=True)
        self._thread.start()

    def _trickle(self) -> None:
        try:
            self.socket.sendall(self._head)
            self.bytes_sent = len(self._head)
            for byte in _endless(self._tail):
                if self._stop.wait(self._interval_s):
                    return
                self.socket.sendall(byte)
                self.bytes_sent += 1
        except OSError:  # the server closed it: what the test waits for
            pass

    def closed_after_s(self, wait_s: float = 60.0) -> float:
        """Seconds from the connect until the server closed it (what it sent is read past)."""
        self.socket.settimeout(wait_s)
        try:
            while self.socket.recv(65536):
                pass
        except ConnectionResetError:
            pass
        except OSError as exc:  # e.g. EPIPE seen by the reading side: closed too
            if exc.errno not in (errno.EPIPE, errno.ECONNABORTED):
                raise
        return time.monotonic() - self.connected_at

    def is_open(self) -> bool:
        """Whether the server has neither closed it nor sent anything (a read would wait)."""
        readable, _, _ = select.select([self.socket], [], [], 0)  # an end of file reads too
        return not readable

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.socket.close()


def _endless(tail: bytes) -> Iterator[bytes]:
    """`tail` a byte at a time, then b"a" for ever."""
    for byte in tail:
        yield bytes([byte])
    while True:
        yield b"a"


def connect_from(address: tuple[str, int], source_host: str) -> socket.socket:
    """A plain connection to `address` from `source_host` (a loopback address)."""
    return socket.create_connection(address, timeout=30, source_address=(source_host, 0))


def get(
    address: tuple[str, int], path: str, source_host: str, tls: ssl.SSLContext | None = None
) -> tuple[int, bytes]:
    """GET `path` from `source_host` on a connection of its own: (status, body)."""
    host, port = address
    connection = (
        http.client.HTTPSConnection(
            host, port, timeout=30, source_address=(source_host, 0), context=tls
        )
        if tls
        else http.client.HTTPConnection(host, port, timeout=30, source_address=(source_host, 0))
    )
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def get_once_free(
    address: tuple[str, int], path: str, source_host: str, tries: int = 100
) -> tuple[int, bytes]:
    """GET `path` from `source_host`, again while the server still counts connections it
    closed a moment ago (it notices a client's close on its own time)."""
    for _ in range(tries - 1):
        try:
            return get(address, path, source_host)
        except (ConnectionError, http.client.RemoteDisconnected):
            time.sleep(0.1)
    return get(address, path, source_host)


@contextmanager
def trickling(tricklers: list[Trickler]) -> Iterator[list[Trickler]]:
    """`tricklers`, each closed when the block ends."""
    try:
        yield tricklers
    finally:
        for trickler in tricklers:
            trickler.close()
