"""The HTTP API against slow clients (issue 47): they are closed, others are served.

Was: 300 connections that sent one header byte at a time were held 40 s, and would have
been for as long as they went on (uvicorn has no read deadline), each a file descriptor
and a slot of the daemon's. Now:

* a request's line and headers must all come within HEADER_DEADLINE_S of the accept (on
  a keep-alive connection, of the previous answer), however often bytes come;
* a client host holds at most connections_per_host(config) connections (twice
  max_concurrent_rpcs, at least 8: 8 for this daemon's 4); one past its cap is closed
  at once.

On Linux loopback every 127.0.0.0/8 address is a host of its own: each test's clients
come from hosts of their own, so what one test leaves open counts against no other.
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Iterator

import pytest

from kvgraftd.config import DaemonConfig
from kvgraftd.http.http_server import HEADER_DEADLINE_S, KEEP_ALIVE_S, connections_per_host
from kvgraftd.testing.daemon_process import DaemonProcess
from tests.http.model_daemon import wait_until_healthy
from tests.support.slow_client import GET_HEALTH, Trickler, get, get_once_free, trickling

PER_HOST = 8  # connections_per_host with --max-concurrent-rpcs 4
READY = (200, b'{"status":"ready"}')
# A request whose headers are in and whose body is still to come: the app waits for it,
# no deadline applies (the body is read under the call limits' own rules).
POST_AWAITING_BODY = (
    b"POST /v1/completions HTTP/1.1\r\nHost: kvgraft\r\nContent-Type: application/json\r\n"
    b"Content-Length: 2\r\n\r\n"
)


@pytest.fixture(scope="module")
def http_daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    daemon = DaemonProcess.start(
        tmp_path_factory.mktemp("data"),
        ["--model", "tiny:1", "--workers", "4", "--max-concurrent-rpcs", "4"],
    )
    try:
        wait_until_healthy(daemon)
        yield daemon
    finally:
        daemon.stop()
    assert "Traceback" not in daemon.log()


def _address(daemon: DaemonProcess) -> tuple[str, int]:
    host, port = daemon.http_url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def test_the_cap_is_twice_the_calls_a_client_may_have() -> None:
    assert connections_per_host(DaemonConfig(workers=4, max_concurrent_rpcs=4)) == PER_HOST
    assert connections_per_host(DaemonConfig()) == 2 * DaemonConfig().max_concurrent_rpcs
    assert connections_per_host(DaemonConfig(workers=1, max_concurrent_rpcs=1)) == 8  # a floor


def test_header_tricklers_are_closed_while_a_keep_alive_client_is_served(http_daemon) -> None:
    address = _address(http_daemon)
    made = [Trickler(address, GET_HEALTH, "127.0.0.2") for _ in range(PER_HOST - 2)]
    with trickling(made) as tricklers:
        # a client of the same host, on one keep-alive connection for longer than the
        # deadline: each request has a deadline of its own, from the previous answer
        client = http.client.HTTPConnection(*address, timeout=30, source_address=("127.0.0.2", 0))
        client.connect()
        opened = time.monotonic()
        assert client.sock is not None
        local = client.sock.getsockname()
        answers = []
        while True:  # a request every third of the keep-alive time, the last one sent
            # later than the deadline counted from the accept
            late = time.monotonic() - opened > HEADER_DEADLINE_S + 1
            client.request("GET", "/health")
            response = client.getresponse()
            answers.append((response.status, response.read()))
            if late:
                break
            time.sleep(KEEP_ALIVE_S / 3)
        assert client.sock is not None and client.sock.getsockname() == local  # no reconnect
        client.close()
        assert set(answers) == {READY}
        lasted = [trickler.closed_after_s() for trickler in tricklers]  # was: never closed
        assert min(lasted) >= HEADER_DEADLINE_S  # counted from the accept, not from a byte
        assert all(trickler.bytes_sent > len(GET_HEALTH) for trickler in tricklers)


def test_a_host_past_its_cap_is_closed_at_once(http_daemon) -> None:
    address = _address(http_daemon)
    made = [
        Trickler(address, POST_AWAITING_BODY, "127.0.0.3", interval_s=3600)
        for _ in range(PER_HOST + 1)
    ]
    with trickling(made) as tricklers:
        held, past = tricklers[:PER_HOST], tricklers[PER_HOST]
        past.closed_after_s()  # was: held as well, without bound
        assert [trickler.is_open() for trickler in held] == [True] * PER_HOST
        assert get(address, "/health", "127.0.0.4") == READY  # another host: served
        held[0].close()
        # the host's place is its own again once the server sees the connection closed
        assert get_once_free(address, "/health", "127.0.0.3") == READY
