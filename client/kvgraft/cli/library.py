"""The knowledge-library commands of the `kvgraft` command line: `library add|ls|rm|import`, `ask`.

    kvgraft library add --problem TEXT --solution TEXT --answer TEXT
                        [--verified-by NAME] [--tag TAG ...]
    kvgraft library ls [--tag TAG]
    kvgraft library rm ID [ID ...]
    kvgraft library import FILE.jsonl [--tag TAG ...] [--verified-by NAME]
    kvgraft ask --text PROBLEM [--max-new-tokens N] [--library TAG] [--no-recall]

A JSON Lines import file holds one object per line: {"problem", "solution",
"answer", "verified_by", "tags"} (the last two optional; tags a list or one
string). Every line is checked before the first deposit, so a bad line
stores nothing; re-running an import skips the entries already present. A
progress bar goes to stderr when it is a terminal and --json is off.

`ask` prints the answer on stdout and what ran on stderr (path, the entry
matched or `none`, decode tokens, reused/computed tokens, wall and CPU seconds,
receipt hashes). With --json one document: answer, path (recall, generate or
library), matched_entry (an entry id, or null), decode_tokens, reused_tokens,
computed_tokens, matches_verified, verified_answer, wall_s, cpu_s, the receipt
hashes and the receipt.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from kvgraft.cli import arguments
from kvgraft.cli.arguments import is_utf8, read_text
from kvgraft.cli.model_wait import wait_for_model
from kvgraft.cli.options import add_global_options
from kvgraft.cli.render import clip, emit, human_bytes, message_to_json, progress_bar, table
from kvgraft.client.client import Client
from kvgraft.errors import InvalidArgument
from kvgraft.results import AskResult
from kvgraft.v1 import kvgraft_pb2 as pb


def _entry_json(entry: pb.LibraryEntry) -> dict:
    return message_to_json(entry)


def cmd_library_add(client: Client, args: argparse.Namespace) -> None:
    wait_for_model(client)
    response = client.library_add(
        args.problem, args.solution, args.answer, verified_by=args.verified_by, tags=args.tag
    )
    entry = response.entry
    note = "already present" if response.already_present else "deposited"
    text = f"{note} {entry.artifact_id} ({entry.num_tokens} tokens)"
    emit(args.json, message_to_json(response), text)


def cmd_library_ls(client: Client, args: argparse.Namespace) -> None:
    wait_for_model(client)
    entries = client.library_list(args.tag or "")
    rows = [
        (
            e.artifact_id[:16],
            e.num_tokens,
            ",".join(e.tags),
            e.verified_by,
            clip(e.answer, 20),
            clip(e.problem, 60),
        )
        for e in entries
    ]
    text = (
        table(("id", "tokens", "tags", "verified by", "answer", "problem"), rows)
        if rows
        else "no library entries"
    )
    emit(args.json, {"entries": [_entry_json(e) for e in entries]}, text)


def cmd_library_rm(client: Client, args: argparse.Namespace) -> None:
    wait_for_model(client)
    removed = {}
    for artifact_id in args.ids:
        response = client.library_remove(artifact_id)
        removed[response.artifact_id] = {
            "pages_freed": response.pages_freed,
            "bytes_freed": response.bytes_freed,
        }
    text = "\n".join(
        f"removed {aid[:16]}: {r['pages_freed']} pages freed ({human_bytes(r['bytes_freed'])})"
        for aid, r in removed.items()
    )
    emit(args.json, {"removed": removed}, text)


def read_jsonl(path: Path, tags: list[str], verified_by: str) -> list[dict]:
    """The entries of a JSON Lines file, every line checked (blank lines skipped): a file
    that is not UTF-8 text is a usage error, a line that is not an entry InvalidArgument."""
    entries = []
    for number, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise InvalidArgument(f"{path}:{number}: expected an object")
        entry = {}
        for name in ("problem", "solution", "answer"):
            value = item.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                value = str(value)
            if not isinstance(value, str) or not value.strip():
                raise InvalidArgument(f"{path}:{number}: {name!r} must be a non-empty string")
            entry[name] = value
        line_tags = item.get("tags", [])
        if isinstance(line_tags, str):
            line_tags = [line_tags]
        if not isinstance(line_tags, list) or not all(isinstance(t, str) for t in line_tags):
            raise InvalidArgument(f"{path}:{number}: 'tags' must be a string or list of strings")
        by = item.get("verified_by", verified_by)
        if not isinstance(by, str):
            raise InvalidArgument(f"{path}:{number}: 'verified_by' must be a string")
        entry["tags"] = sorted(set(line_tags) | set(tags))
        entry["verified_by"] = by
        # JSON's \ud800 escapes decode to lone surrogates, which no protobuf string carries
        for name, value in entry.items():
            if not all(map(is_utf8, [value] if isinstance(value, str) else value)):
                raise InvalidArgument(f"{path}:{number}: {name!r} is not UTF-8 text")
        entries.append(entry)
    return entries


def cmd_library_import(client: Client, args: argparse.Namespace) -> None:
    entries = read_jsonl(args.file, args.tag, args.verified_by)
    wait_for_model(client)
    bar = progress_bar(args, "import", total=len(entries), unit="entry")
    ids, present = [], 0
    try:
        for entry in entries:
            response = client.library_add(
                entry["problem"],
                entry["solution"],
                entry["answer"],
                verified_by=entry["verified_by"],
                tags=entry["tags"],
            )
            ids.append(response.entry.artifact_id)
            present += response.already_present
            if bar:
                bar.update(1)
    finally:
        if bar:
            bar.close()
    document = {
        "file": str(args.file),
        "entries": ids,
        "added": len(ids) - present,
        "already_present": present,
    }
    text = f"imported {len(ids)} entries from {args.file}: {len(ids) - present} added, "
    text += f"{present} already present"
    emit(args.json, document, text)


LIBRARY_ACTIONS: dict[str, tuple[Callable[[Client, argparse.Namespace], None], str]] = {
    "add": (cmd_library_add, "deposit a verified solution"),
    "ls": (cmd_library_ls, "list the library entries"),
    "rm": (cmd_library_rm, "remove library entries"),
    "import": (cmd_library_import, "deposit every entry of a JSON Lines file"),
}


def cmd_library(client: Client, args: argparse.Namespace) -> None:
    handler, _ = LIBRARY_ACTIONS[args.library_command]
    handler(client, args)


# ----------------------------------------------------------------------
def ask_document(response: AskResult) -> dict:
    """The --json document of `ask`."""
    receipt = response.receipt
    return {
        "answer": response.answer,
        "path": response.path,
        "matched_entry": response.matched_entry,  # null when none matched
        "decode_tokens": response.decode_tokens,
        "reused_tokens": response.reused_tokens,
        "computed_tokens": response.computed_tokens,
        "matches_verified": response.matches_verified,
        "verified_answer": response.verified_answer,
        "library_artifact_id": response.library_artifact_id,
        "library_built": response.library_built,
        "wall_s": response.wall_s,
        "cpu_s": response.cpu_s,
        "input_sha256": receipt.input_sha256.hex(),
        "prompt_logits_sha256": receipt.prompt_logits_sha256.hex(),
        "generated_logits_sha256": receipt.generated_logits_sha256.hex(),
        "receipt": message_to_json(receipt.raw),
    }


def cmd_ask(client: Client, args: argparse.Namespace) -> None:
    wait_for_model(client)
    response = client.ask(
        args.text,
        max_new_tokens=args.max_new_tokens,
        library_tag=args.library or "",
        no_recall=args.no_recall,
    )
    document = ask_document(response)
    if args.json:
        emit(True, document, "")
        return
    print(response.answer, flush=True)
    lines = [f"path: {response.path}, matched_entry: {response.matched_entry or 'none'}"]
    if response.matched_entry:
        verdict = "matches" if response.matches_verified else "DIFFERS FROM"
        lines.append(f"the answer {verdict} the verified answer {response.verified_answer!r}")
    if response.library_artifact_id:
        built = " (built by this call)" if response.library_built else ""
        lines.append(f"library context {response.library_artifact_id[:16]}{built}")
    lines += [
        f"decode tokens {response.decode_tokens}; reused {response.reused_tokens} tokens, "
        f"computed {response.computed_tokens}",
        f"wall {response.wall_s:.3f} s, cpu {response.cpu_s:.3f} s (whole daemon process)",
        f"input_sha256            {document['input_sha256']}",
        f"prompt_logits_sha256    {document['prompt_logits_sha256']}",
        f"generated_logits_sha256 {document['generated_logits_sha256']}",
    ]
    print("\n".join(lines), file=sys.stderr, flush=True)


LIBRARY_COMMANDS: dict[str, tuple[Callable[[Client, argparse.Namespace], None], str]] = {
    "library": (cmd_library, "the knowledge library: add, ls, rm, import verified solutions"),
    "ask": (cmd_ask, "answer a problem: recall from the library, or generate"),
}


def add_library_arguments(parsers: dict[str, argparse.ArgumentParser]) -> None:
    # The actions as the metavar: `kvgraft library` alone then names them.
    actions_metavar = "{" + ",".join(LIBRARY_ACTIONS) + "}"
    sub = parsers["library"].add_subparsers(
        dest="library_command", required=True, metavar=actions_metavar
    )
    actions = {name: sub.add_parser(name, help=text) for name, (_, text) in LIBRARY_ACTIONS.items()}
    for action in actions.values():
        add_global_options(action, top=False)
        action.set_defaults(usage_parser=action)
    add = actions["add"]
    add.add_argument("--problem", required=True, help="the problem, as it will be asked")
    add.add_argument("--solution", required=True, help="the verified solution")
    add.add_argument("--answer", required=True, help="the verified final answer (one line)")
    for name in ("add", "import"):
        actions[name].add_argument(
            "--verified-by", default="", metavar="NAME", help="who or what verified it"
        )
        actions[name].add_argument(
            "--tag", action="append", default=[], metavar="TAG", help="tag (repeatable)"
        )
    actions["ls"].add_argument("--tag", default="", metavar="TAG", help="only this tag")
    actions["rm"].add_argument("ids", nargs="+", metavar="ID", help="entry id or unique prefix")
    actions["import"].add_argument(
        "file",
        type=Path,
        metavar="FILE.jsonl",
        help='one entry a line: {"problem", "solution", "answer", "verified_by", "tags"}',
    )
    ask = parsers["ask"]
    ask.add_argument("--text", required=True, help="the problem")
    ask.add_argument(
        "--max-new-tokens",
        type=arguments.uint32,
        default=256,
        metavar="N",
        help="generation budget (default 256)",
    )
    ask.add_argument("--library", metavar="TAG", help="graft the library of TAG as context")
    ask.add_argument("--no-recall", action="store_true", help="always generate")
