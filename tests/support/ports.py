"""Ports in tests: none fixed, and the daemon's defaults taken for the whole run.

No test may depend on a fixed port: a machine that runs the tests may run anything
else too, another kvgraftd on its default ports included (issue 47: `make test`
failed there). A daemon a test starts listens on port 0 (the kernel picks a free
port; kvgraftd.testing.daemon_process passes `--listen 127.0.0.1:0
--http-listen 127.0.0.1:0`), and an address where nothing may answer is
`closed_address()`.

`DefaultPortHold` takes the daemon's default addresses (kvgraftd.config:
gRPC 127.0.0.1:50551, the HTTP API 127.0.0.1:8551; metrics have none) for the
whole run, as tests/conftest.py does: a test that starts a daemon on a default
port then fails on every machine, not only on a busy one. A socket is bound and
never listens: nothing of the machine is exposed, a connection to it is refused
as where nothing runs, and a bind by anyone else fails (SO_REUSEADDR is left off,
so even a socket that sets it cannot share the port). An address already taken by
another program is left to it (it holds the port just as well); the run goes on.
While the tests run, a daemon started by hand on a default port fails with
"already in use": give it another --listen, or start it before the tests.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

from kvgraftd.config import DEFAULT_HTTP_LISTEN, DEFAULT_LISTEN

DEFAULT_ADDRESSES = (DEFAULT_LISTEN, DEFAULT_HTTP_LISTEN)


def _bound(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) that does not listen; SO_REUSEADDR off."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def closed_address() -> Iterator[str]:
    """A loopback host:port where nothing listens, for the block: a connection is refused
    at once, and no other program can take the port meanwhile (unlike a port picked,
    freed and then named, or a well-known one such as 1 or 9, which a machine may serve)."""
    with _bound("127.0.0.1", 0) as sock:
        yield f"127.0.0.1:{sock.getsockname()[1]}"


HELD_VARIABLE = "KVGRAFT_TESTS_HELD_ADDRESSES"  # what the run holds, for its workers to read


class DefaultPortHold:
    """The default addresses, bound for as long as the hold is open."""

    def __init__(self, addresses: tuple[str, ...] = DEFAULT_ADDRESSES) -> None:
        self.held: list[str] = []  # bound by this hold
        self.taken: list[str] = []  # in use by another program already: left to it
        self._sockets: list[socket.socket] = []
        for address in addresses:
            host, port = address.rsplit(":", 1)
            try:
                self._sockets.append(_bound(host, int(port)))
            except OSError:
                self.taken.append(address)
            else:
                self.held.append(address)

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()
        self._sockets = []

    def describe(self) -> str:
        """One line for the test run's header."""
        said = []
        if self.held:
            said.append(f"held by this run: {', '.join(self.held)}")
        if self.taken:
            said.append(f"taken already (another program or test run): {', '.join(self.taken)}")
        return "default ports (a test that binds one fails): " + "; ".join(said)
