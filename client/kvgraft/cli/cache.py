"""`kvgraft pin` and `kvgraft scrub`, and what `kvgraft info` says of the store as a cache.

    kvgraft [--json] pin ID [--ttl 2h | --off]
    kvgraft [--json] scrub [--rate 200MB]

pin keeps an artifact from deletion and eviction; with --ttl the pin expires
after that long (s, m, h or d) and the artifact is then deleted. scrub recomputes
the SHA-256 of every stored page at most --rate bytes a second (the daemon's
scrub_bytes_per_s by default), with a progress bar, and lists the corrupt pages
and the artifacts it quarantined; exit status 1 when it found any.
"""

from __future__ import annotations

import argparse
import re

from kvgraft.cli.arguments import UINT64_MAX, UsageError
from kvgraft.cli.render import emit, human_bytes, message_to_json, progress_bar, when
from kvgraft.client.client import Client
from kvgraft.v1 import kvgraft_pb2 as pb

MAX_TTL_S = 10 * 365 * 86400  # the daemon's longest TTL (kvgraftd.store.service)
SCRUB_TIMEOUT_S = 24 * 3600.0  # without --timeout; the daemon's scrub goes on regardless
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Seconds in "90", "90s", "15m", "2h" or "7d", up to a pin's longest (ten years)."""
    match = _DURATION.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: give e.g. 90s, 15m, 2h, 7d")
    seconds = float(match.group(1)) * _SECONDS[match.group(2)]
    if seconds > MAX_TTL_S:
        raise argparse.ArgumentTypeError(f"{text!r} is too long: a pin's TTL is at most 3650d")
    return seconds


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_rate(text: str) -> int:
    """Bytes a second in "200MB", "1GiB", "50000000"."""
    match = _SIZE.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give e.g. 200MB or 1GiB")
    unit = (match.group(2) or "b").lower().rstrip("b")
    power = "kmgt".index(unit[0]) + 1 if unit else 0
    rate = int(float(match.group(1)) * (1024 if unit.endswith("i") else 1000) ** power)
    if rate > UINT64_MAX:  # protobuf would refuse it with a traceback
        raise argparse.ArgumentTypeError(f"{text!r} is too large: give e.g. 200MB or 1GiB")
    return rate


def cmd_pin(client: Client, args: argparse.Namespace) -> None:
    if args.off and args.ttl:
        raise UsageError("--ttl goes with a pin: give --off or --ttl, not both")
    info = client.pin(args.id, pinned=not args.off, ttl_s=args.ttl or 0)
    state = "pinned" if info.pinned else "unpinned"
    until = f" until {when(info.pin_expires_unix_ms)} UTC, then deleted" if args.ttl else ""
    emit(args.json, message_to_json(info), f"{state} {info.artifact_id}{until}")


def cmd_scrub(client: Client, args: argparse.Namespace) -> None:
    if args.timeout is None:  # at --rate, a big store takes hours: follow it to the end
        client.transfer_timeout_s = max(client.transfer_timeout_s, SCRUB_TIMEOUT_S)
    bar = progress_bar(args, "scrub")
    try:
        result = client.scrub(bytes_per_s=args.rate or 0, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    lines = [
        f"scrubbed {result.pages_done} pages ({human_bytes(result.bytes_done)}): "
        f"{result.corrupt_count} corrupt, {result.quarantined_count} artifacts quarantined"
    ]
    lines += [f"corrupt page {digest}" for digest in result.corrupt_pages]
    lines += [
        f"quarantined {aid} (repair it: kvgraft replicate from a replica)"
        for aid in result.quarantined
    ]
    emit(args.json, message_to_json(result), "\n".join(lines))
    if result.corrupt_count:
        raise SystemExit(1)


def cache_lines(info: pb.InfoResponse) -> list[str]:
    """`kvgraft info`'s lines on the budget, eviction, automatic deposits and scrubs."""
    cache, scrub = info.cache, info.scrub
    budgets = [f"{human_bytes(cache.budget_bytes)}" if cache.budget_bytes else ""]
    budgets += [f"{cache.budget_artifacts} artifacts" if cache.budget_artifacts else ""]
    budget = ", ".join(b for b in budgets if b) or "none"
    lines = [
        f"cache: budget {budget}, {cache.policy} eviction, deposits {cache.mode}; evicted "
        f"{cache.evicted_artifacts} artifacts ({human_bytes(cache.evicted_bytes)}), expired "
        f"{cache.expired_artifacts}, kept automatically {cache.auto_deposits} (skipped "
        f"{cache.auto_deposits_skipped}), quarantined {cache.quarantined_artifacts}"
    ]
    if scrub.started_unix_ms:
        state = "running" if scrub.running else f"finished {when(scrub.finished_unix_ms)} UTC"
        lines.append(
            f"scrub: {state}, {scrub.pages_done} of {scrub.pages_total} pages, "
            f"{scrub.corrupt_count} corrupt"
        )
    else:
        lines.append("scrub: none since the daemon started")
    return lines


def add_cache_arguments(parsers: dict[str, argparse.ArgumentParser]) -> None:
    pin = parsers["pin"]
    pin.add_argument("id", help="artifact id or unique prefix")
    pin.add_argument("--off", action="store_true", help="unpin")
    pin.add_argument(
        "--ttl",
        type=parse_duration,
        default=0,
        metavar="DURATION",
        help="the pin expires after this long (90s, 15m, 2h, 7d); then the artifact is deleted",
    )
    parsers["scrub"].add_argument(
        "--rate",
        type=parse_rate,
        default=0,
        metavar="BYTES",
        help="read at most this many bytes a second (default: the daemon's scrub_bytes_per_s)",
    )
