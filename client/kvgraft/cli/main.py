"""The `kvgraft` command line.

    kvgraft [GLOBAL OPTIONS] COMMAND ... [GLOBAL OPTIONS]

Commands: serve, the store's info, ls, stat, rm, pin, scrub, export, import, publish
(kvgraft.cli.store, kvgraft.cli.tenants,
kvgraft.cli.cache), replicate, remote, the engine's deposit, generate, graft, verify,
lookup (kvgraft.cli.engine), chat (kvgraft.cli.chat), and the knowledge library's
library add|ls|rm|import and ask (kvgraft.cli.library); `kvgraft COMMAND --help` for
each, `kvgraft` alone lists them.
The global options (--server, --json, --timeout, TLS and token: kvgraft.cli.options)
go before or after the command. The commands that need the daemon's model wait while
it loads, within --timeout, saying so on stderr (kvgraft.cli.model_wait). The server
defaults to $KVGRAFT_SERVER, then 127.0.0.1:50551; a host without a port gets 50551.
With --json every command prints one JSON document on stdout (an error too:
{"error": {"code", "message"}}); otherwise plain text.

Exit status: 0 success; 1 an error met doing the work (the daemon's, or kvgraft's
own: a corrupt bundle, a file that cannot be written), printed on one line on stderr
as `kvgraft: error: CODE: message`; 2 a usage error (kvgraft.cli.arguments): the
usage of the command it was made in, then one line saying what to change, on stderr,
and with --json the document {"error": {"code": "INVALID_ARGUMENT", "message"}}; 130
Ctrl-C (the call cancelled, one line; code CANCELLED with --json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from kvgraft import __version__
from kvgraft.cli.arguments import CommandParser, UsageError, check_text_values
from kvgraft.cli.cache import add_cache_arguments, cmd_pin, cmd_scrub
from kvgraft.cli.chat import CHAT_COMMANDS, add_chat_arguments
from kvgraft.cli.engine import ENGINE_COMMANDS, add_engine_arguments
from kvgraft.cli.library import LIBRARY_COMMANDS, add_library_arguments
from kvgraft.cli.options import add_global_options, connection_options
from kvgraft.cli.remote import add_remote_arguments, cmd_remote
from kvgraft.cli.replication import add_replicate_arguments, cmd_replicate
from kvgraft.cli.store import BUNDLE_COMMANDS, STORE_COMMANDS, add_store_arguments
from kvgraft.cli.tenants import add_publish_arguments, cmd_publish
from kvgraft.cli.text import TEXT_COMMANDS, add_text_arguments
from kvgraft.client.client import Client
from kvgraft.errors import KvgraftError

COMMANDS: dict[str, tuple[Callable[[Client, argparse.Namespace], None], str]] = {
    **STORE_COMMANDS,
    "pin": (cmd_pin, "pin an artifact (never deleted nor evicted; --ttl: for a while) or --off"),
    "scrub": (cmd_scrub, "recompute every stored page's SHA-256; quarantine corrupt artifacts"),
    **BUNDLE_COMMANDS,
    "publish": (cmd_publish, "let every tenant graft one of your artifacts (--withdraw: undo)"),
    "replicate": (cmd_replicate, "copy a daemon's artifacts and deletes to another (--follow)"),
    "remote": (cmd_remote, "the remote tier (S3 bucket): status, or sync (push up, pull down)"),
    **ENGINE_COMMANDS,
    **CHAT_COMMANDS,
    **LIBRARY_COMMANDS,
}


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="kvgraft", description="Byte-exact KV-cache artifacts.")
    parser.add_argument("--version", action="version", version=f"kvgraft {__version__}")
    add_global_options(parser, top=True)
    # Not required: `kvgraft` alone prints the whole help (the commands), as git does.
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # prefix_chars="+": every argument after `serve`, --flags included, belongs to
    # kvgraftd; argparse would otherwise reject them (REMAINDER skips leading options).
    serve = sub.add_parser(
        "serve",
        help="run the daemon (same as kvgraftd; kvgraft serve --help)",
        add_help=False,
        prefix_chars="+",
    )
    serve.add_argument("daemon_args", nargs=argparse.REMAINDER, help="kvgraftd's arguments")
    commands = {**COMMANDS, **TEXT_COMMANDS}
    parsers = {name: sub.add_parser(name, help=text) for name, (_, text) in commands.items()}
    for command in parsers.values():
        add_global_options(command, top=False)
        command.set_defaults(usage_parser=command)  # whose usage an error shows
    add_store_arguments(parsers)
    add_engine_arguments(parsers)
    add_chat_arguments(parsers["chat"])
    add_library_arguments(parsers)
    add_replicate_arguments(parsers["replicate"])
    add_remote_arguments(parsers["remote"])
    add_cache_arguments(parsers)
    add_publish_arguments(parsers["publish"])
    add_text_arguments(parsers)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The parsed command line; UsageError for anything it refuses."""
    args, unknown = parser.parse_known_args(argv)
    usage_parser = getattr(args, "usage_parser", parser)
    if unknown:  # a mistyped flag: show the usage of the command it was given to
        raise UsageError(f"unrecognized arguments: {' '.join(unknown)}", usage_parser)
    if args.command not in (None, "serve"):
        check_text_values(args, usage_parser)
        if any("=" not in item for item in getattr(args, "label", [])):
            raise UsageError("--label takes KEY=VALUE", usage_parser)
    return args


def _usage_failure(error: UsageError, parser: argparse.ArgumentParser, as_json: bool) -> NoReturn:
    """Report a usage error as argparse does (usage, then `PROG: error: MESSAGE` on
    stderr), with --json also as the document on stdout, and exit 2 (SystemExit, as
    argparse does, so a caller of main() sees what it always saw)."""
    if as_json:
        document = {"error": {"code": "INVALID_ARGUMENT", "message": str(error)}}
        print(json.dumps(document, indent=2), flush=True)
    shown = error.parser or parser
    shown.print_usage(sys.stderr)
    print(f"{shown.prog}: error: {error}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    as_json = "--json" in argv  # known before parsing: a refused command line has no args
    try:
        args = _parse(parser, argv)
    except UsageError as exc:
        _usage_failure(exc, parser, as_json)
    if args.command is None:
        if as_json:
            message = "give a command: kvgraft COMMAND (kvgraft --help lists them)"
            print(json.dumps({"error": {"code": "INVALID_ARGUMENT", "message": message}}, indent=2))
        parser.print_help(sys.stderr)
        raise SystemExit(2)
    if args.command == "serve":
        # The daemon is its own program; exec it rather than import it.
        os.execv(sys.executable, [sys.executable, "-m", "kvgraftd", *args.daemon_args])
    try:
        try:
            if args.command in TEXT_COMMANDS:  # offline: no daemon
                TEXT_COMMANDS[args.command][0](args)
            else:
                with Client(args.server, **connection_options(args)) as c:
                    COMMANDS[args.command][0](c, args)
        except UsageError as exc:  # found by the command itself: no prompt, ...
            _usage_failure(exc, args.usage_parser, args.json)
        except KvgraftError as exc:
            if args.json:
                print(json.dumps({"error": {"code": exc.code, "message": str(exc)}}, indent=2))
            print(f"kvgraft: error: {exc.code}: {exc}", file=sys.stderr)
            return 1
        finally:
            sys.stdout.flush()  # here, where a closed pipe can still be handled
    except BrokenPipeError:
        # The reader went away (`kvgraft ... | head`): stop quietly, as other tools do.
        # stdout is pointed at /dev/null so the interpreter's final flush cannot fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a killed writer
    except KeyboardInterrupt:
        # Ctrl-C: leaving the `with` closed the connection, which cancels the call (the
        # daemon stops its work at its next step). No traceback: one line, as for errors.
        message = "interrupted: the call was cancelled"
        if args.json:
            print(json.dumps({"error": {"code": "CANCELLED", "message": message}}, indent=2))
        print(f"kvgraft: {message}", file=sys.stderr)
        return 130  # 128 + SIGINT, what a shell reports for an interrupted command
    return 0
