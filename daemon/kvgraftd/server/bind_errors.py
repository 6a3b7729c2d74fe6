"""Why the server could not listen on an address, in words that say the fix.

gRPC answers a failed bind with "Failed to bind to address ...; set GRPC_VERBOSITY=debug",
whatever the cause (its C core's own log line, silenced by kvgraftd.ops.quiet_grpc, is
the only place that says more). After such a failure `why_not_bound` binds the address
itself, with the same SO_REUSEADDR gRPC uses, and names what the kernel answered: in use,
not an address of this machine, a privileged port.
"""

from __future__ import annotations

import errno
import socket


def why_not_bound(listen: str, flag: str = "--listen") -> str:
    """One line: why `listen` cannot be served, and what to do (for an OSError at start);
    `flag`: the setting that names it."""
    if listen.startswith("unix:"):  # the health probe's socket, in the data directory
        return (
            f"cannot listen on {listen}: the socket cannot be made there (is the data "
            "directory writable?)"
        )
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")  # [::1]:50551
    try:
        addresses = socket.getaddrinfo(
            host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror:
        return (
            f"cannot listen on {listen}: the host {host} does not resolve; give an address of "
            "this machine (127.0.0.1, or 0.0.0.0 for all)"
        )
    for family, kind, protocol, _, address in addresses:
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                return _tcp_problem(listen, host, exc, flag)
    return f"cannot listen on {listen} (GRPC_VERBOSITY=debug shows gRPC's reason)"


def _tcp_problem(listen: str, host: str, exc: OSError, flag: str) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (
            f"{listen} is already in use: stop what listens there (another kvgraftd?) or pick "
            f"another {flag}"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return (
            f"cannot listen on {listen}: {host} is not an address of this machine; give one of "
            "its addresses (127.0.0.1, or 0.0.0.0 for all)"
        )
    if exc.errno == errno.EACCES:
        return (
            f"cannot listen on {listen}: a port below 1024 needs privileges; pick a port of "
            "1024 or more"
        )
    return f"cannot listen on {listen}: {exc.strerror}"
