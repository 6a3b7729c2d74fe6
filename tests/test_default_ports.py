"""No test depends on a fixed port (issue 47): the daemon's default ports are taken for
the whole run (tests/conftest.py, tests.support.ports), so a test that starts a daemon on
one fails on every machine, as it would where another kvgraftd runs."""

from __future__ import annotations

import errno
import os
import socket

import pytest

from tests.support.ports import DEFAULT_ADDRESSES, HELD_VARIABLE, closed_address


@pytest.mark.parametrize("address", DEFAULT_ADDRESSES)
def test_a_default_port_cannot_be_bound_during_the_run(address: str) -> None:
    """Taken by this run's hold. One the hold found taken (another program's, or a port
    in TIME_WAIT after a daemon stopped) is not this run's to judge."""
    if address not in os.environ.get(HELD_VARIABLE, "").split(","):
        pytest.skip(f"{address} was taken before the run (see the run's header)")
    host, port = address.rsplit(":", 1)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers set it
        with pytest.raises(OSError) as caught:
            sock.bind((host, int(port)))
    assert caught.value.errno == errno.EADDRINUSE


def test_a_closed_address_refuses_connections_while_held() -> None:
    with closed_address() as address:
        host, port = address.rsplit(":", 1)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, int(port)), timeout=10)
        with socket.socket() as other, pytest.raises(OSError) as caught:
            other.bind((host, int(port)))
        assert caught.value.errno == errno.EADDRINUSE
