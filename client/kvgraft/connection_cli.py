"""The connection flags of the `kvgraft` command line: TLS, mutual TLS and the bearer token.

Each flag defaults to its KVGRAFT_* variable (kvgraft.channel resolves them),
so `kvgraft --tls-ca ca.pem --token-file token ls` and
`KVGRAFT_TLS_CA=ca.pem KVGRAFT_TOKEN_FILE=token kvgraft ls` are the same.
"""

from __future__ import annotations

import argparse

from kvgraft.channel import ENVIRONMENT

FLAGS = {
    "token_file": "file holding the daemon's bearer token",
    "tls_ca": "PEM CA bundle to verify the daemon's certificate (turns TLS on)",
    "tls_cert": "PEM client certificate, for a daemon that requires one (mutual TLS)",
    "tls_key": "PEM private key of --tls-cert",
    "tls_server_name": "name to check the daemon's certificate against (default: the host)",
}


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection (each defaults to its environment variable)")
    group.add_argument(
        "--tls",
        action="store_true",
        default=None,
        help=f"use TLS, trusting the system's CA certificates (${ENVIRONMENT['tls']}=1)",
    )
    for name, text in FLAGS.items():
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=None,
            metavar="FILE" if name != "tls_server_name" else "NAME",
            help=f"{text} (${ENVIRONMENT[name]})",
        )


def connection_options(args: argparse.Namespace) -> dict:
    """Keyword arguments of kvgraft.Client from the parsed flags (None: the environment's)."""
    return {name: getattr(args, name) for name in ("tls", *FLAGS)}
