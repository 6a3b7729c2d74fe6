"""What a replication source or target may be called: host:port or a gRPC target,
checked where it enters.

A source enters through the Replicate RPC (kvgraftd.replication.pulls), the daemon's
configuration (`[replication] follow` and `pull_from`) and the command line
(`kvgraft replicate --from/--to`). gRPC takes any text as a target and makes the best
of it (port 99999 reached another port), so each of those asks `address_problem` first
and refuses, in its own error's terms, what it says. All of them connect through
kvgraft.Client, which takes every form below, so each accepts all of them.

host:port is a host name (letters, digits, '-', '_', dot-separated labels of at most
63 characters, 253 in all), an IPv4 address, or an IPv6 address in brackets
("[::1]:50551"); the port a whole number 1..65535. The gRPC targets kvgraft.Client
takes as they are (kvgraft.client.connection.with_default_port): "unix:PATH" and
"unix-abstract:NAME" (a socket, no port), "vsock:CID:PORT", and
"dns:[//AUTHORITY/]HOST[:PORT]", "ipv4:ADDR[:PORT],..." and "ipv6:[ADDR][:PORT],...",
their hosts and ports checked as above (gRPC's own default port where none is given).
"""

from __future__ import annotations

import ipaddress
import re

MAX_HOST_CHARS = 253
TARGETS = "a gRPC target such as unix:PATH or dns:///host:port"  # as refusals name them
_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def address_problem(address: str) -> str:
    """What is wrong with `address` as a daemon's host:port or gRPC target, in a few words
    that do not quote it ("" when nothing is): the caller's message names the address."""
    scheme, _, rest = address.partition(":")
    if scheme in ("unix", "unix-abstract"):
        return "" if rest.strip("/") else f"a {scheme}: target names its socket"
    if scheme == "vsock":
        cid, _, port = rest.partition(":")
        return "" if cid.isdigit() and _is_port(port) else "a vsock: target is vsock:CID:PORT"
    if scheme == "dns":
        if rest.startswith("//"):  # dns://AUTHORITY/HOST[:PORT]; AUTHORITY may be empty
            rest = rest[2:].partition("/")[2]
        return _host_problem(rest, port_required=False)
    if scheme in ("ipv4", "ipv6"):
        problems = (_host_problem(one, port_required=False) for one in rest.split(","))
        return next((problem for problem in problems if problem), "")
    return _host_problem(address, port_required=True)


def _is_port(port: str) -> bool:
    return port.isascii() and port.isdigit() and len(port) <= 5 and 1 <= int(port) <= 65535


def _host_problem(address: str, port_required: bool) -> str:
    """What is wrong with host:port (or a host alone, where `port_required` is false)."""
    host, colon, port = address.rpartition(":")
    if not colon or (not port_required and host.startswith("[") and not host.endswith("]")):
        if port_required:
            return "it names no port"
        host, port = address, ""  # a host alone: gRPC's default port
    elif not _is_port(port):
        return "its port must be a number in 1..65535"
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return "what is in brackets is not an IPv6 address"
        return ""
    if ":" in host:
        return "an IPv6 address goes in brackets, e.g. [::1]:50551"
    labels = host.removesuffix(".").split(".")
    if not host or len(host) > MAX_HOST_CHARS or not all(map(_LABEL.fullmatch, labels)):
        return "its host is not a host name or address"
    return ""
