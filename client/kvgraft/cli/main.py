"""The `kvgraft` command line.

    kvgraft [GLOBAL OPTIONS] COMMAND ... [GLOBAL OPTIONS]

Commands: serve, info, ls, stat, rm, pin, export, import, replicate, remote, and the
engine's deposit, generate, graft, verify, lookup, and the knowledge library's
library add|ls|rm|import and ask (`kvgraft COMMAND --help`).
The global options (--server, --json, --timeout, TLS and token: kvgraft.cli.options)
go before or after the command. The server defaults to $KVGRAFT_SERVER, then
127.0.0.1:50551. With --json every command prints one JSON document on stdout
(an error from the daemon too: {"error": {"code", "message"}}); otherwise plain
text. A usage error shows the usage of the command it was made in (plain text).
Exit status: 0 success, 1 an error from kvgraft, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from kvgraft import __version__
from kvgraft.cli.cache import add_cache_arguments, cache_lines, cmd_pin, cmd_scrub
from kvgraft.cli.engine import ENGINE_COMMANDS, add_engine_arguments, receipt_lines
from kvgraft.cli.library import LIBRARY_COMMANDS, add_library_arguments
from kvgraft.cli.options import add_global_options, connection_options
from kvgraft.cli.remote import add_remote_arguments, cmd_remote
from kvgraft.cli.render import emit, human_bytes, message_to_json, table, when
from kvgraft.cli.replication import add_replicate_arguments, cmd_replicate
from kvgraft.client.client import Client
from kvgraft.errors import InvalidArgument, KvgraftError
from kvgraft.v1 import kvgraft_pb2 as pb


def _progress(args: argparse.Namespace, total: int, description: str):
    """A tqdm bar on stderr for interactive use; None when scripted."""
    if args.json or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=description, file=sys.stderr)


# ----------------------------------------------------------------------
def cmd_info(client: Client, args: argparse.Namespace) -> None:
    info, stats = client.info(), client.stats()
    document = {
        "server": client.address,
        "info": message_to_json(info),
        "stats": message_to_json(stats),
    }
    lines = [
        f"kvgraftd {info.version} at {client.address} (store format {info.store_format_version})",
        f"model: {info.model_name or '-'} ({info.model_state})"
        + (f", fingerprint {info.model_fingerprint.hex()[:16]}" if info.model_fingerprint else ""),
        f"signing key: {info.signing_key.hex()} (other daemons trust it with [trust] keys)",
        f"store: artifacts {stats.artifacts}, distinct pages {stats.pages} "
        f"({human_bytes(stats.page_bytes)}), staged pages {stats.staged_pages} (of uploads "
        "not finished)",
        f"disk: {human_bytes(stats.segment_disk_bytes)} of page files, index "
        f"{human_bytes(stats.map_used_bytes)} (map {human_bytes(stats.map_size_bytes)}); "
        f"{human_bytes(stats.disk_free_bytes)} of disk free; change feed at sequence "
        f"{stats.last_sequence}",
    ]
    caches = [t for t in info.tiers if t.name in TIER_MEANING]
    if caches:
        rows = [
            (
                t.name,
                human_bytes(t.holding_bytes),
                human_bytes(t.used_bytes),
                human_bytes(t.capacity_bytes) if t.capacity_bytes else "unbounded",
                t.hits,
                t.misses,
            )
            for t in caches
        ]
        lines.append(table(("cache", "holding", "allocated", "budget", "hits", "misses"), rows))
        lines += [f"{t.name}: {TIER_MEANING[t.name]}" for t in caches]
    lines += cache_lines(info)
    emit(args.json, document, "\n".join(lines))


TRUST_NAMES = {
    pb.Provenance.TRUST_COMPUTED: "computed",
    pb.Provenance.TRUST_VERIFIED: "verified",
    pb.Provenance.TRUST_SIGNED: "signed",
    pb.Provenance.TRUST_UNTRUSTED: "untrusted",
}

# What each cache tier's row of `kvgraft info` counts.
TIER_MEANING = {
    "device": "attention-block slots, allocated whole at start; a hit is a block read found "
    "in a slot, a miss one copied into a slot (each decode step reads every block)",
    "host": "checked copies of stored pages in RAM; a hit is a page read served from RAM, a "
    "miss one read from the store on disk",
}


def cmd_ls(client: Client, args: argparse.Namespace) -> None:
    selector = dict(item.split("=", 1) for item in args.label)
    infos = list(client.list_artifacts(selector))
    if args.quiet and not args.json:
        for i in infos:
            print(i.artifact_id)
        return
    rows = [
        (
            i.artifact_id[:16],
            i.num_tokens,
            i.num_pages,
            human_bytes(i.page_bytes),
            when(i.created_unix_ms),
            TRUST_NAMES.get(i.provenance.trust, "untrusted"),
            "quarantined" if i.quarantined else ("pinned" if i.pinned else ""),
            ",".join(f"{k}={v}" for k, v in sorted(i.labels.items())),
        )
        for i in infos
    ]
    text = (
        table(("id", "tokens", "pages", "bytes", "created (UTC)", "trust", "", "labels"), rows)
        if rows
        else "no artifacts"
    )
    emit(args.json, {"artifacts": [message_to_json(i) for i in infos]}, text)


def cmd_stat(client: Client, args: argparse.Namespace) -> None:
    response = client.stat(args.id, include_manifest=args.manifest)
    info = response.info
    document = message_to_json(info)
    if args.manifest:
        document["manifest"] = message_to_json(response.manifest)
    lines = [
        f"artifact {info.artifact_id}",
        f"tokens {info.num_tokens} in {info.num_segments} segment(s); {info.num_pages} pages, "
        f"{human_bytes(info.page_bytes)}",
        f"layout {info.layout.num_layers} layers x {info.layout.kv_heads} kv heads x "
        f"{info.layout.head_dim}, {message_to_json(info.layout)['kv_dtype']}",
        f"model {info.model_fingerprint.hex()}",
        f"created {when(info.created_unix_ms)} UTC, sequence {info.sequence}"
        + (", pinned" if info.pinned else "")
        + (f" until {when(info.pin_expires_unix_ms)} UTC" if info.pin_expires_unix_ms else ""),
        f"last used {when(info.last_used_unix_ms)} UTC, {info.reused_tokens} tokens reused from it",
        f"trust {TRUST_NAMES.get(info.provenance.trust, 'untrusted')} ({info.provenance.origin})"
        + (
            f", vouched by {info.provenance.vouched_by.hex()[:16]}"
            if info.provenance.vouched_by
            else ""
        ),
    ] + [f"label {k}={v}" for k, v in sorted(info.labels.items())]
    if info.quarantined:
        lines.append("QUARANTINED: a scrub found a page corrupt; repair it from a good copy")
    if args.manifest:
        lines += manifest_lines(response.manifest)
    emit(args.json, document, "\n".join(lines))


def manifest_lines(manifest: pb.Manifest) -> list[str]:
    """The rest of a manifest, for `stat --manifest`: what `stat` alone does not show."""
    profile = manifest.profile
    layers = manifest.layout.num_layers or 1
    lines = [
        f"format version {manifest.format_version}",
        f"profile torch {profile.torch_version}, {profile.device_kind} {profile.device_name}, "
        f"{profile.compute_dtype}, {profile.attention}, page_tokens {profile.page_tokens}",
        "segment ends " + " ".join(map(str, manifest.segment_ends)),
        "token ids " + " ".join(map(str, manifest.token_ids)),
    ]
    if manifest.HasField("receipt"):
        lines += receipt_lines(manifest.receipt)
    lines.append(f"pages ({len(manifest.page_sha256)}: page x layer, SHA-256)")
    lines += [
        f"  {index // layers:>5} {index % layers:>3}  {digest.hex()}"
        for index, digest in enumerate(manifest.page_sha256)
    ]
    return lines


def cmd_rm(client: Client, args: argparse.Namespace) -> None:
    results = {}
    for artifact_id in args.ids:
        full = client.stat(artifact_id).info.artifact_id
        results[full] = message_to_json(client.delete(full))
    text = "\n".join(
        f"deleted {aid[:16]}: {r['pages_freed']} pages freed ({human_bytes(r['bytes_freed'])})"
        for aid, r in results.items()
    )
    emit(args.json, {"deleted": results}, text)


def cmd_export(client: Client, args: argparse.Namespace) -> None:
    if not args.output.parent.is_dir():  # say so before fetching the whole artifact
        raise InvalidArgument(
            f"cannot write {args.output}: {args.output.parent} is not a directory"
        )
    total = client.stat(args.id).info.page_bytes
    bar = _progress(args, total, "export")
    try:
        full = client.export_bundle(args.id, args.output, progress=bar.update if bar else None)
    finally:
        if bar:
            bar.close()
    size = args.output.stat().st_size
    emit(
        args.json,
        {"artifact_id": full, "path": str(args.output), "bytes": size},
        f"exported {full[:16]} to {args.output} ({human_bytes(size)})",
    )


def cmd_import(client: Client, args: argparse.Namespace) -> None:
    if not args.file.is_file():
        raise InvalidArgument(f"{args.file} does not exist or is not a file")
    bar = _progress(args, args.file.stat().st_size, "import")
    try:
        response = client.import_bundle(args.file, progress=bar.update if bar else None)
    finally:
        if bar:
            bar.close()
    note = " (already present)" if response.already_present else ""
    emit(
        args.json,
        message_to_json(response),
        f"imported {response.artifact_id}{note}: {response.pages_written} pages written "
        f"({human_bytes(response.bytes_written)})",
    )


COMMANDS: dict[str, tuple[Callable[[Client, argparse.Namespace], None], str]] = {
    "info": (cmd_info, "daemon version, model, store and tier figures"),
    "ls": (cmd_ls, "list artifacts"),
    "stat": (cmd_stat, "show one artifact"),
    "rm": (cmd_rm, "delete artifacts"),
    "pin": (cmd_pin, "pin an artifact (never deleted nor evicted; --ttl: for a while) or --off"),
    "scrub": (cmd_scrub, "recompute every stored page's SHA-256; quarantine corrupt artifacts"),
    "export": (cmd_export, "write an artifact to a safetensors bundle"),
    "import": (cmd_import, "store the artifact of a safetensors bundle"),
    "replicate": (cmd_replicate, "copy a daemon's artifacts and deletes to another (--follow)"),
    "remote": (cmd_remote, "the remote tier (S3 bucket): status, or sync (push up, pull down)"),
    **ENGINE_COMMANDS,
    **LIBRARY_COMMANDS,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgraft", description="Byte-exact KV-cache artifacts.")
    parser.add_argument("--version", action="version", version=f"kvgraft {__version__}")
    add_global_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # prefix_chars="+": every argument after `serve`, --flags included, belongs to
    # kvgraftd; argparse would otherwise reject them (REMAINDER skips leading options).
    serve = sub.add_parser(
        "serve",
        help="run the daemon (same as kvgraftd; kvgraft serve --help)",
        add_help=False,
        prefix_chars="+",
    )
    serve.add_argument("daemon_args", nargs=argparse.REMAINDER)
    parsers = {name: sub.add_parser(name, help=text) for name, (_, text) in COMMANDS.items()}
    for command in parsers.values():
        add_global_options(command, top=False)
        command.set_defaults(usage_parser=command)  # whose usage an error shows
    parsers["ls"].add_argument(
        "--label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="only artifacts with this label (repeatable)",
    )
    parsers["ls"].add_argument("-q", "--quiet", action="store_true", help="print the ids only")
    parsers["stat"].add_argument("id", help="artifact id or unique prefix (8+ hex characters)")
    parsers["stat"].add_argument(
        "--manifest",
        action="store_true",
        help="show the whole manifest: segments, receipt, token ids, every page's SHA-256",
    )
    parsers["rm"].add_argument("ids", nargs="+", metavar="ID")
    parsers["export"].add_argument("id")
    parsers["export"].add_argument(
        "-o", "--output", type=Path, required=True, metavar="FILE.safetensors"
    )
    parsers["import"].add_argument("file", type=Path, metavar="FILE.safetensors")
    add_engine_arguments(parsers)
    add_library_arguments(parsers)
    add_replicate_arguments(parsers["replicate"])
    add_remote_arguments(parsers["remote"])
    add_cache_arguments(parsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # a mistyped flag: show the usage of the command it was given to
        getattr(args, "usage_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "serve":
        # The daemon is its own program; exec it rather than import it.
        os.execv(sys.executable, [sys.executable, "-m", "kvgraftd", *args.daemon_args])
    if any("=" not in item for item in getattr(args, "label", [])):
        args.usage_parser.error("--label takes KEY=VALUE")
    handler, _ = COMMANDS[args.command]
    try:
        try:
            with Client(args.server, timeout_s=args.timeout, **connection_options(args)) as c:
                handler(c, args)
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
    return 0
