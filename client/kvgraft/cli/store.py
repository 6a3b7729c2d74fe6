"""The store commands of the `kvgraft` command line: info, ls, stat, rm, export, import.

    kvgraft info
    kvgraft ls [--label KEY=VALUE ...] [-a | --conversations] [-q]
    kvgraft stat ID [--manifest]
    kvgraft rm ID [ID ...]
    kvgraft export ID -o FILE.safetensors
    kvgraft import FILE.safetensors

`ls` leaves out the conversation contexts the daemon keeps by itself
(kvgraft.conversations: chat_cache and cache = auto) and says how many it left out:
they are the daemon's cache, not what a user stored; `-a/--all` lists them too,
`--conversations` only them, and a `--label` naming their kind selects them as any label
does. `-q` and `--json` list what the table would. It prints one line per artifact, each
column under a header, the labels cut to fit the terminal's width ($COLUMNS, else 160
columns when the output is not a terminal; all of them in --json and `stat`); the state
column says
pinned (with the time left of a TTL pin), shared (published) or quarantined. Where
tenants own artifacts (kvgraft.cli.tenants) an owner column comes before the labels
("-": the operator's), and the labels column leaves out the ownership labels it shows.
`stat` names the owner there too. `stat --manifest` adds the manifest: segments, the
stored receipt, token ids, every page's SHA-256. A stored receipt holds the hashes
only: the tokens reused and computed when the context was made are not kept in a
manifest (the id hashes the manifest, and it must not depend on how the context was
computed), so they are not shown.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable
from pathlib import Path

from kvgraft.cli.arguments import existing_file, output_file
from kvgraft.cli.cache import cache_lines
from kvgraft.cli.engine import receipt_detail_lines
from kvgraft.cli.render import (
    clip,
    emit,
    human_bytes,
    message_to_json,
    progress_bar,
    table,
    time_left,
    trust_name,
    when,
)
from kvgraft.cli.tenants import (
    artifact_document,
    has_owner,
    ownership_line,
    tenant_lines,
)
from kvgraft.client.client import Client
from kvgraft.conversations import KIND_LABEL, is_conversation
from kvgraft.errors import InvalidArgument, printable
from kvgraft.tenancy import content_labels, is_shared, owner_of
from kvgraft.v1 import kvgraft_pb2 as pb

# What each cache tier's row of `kvgraft info` counts.
TIER_MEANING = {
    "device": "attention-block slots, allocated whole at start; a hit is a block read found "
    "in a slot, a miss one copied into a slot (each decode step reads every block)",
    "host": "checked copies of stored pages in RAM; a hit is a page read served from RAM, a "
    "miss one read from the store on disk",
}
LS_HEADERS = ("id", "tokens", "pages", "bytes", "created (UTC)", "trust", "state", "labels")
LS_OWNER_HEADERS = (*LS_HEADERS[:-1], "owner", "labels")  # where tenants own artifacts
MIN_LABELS_WIDTH = 12  # on a narrow terminal the labels still show their start
# The line `ls` fills when its output is not a terminal (a pipe, a file) and $COLUMNS is
# unset: room for ordinary labels, not for a library entry's hundreds of characters.
UNBOUNDED_COLUMNS = 160


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
        *model_lines(info),
        f"signing key: {info.signing_key.hex()} (other daemons trust it with [trust] keys)",
        *(tenant_store_lines(info, stats) if info.tenant else store_lines(stats)),
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
    lines += tenant_lines(info)
    emit(args.json, document, "\n".join(lines))


def store_lines(stats: pb.StatsResponse) -> list[str]:
    """The whole store's figures (the operator's `kvgraft info`)."""
    return [
        f"store: artifacts {stats.artifacts}, distinct pages {stats.pages} "
        f"({human_bytes(stats.page_bytes)}), staged pages {stats.staged_pages} (of uploads "
        "not finished)",
        f"disk: {human_bytes(stats.segment_disk_bytes)} of page files, index "
        f"{human_bytes(stats.map_used_bytes)} (map {human_bytes(stats.map_size_bytes)}); "
        f"{human_bytes(stats.disk_free_bytes)} of disk free; change feed at sequence "
        f"{stats.last_sequence}",
    ]


def tenant_store_lines(info: pb.InfoResponse, stats: pb.StatsResponse) -> list[str]:
    """A tenant's own figures (kvgraftd.store.tenant_view): what its artifacts hold, what
    its budget counts and the room it leaves; the whole store's are not told to it."""
    budget = info.cache.budget_bytes
    room = (
        f"budget {human_bytes(budget)}, {human_bytes(stats.disk_free_bytes)} left"
        if budget
        else "no budget of its own (the store's holds)"
    )
    return [
        f"store: artifacts {stats.artifacts}, distinct pages {stats.pages} "
        f"({human_bytes(stats.segment_disk_bytes)} on disk)",
        f"disk: its budget counts {human_bytes(stats.page_bytes)} (a page counted in each "
        f"artifact holding it); {room}",
    ]


def model_lines(info: pb.InfoResponse) -> list[str]:
    """The served model's family, its compute profile's products and the schedules it takes."""
    if not info.model_family:
        return []
    products = info.profile.products or "torch's"
    lines = [
        f"family: {info.model_family}; products: {products}; schedule: {info.schedule} "
        "(any: every chunking and batch gives the same bits)"
    ]
    if info.chat_template == "stable":
        lines.append("chat template: stable (a conversation reuses every earlier turn)")
    elif info.chat_template:
        lines.append(f"chat template: {info.chat_template}")
    return lines


def state(info: pb.ArtifactInfo) -> str:
    """What `ls` says of an artifact's state: quarantined, or shared (published) and
    pinned (the time left of a TTL pin), or nothing."""
    if info.quarantined:
        return "quarantined"
    parts = ["shared"] if is_shared(info.labels) else []
    if info.pinned and info.pin_expires_unix_ms:
        parts.append(f"pinned, {time_left(info.pin_expires_unix_ms)} left")
    elif info.pinned:
        parts.append("pinned")
    return ", ".join(parts)


def cmd_ls(client: Client, args: argparse.Namespace) -> None:
    selector = dict(item.split("=", 1) for item in args.label)
    listed = list(client.list_artifacts(selector))
    if args.all or KIND_LABEL in selector:
        infos = listed
    else:  # --conversations: only them; by default every other artifact
        infos = [i for i in listed if is_conversation(i.labels) == args.conversations]
    hidden = len(listed) - len(infos) if not args.conversations else 0
    if args.quiet and not args.json:
        for i in infos:
            print(i.artifact_id)
        return
    owned = any(has_owner(i.labels) for i in infos)
    headers = LS_OWNER_HEADERS if owned else LS_HEADERS
    rows = [
        [
            i.artifact_id[:16],
            i.num_tokens,
            i.num_pages,
            human_bytes(i.page_bytes),
            when(i.created_unix_ms),
            trust_name(i.provenance.trust),
            state(i),
            *([owner_of(i.labels) or "-"] if owned else []),
            "",
        ]
        for i in infos
    ]
    # The labels (last) get what the other columns leave of the line; library entries'
    # labels run to hundreds of characters.
    others = table(headers[:-1], [row[:-1] for row in rows]).splitlines()
    used = max(map(len, others))
    columns = shutil.get_terminal_size((UNBOUNDED_COLUMNS, 24)).columns
    room = max(MIN_LABELS_WIDTH, columns - used - 2)
    for row, i in zip(rows, infos, strict=True):
        labels = content_labels(i.labels) if owned else i.labels
        row[-1] = clip(",".join(f"{k}={v}" for k, v in sorted(labels.items())), room)
    text = table(headers, rows) if rows else "no artifacts"
    if hidden:
        text += (
            f"\n({hidden} conversation context{'s' if hidden > 1 else ''} that chat_cache or "
            "cache = auto kept not listed: kvgraft ls --all lists them)"
        )
    emit(args.json, {"artifacts": [artifact_document(i) for i in infos]}, text)


def cmd_stat(client: Client, args: argparse.Namespace) -> None:
    response = client.stat(args.id, include_manifest=args.manifest)
    info = response.info
    document = artifact_document(info)
    if args.manifest:
        document["manifest"] = message_to_json(response.manifest)
        receipt = document["manifest"]["receipt"]
        if receipt is not None:  # not kept in a manifest: its zeros would say "none"
            del receipt["reused_tokens"], receipt["computed_tokens"]
    pin = ", pinned" if info.pinned else ""
    if info.pin_expires_unix_ms:
        pin += (
            f" until {when(info.pin_expires_unix_ms)} UTC "
            f"({time_left(info.pin_expires_unix_ms)} left), then deleted"
        )
    lines = [
        f"artifact {info.artifact_id}",
        f"tokens {info.num_tokens} in {info.num_segments} segment(s); {info.num_pages} pages, "
        f"{human_bytes(info.page_bytes)}",
        f"layout {info.layout.num_layers} layers x {info.layout.kv_heads} kv heads x "
        f"{info.layout.head_dim}, {message_to_json(info.layout)['kv_dtype']}",
        f"model {info.model_fingerprint.hex()}",
        f"created {when(info.created_unix_ms)} UTC, sequence {info.sequence}{pin}",
        f"last used {when(info.last_used_unix_ms)} UTC, {info.reused_tokens} tokens reused from it",
        trust_line(info.provenance)
        + (
            f", vouched by {info.provenance.vouched_by.hex()[:16]}"
            if info.provenance.vouched_by
            else ""
        ),
        *ownership_line(info.labels),
    ] + [f"label {printable(k)}={printable(v)}" for k, v in sorted(info.labels.items())]
    if info.quarantined:
        lines.append(
            "QUARANTINED: a read or a scrub found a page corrupt; repair it from a good copy "
            "(kvgraft replicate from a replica, or kvgraft remote sync --pull)"
        )
    if args.manifest:
        lines += manifest_lines(response.manifest)
    emit(args.json, document, "\n".join(lines))


def trust_line(provenance: pb.Provenance) -> str:
    """`stat`'s trust, with its origin where that says more ("upload", "replicated from
    HOST:PORT"; not "computed" twice)."""
    trust = trust_name(provenance.trust)
    origin = provenance.origin
    return f"trust {trust}" + (f" (origin: {origin})" if origin and origin != trust else "")


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
        lines.append("receipt (as stored: its hashes; a manifest keeps no reuse counts)")
        lines += receipt_detail_lines(manifest.receipt)
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
    output_file(args.output)  # said before the whole artifact is fetched
    total = client.stat(args.id).info.page_bytes
    bar = progress_bar(args, "export", total=total)
    try:
        full = client.export_bundle(args.id, args.output, progress=bar.update if bar else None)
    except OSError as exc:  # the disk is full, the directory not writable, ...
        raise InvalidArgument(f"cannot write {args.output}: {exc.strerror}") from None
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
    existing_file(args.file)
    bar = progress_bar(args, "import", total=args.file.stat().st_size)
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


STORE_COMMANDS: dict[str, tuple[Callable[[Client, argparse.Namespace], None], str]] = {
    "info": (cmd_info, "daemon version, model, store and tier figures"),
    "ls": (cmd_ls, "list artifacts (--all: the conversation contexts kept by chats too)"),
    "stat": (cmd_stat, "show one artifact"),
    "rm": (cmd_rm, "delete artifacts"),
}
BUNDLE_COMMANDS: dict[str, tuple[Callable[[Client, argparse.Namespace], None], str]] = {
    "export": (cmd_export, "write an artifact to a safetensors bundle"),
    "import": (cmd_import, "store the artifact of a safetensors bundle"),
}


def add_store_arguments(parsers: dict[str, argparse.ArgumentParser]) -> None:
    parsers["ls"].add_argument(
        "--label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="only artifacts with this label (repeatable)",
    )
    shown = parsers["ls"].add_mutually_exclusive_group()
    shown.add_argument(
        "-a",
        "--all",
        action="store_true",
        help="list the conversation contexts too: those the daemon keeps by itself "
        "(chat_cache, cache = auto; label kvgraft.kind=conversation), left out by default",
    )
    shown.add_argument(
        "--conversations", action="store_true", help="list only the conversation contexts"
    )
    parsers["ls"].add_argument("-q", "--quiet", action="store_true", help="print the ids only")
    parsers["stat"].add_argument("id", help="artifact id or unique prefix (8+ hex characters)")
    parsers["stat"].add_argument(
        "--manifest",
        action="store_true",
        help="show the whole manifest: segments, receipt, token ids, every page's SHA-256",
    )
    parsers["rm"].add_argument(
        "ids", nargs="+", metavar="ID", help="artifact id or unique prefix (repeatable)"
    )
    parsers["export"].add_argument("id", help="artifact id or unique prefix")
    parsers["export"].add_argument(
        "-o",
        "--output",
        type=Path,
        required=True,
        metavar="FILE.safetensors",
        help="the bundle to write (replaced if it exists)",
    )
    parsers["import"].add_argument(
        "file", type=Path, metavar="FILE.safetensors", help="a bundle written by kvgraft export"
    )
