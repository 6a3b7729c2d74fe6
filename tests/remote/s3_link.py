"""A link to the S3 server that a test can take down or hang, recording what it refused.

`S3Link(upstream)` listens on 127.0.0.1 (port 0); a daemon whose endpoint is
`link.endpoint` reaches the S3 server through it. Its mode decides what a
new connection gets:

* "up": forwarded both ways, untouched;
* "down": the first request's head is read and recorded, then the
  connection is closed unanswered (the server died mid-request);
* "hung": the first request's head is read and recorded, and nothing ever
  comes back (a hung server): the connection is held open.

`set_mode` closes every open connection first (forwarded or held), so what
was under way when the link changed ends there, and a client's pooled
connections cannot bypass the new mode. `requests` lists (mode, request
line) for each request the link refused, in order: what the daemon asked
while the server was away, exactly.
"""

from __future__ import annotations

import contextlib
import socket
import threading

_HEAD_END = b"\r\n\r\n"
_BUFFER_BYTES = 256 << 10


class S3Link:
    def __init__(self, upstream_port: int, mode: str = "up") -> None:
        self._upstream = ("127.0.0.1", upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._mode = mode
        self.requests: list[tuple[str, str]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def set_mode(self, mode: str) -> None:
        assert mode in ("up", "down", "hung")
        with self._lock:
            self._mode = mode
            sockets, self._open = self._open, []
        _close(sockets)

    def refused(self, mode: str, verb_and_path: str = "") -> list[str]:
        """The request lines refused in `mode` that start with `verb_and_path`."""
        with self._lock:
            return [
                line
                for seen_in, line in self.requests
                if seen_in == mode and line.startswith(verb_and_path)
            ]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self.set_mode("down")

    # ------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                mode = self._mode
                self._open.append(client)
            if mode == "up":
                threading.Thread(target=self._forward, args=(client,), daemon=True).start()
            else:
                threading.Thread(target=self._refuse, args=(client, mode), daemon=True).start()

    def _refuse(self, client: socket.socket, mode: str) -> None:
        head = b""
        with contextlib.suppress(OSError):
            while _HEAD_END not in head:
                data = client.recv(_BUFFER_BYTES)
                if not data:
                    break
                head += data
        if head:
            with self._lock:
                self.requests.append((mode, head.split(b"\r\n", 1)[0].decode("latin-1")))
        if mode == "down":
            _close([client])  # "hung": held open until the mode changes

    def _forward(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self._upstream)
        except OSError:
            _close([client])
            return
        with self._lock:
            self._open.append(upstream)
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(src, dst), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(_BUFFER_BYTES):
            dst.sendall(data)
    _close([src, dst])


def _close(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
