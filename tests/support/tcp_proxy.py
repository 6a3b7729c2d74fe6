"""A TCP proxy for fault tests: it forwards both ways and can cut or corrupt one direction.

`FaultProxy(upstream)` listens on 127.0.0.1 (port 0) and forwards every
connection to `upstream`. Faults are armed on one direction, "up" (client to
upstream) or "down" (upstream to client), at a byte offset counted over
everything forwarded that way after arming, across connections:

* `cut_after(direction, n)`: forward n more bytes, then close every open
  connection, both sides (each peer reads what was forwarded, then the end of
  the stream: a cut mid-transfer). Fires once; later connections work.
* `flip_at(direction, n, mask)`: XOR the byte at offset n with `mask`. Fires once.
* `flip_in(direction, pattern, at, mask)`: XOR byte `at` of the first occurrence
  of `pattern` (within one read) with `mask`. Fires once.
* `go_silent()`: the open connections stop forwarding, both ways, without
  closing (a peer host gone: nothing arrives, nothing says so, not even that
  the other peer hung up); new connections work.
* `silence_after(direction, n)`: forward n more bytes, then `go_silent()`: a
  half-open cut mid-transfer (neither peer hears of it). Fires once.

`forwarded[direction]` counts all bytes forwarded. With `record=True` the
bytes sent up are kept per connection (`recorded`), so a test can see which
gRPC messages a server received whole before a cut (`grpc_messages`).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from dataclasses import dataclass, field

DIRECTIONS = ("up", "down")
_BUFFER_BYTES = 256 << 10
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@dataclass
class _Fault:
    kind: str  # "cut", "silence", "flip" or "flip_in"
    at: int  # offset, counted from `base` (for flip_in: into `pattern`)
    base: int  # forwarded[direction] when armed
    mask: int = 0x01
    pattern: bytes = b""
    fired: threading.Event = field(default_factory=threading.Event)


class FaultProxy:
    def __init__(self, upstream: str, *, record: bool = False) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._faults: dict[str, list[_Fault]] = {d: [] for d in DIRECTIONS}
        self._open: list[tuple[int, socket.socket, socket.socket]] = []  # (number, client, up)
        self._silent: set[int] = set()  # numbers of the connections that went silent
        self._record = record
        self.forwarded = dict.fromkeys(DIRECTIONS, 0)
        self.recorded: list[bytearray] = []
        self.connections = 0
        self._closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    # ------------------------------------------------------------------
    def cut_after(self, direction: str, n: int) -> threading.Event:
        """Close every connection once n more bytes went `direction`; returns 'fired'."""
        return self._arm(direction, "cut", n)

    def silence_after(self, direction: str, n: int) -> threading.Event:
        """Stop forwarding (without closing) once n more bytes went `direction`."""
        return self._arm(direction, "silence", n)

    def flip_at(self, direction: str, n: int, mask: int = 0x01) -> threading.Event:
        """XOR the n-th byte from now going `direction` with `mask`; returns 'fired'."""
        return self._arm(direction, "flip", n, mask)

    def flip_in(self, direction: str, pattern: bytes, at: int, mask: int) -> threading.Event:
        """XOR byte `at` of the next `pattern` going `direction` with `mask`; returns 'fired'."""
        return self._arm(direction, "flip_in", at, mask, pattern)

    def _arm(
        self, direction: str, kind: str, n: int, mask: int = 0x01, pattern: bytes = b""
    ) -> threading.Event:
        with self._lock:
            fault = _Fault(kind, n, self.forwarded[direction], mask, pattern)
            self._faults[direction].append(fault)
            return fault.fired

    def go_silent(self) -> None:
        with self._lock:
            self._silent |= {number for number, _, _ in self._open}

    def close(self) -> None:
        self._closing = True
        # close() alone does not wake a thread blocked in accept(): it would take one
        # more connection and forward it. shutdown() does (EINVAL).
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._close_all()

    # ------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._upstream)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            record = bytearray()
            with self._lock:
                self.connections += 1
                key = self.connections  # numbers, not descriptors: those are reused
                self._open.append((key, client, upstream))
                if self._record:
                    self.recorded.append(record)
            args = (client, upstream, "up", record, key)
            threading.Thread(target=self._pump, args=args, daemon=True).start()
            args = (upstream, client, "down", None, key)
            threading.Thread(target=self._pump, args=args, daemon=True).start()

    def _pump(
        self, src: socket.socket, dst: socket.socket, direction: str, record, key: int
    ) -> None:
        try:
            while True:
                data = src.recv(_BUFFER_BYTES)
                if not data:
                    break
                if key in self._silent:
                    continue  # swallowed
                data, ending = self._apply_faults(direction, bytearray(data))
                dst.sendall(data)
                if record is not None:
                    record += data
                if ending == "cut":
                    self._close_all()
                    return
                if ending == "silence":
                    self.go_silent()
        except OSError:
            pass
        # One side ended: end the other, unless the connection went silent (a peer that
        # is gone says nothing, not even that the other side hung up: half-open).
        ended = (src,) if key in self._silent else (src, dst)
        for sock in ended:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        src.close()  # each socket is the source of one pump

    def _apply_faults(self, direction: str, data: bytearray) -> tuple[bytearray, str]:
        """The bytes to forward, and how the connections end after them: "cut",
        "silence" or "" (they go on)."""
        with self._lock:
            start = self.forwarded[direction]
            ending = ""
            for fault in self._faults[direction]:
                if fault.fired.is_set():
                    continue
                if fault.kind == "flip_in":
                    found = data.find(fault.pattern)
                    if found >= 0:
                        data[found + fault.at] ^= fault.mask
                        fault.fired.set()
                    continue
                offset = fault.base + fault.at - start
                if not 0 <= offset < len(data):
                    continue
                if fault.kind == "flip":
                    data[offset] ^= fault.mask
                else:  # "cut" or "silence": the rest of this read is never forwarded
                    del data[offset:]
                    ending = fault.kind
                fault.fired.set()
            self.forwarded[direction] += len(data)
        return data, ending

    def _close_all(self) -> None:
        with self._lock:
            pairs, self._open = self._open, []
        for _, *pair in pairs:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


def grpc_messages(raw: bytes | bytearray) -> tuple[dict[int, list[bytes]], dict[int, bytes]]:
    """The gRPC messages a client sent on each HTTP/2 stream of a recorded connection.

    Parses the client's HTTP/2 frames (DATA payloads, per stream) and the gRPC
    length-prefixed messages in them. Returns the whole messages of each
    stream, and the bytes of the message each stream had begun when the
    recording ends (a server never receives that one: gRPC delivers whole
    messages only).
    """
    view = memoryview(raw)
    pos = len(_HTTP2_PREFACE) if bytes(view[: len(_HTTP2_PREFACE)]) == _HTTP2_PREFACE else 0
    data: dict[int, bytearray] = {}
    while pos + 9 <= len(view):
        length = int.from_bytes(view[pos : pos + 3], "big")
        kind, flags = view[pos + 3], view[pos + 4]
        stream = struct.unpack(">I", view[pos + 5 : pos + 9])[0] & 0x7FFFFFFF
        payload = view[pos + 9 : pos + 9 + length]  # the last frame may be cut short
        if kind == 0:  # DATA
            if flags & 0x8 and len(payload) == length:  # PADDED
                payload = payload[1 : len(payload) - payload[0]]
            data.setdefault(stream, bytearray()).extend(payload)
        pos += 9 + length
    messages: dict[int, list[bytes]] = {}
    tails: dict[int, bytes] = {}
    for stream, body in data.items():
        at = 0
        while at + 5 <= len(body):
            size = int.from_bytes(body[at + 1 : at + 5], "big")
            if at + 5 + size > len(body):
                break
            messages.setdefault(stream, []).append(bytes(body[at + 5 : at + 5 + size]))
            at += 5 + size
        if at < len(body):
            tails[stream] = bytes(body[at:])
    return messages, tails
