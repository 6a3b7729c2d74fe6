"""Readiness and watchdog for systemd: every notification follows a real health probe.

`HealthProbe` asks the daemon's own gRPC server the standard health `Check`,
over the network like any client. `Readiness` runs it on a thread: it sends
`READY=1` once a probe answers SERVING, then, when systemd set a watchdog,
`WATCHDOG=1` every WATCHDOG_USEC/2 — each ping only after a probe answered
SERVING in time, so a wedged server (no thread free, a hung port) stops the
pings and systemd restarts the daemon.

What it must not do: decide health itself (the gRPC health service does),
or send STOPPING (the composition root does, when the drain starts).
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgraftd.ops.notify import Notifier

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0
READY_RETRY_S = 0.05


class HealthProbe:
    """A health Check against the daemon's own server at `target` (a gRPC address)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._channel = grpc.insecure_channel(target)
        self._check = health_pb2_grpc.HealthStub(self._channel).Check

    def serving(self, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
        try:
            response = self._check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s, wait_for_ready=True
            )
        except grpc.RpcError as exc:
            log.debug("health probe of %s failed: %s", self.target, exc)
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self._channel.close()


class Readiness:
    """Sends READY=1 after the first good probe, then WATCHDOG=1 after each good one."""

    def __init__(self, notifier: Notifier, probe: HealthProbe, status: str) -> None:
        self._notifier = notifier
        self._probe = probe
        self._status = status
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="readiness", daemon=True)
        self.ready_after_s: float | None = None  # seconds from start() to READY=1

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        """Stop probing (before STOPPING=1: no watchdog ping may follow it)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._probe.close()

    def _run(self) -> None:
        while not self._probe.serving():
            if self._stop.wait(READY_RETRY_S):
                return
        if self._stop.is_set():
            return
        self.ready_after_s = time.monotonic() - self._started
        self._notifier.ready(self._status)
        log.info(
            "health probe of %s answered SERVING; systemd told READY (%.0f ms after start)",
            self._probe.target,
            self.ready_after_s * 1000,
        )
        interval_s = self._notifier.watchdog_interval_s
        if not interval_s:
            return
        log.info("watchdog: a health probe and a ping every %.3f s", interval_s)
        due = time.monotonic() + interval_s
        while not self._stop.wait(max(due - time.monotonic(), 0.0)):
            due += interval_s
            if self._probe.serving(min(PROBE_TIMEOUT_S, interval_s)):
                if not self._stop.is_set():
                    self._notifier.watchdog()
            else:
                log.warning("health probe of %s failed: no watchdog ping", self._probe.target)
            due = max(due, time.monotonic())  # a slow probe delays, never bunches, pings


def probe_target(listen: str, port: int, probe_socket: str = "") -> str:
    """Where to probe the daemon serving `listen` on `port` (a wildcard host: loopback)."""
    if probe_socket:
        return probe_socket
    if listen.startswith("unix"):
        return listen
    host = listen.rsplit(":", 1)[0]
    if host in ("", "0.0.0.0", "*"):
        host = "127.0.0.1"
    elif host in ("[::]", "::"):
        host = "[::1]"
    return f"{host}:{port}"
