"""The global options of the `kvgraft` command line, accepted before or after the command.

    kvgraft --server H:P --json ls        and        kvgraft ls --server H:P --json

are the same. The options are declared once here and added twice: to the top
parser with their defaults, and to every (sub)command with `SUPPRESS` as
default, so a value given after the command overrides the one before it and an
absent one leaves it standing. The connection flags (TLS, mutual TLS, the
bearer token) each default to their KVGRAFT_* variable (kvgraft.client.channel
resolves them), so `kvgraft --tls-ca ca.pem ls` and `KVGRAFT_TLS_CA=ca.pem
kvgraft ls` are the same. `--timeout S` is every call's deadline; without it each
kind of call keeps kvgraft.Client's default (kvgraft.client.connection), and it bounds a
command's wait for the daemon's model to load (kvgraft.cli.model_wait).

The decoding options that generate, graft and chat share are declared here too:
greedy (argmax) unless told otherwise; --temperature T samples at T (0: greedy, as in
OpenAI's API), --sample alone at 1.0, --seed N picks the samples, --top-p and --top-k
narrow them, --stop TEXT (repeatable) ends the answer before TEXT. Flags that
contradict, or would be ignored, are usage errors.
"""

from __future__ import annotations

import argparse

from kvgraft.cli.arguments import UsageError, seconds, temperature, top_p, uint32, uint64
from kvgraft.client.channel import ENVIRONMENT
from kvgraft.client.connection import (
    DEFAULT_COMPUTE_TIMEOUT_S,
    DEFAULT_PORT,
    DEFAULT_TIMEOUT_S,
    DEFAULT_TRANSFER_TIMEOUT_S,
    default_server,
)

CONNECTION_FLAGS = {
    "token_file": "file holding the bearer token (a tenant's: act as that tenant)",
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
        "calls that compute: deposit, generate, graft, verify, lookup, ask, library add, and "
        "their wait for the model to load)",
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


def add_decoding_options(parser: argparse.ArgumentParser) -> None:
    """How a command that generates chooses its tokens, and where it stops."""
    parser.add_argument(
        "--sample", action="store_true", help="sample instead of argmax (at temperature 1.0)"
    )
    parser.add_argument(
        "--temperature",
        type=temperature,
        metavar="T",
        help="sample at this temperature (no --sample needed); 0: greedy decoding",
    )
    parser.add_argument(
        "--seed",
        type=uint64,
        metavar="N",
        help="sampling seed: the same seed, the same tokens (default 0)",
    )
    parser.add_argument(
        "--top-p",
        type=top_p,
        metavar="P",
        help="when sampling: only the likeliest tokens whose probabilities add up to P "
        "(0 < P <= 1; default 1: all)",
    )
    parser.add_argument(
        "--top-k",
        type=uint32,
        metavar="K",
        help="when sampling: only the K likeliest tokens (default 0: all)",
    )
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end the answer before TEXT (repeatable, at most 4, 1-256 characters each; "
        "a newline: --stop $'\\n' in bash)",
    )


def decoding_options(args: argparse.Namespace) -> dict:
    """The decoding options of kvgraft.Client's generate from the decoding flags: a
    temperature samples at it (0: greedy), --sample alone at 1.0; --seed, --top-p and
    --top-k without sampling would be ignored, so they are usage errors."""
    temperature, sampling = args.temperature, args.sample
    if temperature == 0 and sampling:
        raise UsageError(
            "--sample with --temperature 0: a temperature of 0 is greedy decoding; "
            "leave out --sample, or give a temperature above 0"
        )
    sampling = sampling or bool(temperature)
    if args.seed is not None and not sampling:
        raise UsageError("--seed picks the samples: add --sample or --temperature T")
    narrowed = {"--top-p": args.top_p, "--top-k": args.top_k}
    narrowing = [flag for flag, value in narrowed.items() if value]
    if narrowing and not sampling:
        verb = "chooses" if len(narrowing) == 1 else "choose"
        raise UsageError(
            f"{' and '.join(narrowing)} {verb} among samples: add --sample or --temperature T"
        )
    stop = {"stop": args.stop} if args.stop else {}
    if not sampling:
        return {**stop} if temperature is None else {"temperature": 0.0, **stop}  # greedy
    narrow = {"top_p": args.top_p, "top_k": args.top_k}
    return {
        "temperature": temperature or 1.0,
        "seed": args.seed or 0,
        **{name: value for name, value in narrow.items() if value},
        **stop,
    }
