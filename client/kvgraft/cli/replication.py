"""`kvgraft replicate`: make one daemon hold another's artifacts, once or continuously.

    kvgraft replicate --from A --to B [--pull | --follow] [--from-sequence N] [--workers N]

--to is required, except with --follow, where the target defaults to the
--server daemon; a source that is the target (the same daemon's instance_id in
Info, whatever the addresses) is refused. Both connections use
the same TLS and token flags.
By default the bytes pass through this process (it reads A and writes B);
with --pull, B copies straight from A (the Replicate RPC; A is then the
address as B reaches it, and B uses its own TLS and token settings).
One pass by default: a progress bar on stderr when interactive, then a
summary of artifacts (added, repaired: quarantined here and made whole, each named),
pages and bytes moved. --follow then keeps applying
the source's changes, one line per artifact, until Ctrl-C or SIGTERM, and
prints the summary. With --json the summary is one JSON document. Exit status 1 when
an artifact could not be replicated (the summary names it and why).
"""

from __future__ import annotations

import argparse
import signal
import threading

from kvgraft.cli import arguments
from kvgraft.cli.options import connection_options
from kvgraft.cli.render import emit, human_bytes, progress_bar
from kvgraft.client.client import Client
from kvgraft.client.connection import with_default_port
from kvgraft.replication.addresses import address_problem
from kvgraft.replication.replicator import Replicator
from kvgraft.replication.session import refuse_same_daemon
from kvgraft.replication.summary import ReplicationSummary
from kvgraft.replication.target import ClientTarget

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def cmd_replicate(client: Client, args: argparse.Namespace) -> None:
    if args.pull and args.follow:
        args.usage_parser.error(
            "--pull copies once; for a target that keeps following its source, give it "
            '`[replication] follow = ["ADDR"]` in its config'
        )
    if args.to is None and not args.follow:
        args.usage_parser.error(
            "give --to ADDR, the daemon to copy into (only --follow defaults it to the "
            f"--server daemon, {client.address})"
        )
    options = {"timeout_s": args.timeout, **connection_options(args)}
    if args.pull:
        with Client(args.to, **options) as target:
            _pull(target, args)
        return
    with Client(args.source, **options) as source:
        if args.to is None:
            _replicate(source, client, args)
        else:
            with Client(args.to, **options) as target:
                _replicate(source, target, args)


def _replicate(source: Client, target: Client, args: argparse.Namespace) -> None:
    refuse_same_daemon(source, target)
    bar = progress_bar(args, "replicate", total=0)

    def changed(outcome: str, artifact_id: str) -> None:
        if args.follow and not args.json:
            print(f"{outcome} {artifact_id}", flush=True)

    replicator = Replicator(
        source, ClientTarget(target), workers=args.workers, progress=bar, on_change=changed
    )
    replicator.summary.target = target.address
    try:
        if args.follow:
            # Ctrl-C or SIGTERM sets `stop`; the replicator's stream guard then cancels
            # every open stream, so the loop ends wherever the main thread is waiting
            # (a KeyboardInterrupt raised inside gRPC's stream iteration can be lost).
            stop = threading.Event()
            previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in _STOP_SIGNALS}
            try:
                replicator.follow(args.from_sequence, stop=stop)
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
        else:
            replicator.sync(args.from_sequence)
    finally:
        if bar is not None:
            bar.close()
    _report(replicator.summary, args)


def _pull(target: Client, args: argparse.Namespace) -> None:
    bar = progress_bar(args, "pull", total=0)
    try:
        summary = target.pull_from(args.source, from_sequence=args.from_sequence, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    _report(summary, args)


def _report(summary: ReplicationSummary, args: argparse.Namespace) -> None:
    """The summary (JSON with --json); exit status 1 when an artifact failed."""
    emit(args.json, summary.as_dict(), summary_text(summary))
    if summary.artifacts_failed:
        raise SystemExit(1)


def summary_text(s: ReplicationSummary) -> str:
    rate = s.bytes_moved / s.elapsed_s / 1e9 if s.elapsed_s else 0.0
    lines = [
        f"replicated {s.source} -> {s.target} in {s.elapsed_s:.1f} s",
        f"artifacts: {s.artifacts_added} added, {s.artifacts_repaired} repaired, "
        f"{s.artifacts_present} already there, {s.artifacts_deleted} deleted, "
        f"{s.deletes_kept_pinned} kept (pinned here), "
        f"{s.deletes_kept_foreign} kept (not from that source), "
        f"{s.expired_not_restored} not copied back (their pin expired here), "
        f"{s.artifacts_vanished} vanished, {s.artifacts_failed} failed",
        f"pages: {s.pages_moved} moved ({human_bytes(s.bytes_moved)}, {rate:.2f} GB/s), "
        f"{s.pages_resent} resent ({human_bytes(s.bytes_resent)}), {s.retries} retries",
        f"source feed applied up to sequence {s.last_sequence} "
        f"(continue with --from-sequence {s.last_sequence + 1})",
    ]
    lines += [f"repaired {aid}" for aid in s.repaired]
    lines += [f"failed {aid}: {why}" for aid, why in s.failures.items()]
    return "\n".join(lines)


def _address(text: str) -> str:
    """--from and --to: host[:port] (the daemon's port when none is given) or a gRPC target
    (unix:PATH, dns:///host:port), as kvgraft.Client takes them, checked before anything
    connects: gRPC would take port 99999 and reach another."""
    address = with_default_port(text)
    if problem := address_problem(address):
        raise argparse.ArgumentTypeError(f"not a daemon's host:port: {problem}")
    return address


def add_replicate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--from", dest="source", required=True, metavar="ADDR", type=_address, help="source"
    )
    parser.add_argument(
        "--to",
        default=None,
        metavar="ADDR",
        type=_address,
        help="target daemon (required, except with --follow: then the --server daemon)",
    )
    parser.add_argument(
        "--follow", action="store_true", help="keep applying the source's changes until Ctrl-C"
    )
    parser.add_argument(
        "--pull",
        action="store_true",
        help="the target copies straight from the source (the bytes skip this machine); "
        "--from is then the source's address as the target reaches it",
    )
    parser.add_argument(
        "--from-sequence",
        type=arguments.uint64,
        default=1,
        metavar="N",
        help="start in the source's change feed (default 1: all of it; anything the source "
        "holds is copied in any case, N only limits which deletes are replayed)",
    )
    parser.add_argument(
        "--workers", type=arguments.positive, default=2, help="artifacts copied at once (default 2)"
    )
