"""`kvgraft remote status|sync`: the daemon's remote tier (an S3 bucket shared by a fleet).

    kvgraft [--json] remote status
    kvgraft [--json] remote sync [--push | --pull]

status prints the bucket, write mode, reachability, write-back backlog,
transfer counters and the last error. sync pushes the local artifacts the
bucket lacks (the write-back queue first) and pulls the bucket's artifacts
the store lacks; --push or --pull does one direction only. With --json (the
global flag, or after the subcommand) one JSON document is printed. Exit
status 1 when an artifact could not move (the output names it and why).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvgraft.cli.render import emit, human_bytes, message_to_json
from kvgraft.client.client import Client

SYNC_TIMEOUT_S = 24 * 3600.0  # a first sync of a big store moves everything


def cmd_remote(client: Client, args: argparse.Namespace) -> None:
    ACTIONS[args.action](client, args)


def _status(client: Client, args: argparse.Namespace) -> None:
    s = client.remote_status()
    if not s.enabled:
        emit(args.json, {"enabled": False}, "no remote tier: add a [remote] section to the config")
        return
    lines = [
        f"remote tier: bucket {s.bucket} at {s.endpoint or 'AWS S3'}, prefix {s.prefix}, "
        f"write-{s.write_mode}",
        "reachable" if s.reachable else f"unreachable (next attempt in {s.retry_in_s:.0f} s)",
        f"backlog: {s.backlog_artifacts} artifacts waiting for upload",
        f"uploaded: {s.uploaded_artifacts} artifacts, {s.uploaded_pages} pages "
        f"({human_bytes(s.uploaded_bytes)})",
        f"downloaded: {s.downloaded_pages} pages ({human_bytes(s.downloaded_bytes)}); "
        f"{s.hits} hits, {s.misses} misses, {s.corrupt_objects} corrupt objects",
    ]
    if s.last_error:
        lines.append(f"last error: {s.last_error}")
    emit(args.json, message_to_json(s), "\n".join(lines))


def _sync(client: Client, args: argparse.Namespace) -> None:
    if args.timeout is None:  # a --timeout given is the user's deadline
        client.transfer_timeout_s = max(client.transfer_timeout_s, SYNC_TIMEOUT_S)
    push, pull = (not args.pull_only, not args.push_only)
    r = client.remote_sync(push=push, pull=pull)
    lines = []
    if push:
        lines.append(
            f"pushed {r.pushed_artifacts} artifacts, {r.pushed_pages} pages "
            f"({human_bytes(r.pushed_bytes)})"
        )
    if pull:
        lines.append(
            f"pulled {r.pulled_artifacts} artifacts, {r.pulled_pages} pages "
            f"({human_bytes(r.pulled_bytes)})"
        )
    lines.append(f"{r.in_both} artifacts on both sides already; backlog {r.backlog_artifacts}")
    lines += [f"failed {line}" for line in r.failures]
    emit(args.json, message_to_json(r), "\n".join(lines))
    if r.failures:
        raise SystemExit(1)


ACTIONS: dict[str, Callable[[Client, argparse.Namespace], None]] = {
    "status": _status,
    "sync": _sync,
}


def add_remote_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=sorted(ACTIONS), help="status, or sync")
    direction = parser.add_mutually_exclusive_group()
    direction.add_argument(
        "--push", dest="push_only", action="store_true", help="sync: only upload"
    )
    direction.add_argument(
        "--pull", dest="pull_only", action="store_true", help="sync: only download"
    )
