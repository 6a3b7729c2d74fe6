"""What a replication source or target may be called: host:port, checked where it enters.

A source enters through the Replicate RPC (kvgraftd.replication.pulls), the daemon's
configuration (`[replication] follow` and `pull_from`) and the command line
(`kvgraft replicate --from/--to`). gRPC takes any text as a target and makes the best
of it (port 99999 reached another port), so each of those asks `address_problem` first
and refuses, in its own error's terms, what it says.

host:port is a host name (letters, digits, '-', '_', dot-separated labels of at most
63 characters, 253 in all), an IPv4 address, or an IPv6 address in brackets
("[::1]:50551"); the port a whole number 1..65535.
"""

from __future__ import annotations

import ipaddress
import re

MAX_HOST_CHARS = 253
_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def address_problem(address: str) -> str:
    """What is wrong with `address` as a daemon's host:port, in a few words that do not
    quote it ("" when nothing is): the caller's message names the address."""
    host, colon, port = address.rpartition(":")
    if not colon:
        return "it names no port"
    if not (port.isascii() and port.isdigit() and len(port) <= 5 and 1 <= int(port) <= 65535):
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
