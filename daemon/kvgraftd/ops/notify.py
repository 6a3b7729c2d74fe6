"""The systemd notify protocol (sd_notify), spoken over a Unix datagram socket.

systemd passes `NOTIFY_SOCKET` (a path, or `@name` for the abstract
namespace) to a `Type=notify` service, and `WATCHDOG_USEC` (with
`WATCHDOG_PID`) when the unit sets `WatchdogSec=`. The service sends
newline-separated `KEY=VALUE` datagrams: `READY=1`, `STOPPING=1`,
`WATCHDOG=1`, `STATUS=...`. Without `NOTIFY_SOCKET` every send is a no-op,
so the daemon runs the same under systemd, a terminal or a test.

Invariant: this module only speaks the protocol. It never decides *when* to
send: kvgraftd.ops.readiness sends READY and WATCHDOG after real health probes,
and kvgraftd.main sends STOPPING when the drain starts. A failed send is
logged, never raised: systemd being gone must not take the daemon down.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Notifier:
    """Sends sd_notify datagrams to `address` (None: nowhere)."""

    def __init__(self, address: str | None, watchdog_usec: int = 0) -> None:
        self.address = address
        self.watchdog_usec = watchdog_usec
        self._socket: socket.socket | None = None
        if address:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> Notifier:
        """Read NOTIFY_SOCKET, WATCHDOG_USEC and WATCHDOG_PID as systemd sets them."""
        address = environ.get("NOTIFY_SOCKET") or None
        if address and not (address.startswith("/") or address.startswith("@")):
            log.warning("NOTIFY_SOCKET=%r is neither a path nor @abstract; ignored", address)
            address = None
        watchdog_usec = 0
        owner = environ.get("WATCHDOG_PID")
        if owner is None or owner == str(os.getpid()):
            try:
                watchdog_usec = max(int(environ.get("WATCHDOG_USEC", "0")), 0)
            except ValueError:
                log.warning(
                    "WATCHDOG_USEC=%r is not an integer; watchdog off", environ["WATCHDOG_USEC"]
                )
        return cls(address, watchdog_usec)

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    @property
    def watchdog_interval_s(self) -> float:
        """How often to ping: half the watchdog timeout, as sd_watchdog_enabled(3) advises;
        0 when systemd set no watchdog."""
        return self.watchdog_usec / 2e6

    def send(self, **fields: str | int) -> bool:
        """Send one datagram of KEY=VALUE lines; True when it was delivered."""
        if self._socket is None or self.address is None:
            return False
        payload = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            self._socket.sendto(payload, target)
        except OSError as exc:
            log.warning("cannot notify systemd at %s: %s", self.address, exc)
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send(READY=1, STATUS=status, MAINPID=os.getpid())

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def stopping(self, status: str) -> bool:
        return self.send(STOPPING=1, STATUS=status)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
