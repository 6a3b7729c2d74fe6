"""The global options of the `kvgraft` command line, accepted before or after the command.

    kvgraft --server H:P --json ls        and        kvgraft ls --server H:P --json

are the same. The options are declared once here and added twice: to the top
parser with their defaults, and to every (sub)command with `SUPPRESS` as
default, so a value given after the command overrides the one before it and an
absent one leaves it standing. The connection flags (TLS, mutual TLS, the
bearer token) each default to their KVGRAFT_* variable (kvgraft.client.channel
resolves them), so `kvgraft --tls-ca ca.pem ls` and `KVGRAFT_TLS_CA=ca.pem
kvgraft ls` are the same. `--timeout S` is every call's deadline; without it each
kind of call keeps kvgraft.Client's default (kvgraft.client.connection).
"""

from __future__ import annotations

import argparse

from kvgraft.cli.arguments import seconds
from kvgraft.client.channel import ENVIRONMENT
from kvgraft.client.connection import (
    DEFAULT_COMPUTE_TIMEOUT_S,
    DEFAULT_PORT,
    DEFAULT_TIMEOUT_S,
    DEFAULT_TRANSFER_TIMEOUT_S,
    default_server,
)

CONNECTION_FLAGS = {
    "token_file": "file holding the daemon's bearer token",
    "tls_ca": "PEM CA bundle to verify the daemon's certificate (turns TLS on)",
    "tls_cert": "PEM client certificate, for a daemon that requires one (mutual TLS)",
    "tls_key": "PEM private key of --tls-cert",
    "tls_server_name": "name to check the daemon's certificate against (default: the host)",
}


def add_global_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """The global options; `top` gives them their defaults, elsewhere they are SUPPRESSed."""

    def default(value):
        return value if top else argparse.SUPPRESS

    group = parser.add_argument_group("global options (before or after the command)")
    group.add_argument(
        "--server",
        default=default(None),
        metavar="HOST[:PORT]",
        help=f"daemon address, port {DEFAULT_PORT} unless given ([::1] for IPv6; default "
        f"$KVGRAFT_SERVER or {default_server()})",
    )
    group.add_argument(
        "--json", action="store_true", default=default(False), help="print one JSON document"
    )
    group.add_argument(
        "--timeout",
        type=seconds,
        default=default(None),
        metavar="S",
        help=f"seconds any one call may take (default: {DEFAULT_TIMEOUT_S:g} for the store's "
        f"calls, {DEFAULT_TRANSFER_TIMEOUT_S:g} for transfers, {DEFAULT_COMPUTE_TIMEOUT_S:g} for "
        "calls that compute: deposit, generate, graft, verify, lookup, ask, library add)",
    )
    group.add_argument(
        "--tls",
        action="store_true",
        default=default(None),
        help=f"use TLS, trusting the system's CA certificates (${ENVIRONMENT['tls']}=1)",
    )
    for name, text in CONNECTION_FLAGS.items():
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=default(None),
            metavar="FILE" if name != "tls_server_name" else "NAME",
            help=f"{text} (${ENVIRONMENT[name]})",
        )


def connection_options(args: argparse.Namespace) -> dict:
    """Keyword arguments of kvgraft.Client from the parsed flags: TLS and token (None: the
    environment's) and, when --timeout was given, every kind of call's deadline."""
    options = {name: getattr(args, name) for name in ("tls", *CONNECTION_FLAGS)}
    if args.timeout is not None:
        options.update(
            timeout_s=args.timeout, compute_timeout_s=args.timeout, transfer_timeout_s=args.timeout
        )
    return options
