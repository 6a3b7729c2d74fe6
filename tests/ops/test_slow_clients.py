"""The /metrics endpoint against slow clients (issue 47): scrapes are served while they go on.

Was: 16 connections that sent one header byte every 2 s held every slot for as long as
they went on (the idle timeout is per read), and each scrape was refused. Now:

* the request line and headers (with TLS, the handshake too) must arrive within a
  deadline from the accept, however often bytes come;
* a client host holds at most METRICS_CONNECTIONS_PER_HOST of the slots: one past its
  cap is closed at once, so other hosts' scrapes find slots.

On Linux loopback every 127.0.0.0/8 address is a host of its own: the tricklers come from
127.0.0.1, the scrapes that must be served from 127.0.0.2. The endpoint runs in-process
(a deadline or a cap set apart, to see each alone) and in a real daemon (its defaults).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvgraftd.ops.metrics_endpoint import (
    METRICS_CONNECTIONS,
    METRICS_CONNECTIONS_PER_HOST,
    METRICS_HEADER_DEADLINE_S,
    METRICS_IDLE_S,
    MetricsEndpoint,
    tls_context,
)
from tests.support.certs import Pki
from tests.support.metrics_scrape import probe_registry
from tests.support.slow_client import GET_METRICS, Trickler, get, get_once_free, trickling

PROBE = b"probe_scrapes_total 1.0"


@contextmanager
def _serving(tls: ssl.SSLContext | None = None, **limits) -> Iterator[tuple[str, int]]:
    endpoint = MetricsEndpoint("127.0.0.1", 0, probe_registry(), tls, **limits)
    endpoint.start()
    try:
        yield ("127.0.0.1", endpoint.server_port)
    finally:
        endpoint.stop()


def test_a_host_past_its_cap_is_closed_at_once_and_others_are_served() -> None:
    assert METRICS_CONNECTIONS_PER_HOST < METRICS_CONNECTIONS  # a host leaves slots to others
    with _serving(header_deadline_s=3600) as address:  # the cap alone: no deadline acts
        made = [Trickler(address, GET_METRICS) for _ in range(METRICS_CONNECTIONS)]
        with trickling(made) as tricklers:
            held, past = (
                tricklers[:METRICS_CONNECTIONS_PER_HOST],
                tricklers[METRICS_CONNECTIONS_PER_HOST:],
            )
            for trickler in past:
                trickler.closed_after_s()  # was: held, each in a slot, for as long as it went on
            status, body = get(address, "/metrics", "127.0.0.2")  # was: refused, no slot
            assert (status, PROBE in body) == (200, True)
            assert [trickler.is_open() for trickler in held] == [True] * len(held)
            for trickler in held:
                trickler.close()
            # the host's slots are its own again once the endpoint sees them closed
            status, body = get_once_free(address, "/metrics", "127.0.0.1")
            assert (status, PROBE in body) == (200, True)


def test_header_tricklers_are_closed_at_the_deadline(capfd, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="kvgraftd.ops.metrics_endpoint")
    deadline_s = 2.0
    interval_s = 0.5
    assert interval_s < METRICS_IDLE_S  # each byte comes within the idle timeout
    with _serving(header_deadline_s=deadline_s) as address:
        made = [Trickler(address, GET_METRICS, interval_s=interval_s) for _ in range(4)]
        with trickling(made) as tricklers:
            lasted = [trickler.closed_after_s() for trickler in tricklers]  # was: never closed
            assert all(trickler.bytes_sent > len(GET_METRICS) for trickler in tricklers)
            assert min(lasted) >= deadline_s  # counted from the accept, not from a byte
        status, body = get(address, "/metrics", "127.0.0.1")
        assert (status, PROBE in body) == (200, True)
    assert capfd.readouterr().err == ""
    said = [r for r in caplog.records if r.name == "kvgraftd.ops.metrics_endpoint"]
    assert [(r.levelno, r.getMessage()) for r in said] == [
        (
            logging.DEBUG,
            "metrics connection from 127.0.0.1 closed: its request line and headers took "
            "longer than 2 s",
        )
    ] * 4


def _client_hello(pki: Pki) -> bytes:
    """The first bytes a TLS client sends (its ClientHello record)."""
    client = ssl.create_default_context(cafile=str(pki.ca))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    session = client.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        session.do_handshake()
    return outgoing.read()


def test_a_tls_handshake_trickler_is_closed_at_the_deadline(pki: Pki, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="kvgraftd.ops.metrics_endpoint")
    tls = tls_context(str(pki.server_cert), str(pki.server_key))
    hello = _client_hello(pki)
    with _serving(tls, header_deadline_s=2.0) as address:
        # the hello's record header at once, then its body a byte every 0.25 s
        made = [Trickler(address, hello[:5], interval_s=0.25, tail=hello[5:])]
        with trickling(made) as (trickler,):
            assert trickler.closed_after_s() >= 2.0
            assert trickler.bytes_sent < len(hello)  # closed in its handshake
        trusting = ssl.create_default_context(cafile=str(pki.ca))
        status, body = get(address, "/metrics", "127.0.0.1", tls=trusting)
        assert (status, PROBE in body) == (200, True)
    said = [r.getMessage() for r in caplog.records if r.name == "kvgraftd.ops.metrics_endpoint"]
    assert said == [
        "metrics connection from 127.0.0.1 closed: its request line and headers took "
        "longer than 2 s"
    ]


def test_tricklers_do_not_hold_up_the_daemons_scrapes(start_daemon) -> None:
    """The daemon's own endpoint, its defaults: as many tricklers as it has slots."""
    daemon = start_daemon(extra_args=["--metrics-listen", "127.0.0.1:0"])
    port = int(daemon.metrics_url.rsplit(":", 1)[1].split("/", 1)[0])
    address = ("127.0.0.1", port)
    made = [Trickler(address, GET_METRICS) for _ in range(METRICS_CONNECTIONS)]
    with trickling(made) as tricklers:
        status, body = get(address, "/metrics", "127.0.0.2")  # was: refused, every slot held
        assert (status, b"kvgraft_store_artifacts" in body) == (200, True)
        lasted = [trickler.closed_after_s() for trickler in tricklers]  # was: never closed
        assert max(lasted) >= METRICS_HEADER_DEADLINE_S  # those within the cap: the deadline
        status, body = get_once_free(address, "/metrics", "127.0.0.1")
        assert (status, b"kvgraft_store_artifacts" in body) == (200, True)
    assert "Traceback" not in daemon.log()
