"""The engine commands of the `kvgraft` command line: deposit, generate, graft, verify, lookup.

Prompts are given as --text (tokenized by the daemon's model; --chat wraps
it in the model's chat template), --file (text read from a file; with --text
too, the file's text, a blank line, then --text) or --tokens 1,2,3.
Generated text streams to stdout as it arrives, then a newline; the receipt
follows on stderr, its first line the tokens reused and computed and the
seconds the call took. With --json one document is printed: the receipt's
fields at the top level (hashes in hex), plus `text`, `deposited_artifact_id`
and `elapsed_s`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvgraft.cli.render import emit, message_to_json
from kvgraft.client.client import Client
from kvgraft.client.engine_calls import DEFAULT_MAX_NEW_TOKENS
from kvgraft.errors import InvalidArgument, KvgraftError
from kvgraft.results import GenerationStream
from kvgraft.v1 import kvgraft_pb2 as pb


def _prompt_kwargs(args: argparse.Namespace) -> dict:
    file_text = None
    if args.file is not None:
        if not args.file.is_file():
            raise InvalidArgument(f"{args.file} does not exist or is not a file")
        file_text = args.file.read_text(encoding="utf-8").strip()
    if args.tokens is not None:
        if args.text is not None or file_text is not None:
            raise InvalidArgument("give --tokens, or text (--text and/or --file), not both")
        try:
            ids = [int(t) for t in args.tokens.replace(",", " ").split()]
        except ValueError:
            raise InvalidArgument("--tokens takes integers separated by commas") from None
        return {"token_ids": ids, "chat": args.chat}
    parts = [part for part in (file_text, args.text) if part is not None]
    if not parts:
        raise InvalidArgument("give the prompt: --text, --file or --tokens")
    return {"text": "\n\n".join(parts), "chat": args.chat}


def _labels(args: argparse.Namespace) -> dict[str, str]:
    if any("=" not in item for item in args.label):
        raise InvalidArgument("--label takes KEY=VALUE")
    return dict(item.split("=", 1) for item in args.label)


def _options(args: argparse.Namespace) -> dict:
    options = {
        "max_new_tokens": args.max_new_tokens,
        "no_cache": args.no_cache,
        "deposit": args.deposit,
        "labels": _labels(args),
    }
    if args.sample:
        options.update(greedy=False, temperature=args.temperature, seed=args.seed)
    if getattr(args, "allow_untrusted", False):
        options["allow_untrusted"] = True
    return options


def receipt_lines(receipt: pb.Receipt, elapsed_s: float | None = None) -> list[str]:
    took = f" in {elapsed_s:.2f} s" if elapsed_s is not None else ""
    return [
        f"receipt: reused {receipt.reused_tokens} tokens, computed {receipt.computed_tokens}{took}",
        f"  input_sha256            {receipt.input_sha256.hex()}",
        f"  prompt_logits_sha256    {receipt.prompt_logits_sha256.hex()}",
        f"  generated_logits_sha256 {receipt.generated_logits_sha256.hex()}",
        f"  model {receipt.model_fingerprint.hex()[:16]}, {receipt.profile.attention}, "
        f"page_tokens {receipt.profile.page_tokens}",
    ] + [
        f"  grafted {g.artifact_id[:16]}: {g.tokens} tokens, "
        + (f"vouched for by {g.vouched_by.hex()[:16]}" if g.vouched_by else "UNTRUSTED")
        for g in receipt.grafted
    ]


def _run_stream(args: argparse.Namespace, stream: GenerationStream, started: float) -> None:
    shown = False
    for token in stream:
        if not args.json and token.text:
            sys.stdout.write(token.text)
            sys.stdout.flush()
            shown = True
    result = stream.result()
    elapsed_s = time.perf_counter() - started
    if args.json:
        document = {
            **message_to_json(result.receipt.raw),
            "text": result.text,
            "deposited_artifact_id": result.deposited_artifact_id,
            "elapsed_s": round(elapsed_s, 4),
        }
        emit(True, document, "")
        return
    if shown:
        print(flush=True)  # the text's own line, before the receipt on stderr
    lines = receipt_lines(result.receipt.raw, elapsed_s)
    if result.deposited_artifact_id:
        lines.append(f"deposited {result.deposited_artifact_id}")
    if not shown and result.token_ids and not args.chat and args.tokens is None:
        lines.append(
            "note: the model ended its answer at once; an instruct (chat) model such as the "
            "default one expects --chat"
        )
    print("\n".join(lines), file=sys.stderr, flush=True)


def cmd_generate(client: Client, args: argparse.Namespace) -> None:
    started = time.perf_counter()
    _run_stream(args, client.generate_stream(**_prompt_kwargs(args), **_options(args)), started)


def cmd_graft(client: Client, args: argparse.Namespace) -> None:
    started = time.perf_counter()
    stream = client.graft_stream(args.id, **_prompt_kwargs(args), **_options(args))
    _run_stream(args, stream, started)


def cmd_deposit(client: Client, args: argparse.Namespace) -> None:
    started = time.perf_counter()
    response = client.deposit(
        **_prompt_kwargs(args), labels=_labels(args), verified_by=args.verified_by
    )
    elapsed_s = time.perf_counter() - started
    if args.quiet and not args.json:
        print(response.artifact_id)
        return
    document = {
        "artifact_id": response.artifact_id,
        **message_to_json(response.receipt.raw),
        "elapsed_s": round(elapsed_s, 4),
    }
    lines = [f"deposited {response.artifact_id}", *receipt_lines(response.receipt.raw, elapsed_s)]
    emit(args.json, document, "\n".join(lines))


def cmd_verify(client: Client, args: argparse.Namespace) -> None:
    if (args.id is None) == (not args.untrusted):
        raise InvalidArgument("give an artifact id, or --untrusted to verify every untrusted one")
    if args.untrusted:
        _verify_untrusted(client, args)
        return
    response = client.verify(args.id)
    document = message_to_json(response.raw)
    if response.ok:
        text = (
            f"verified {args.id}: every page and receipt hash matches a fresh run; this "
            "daemon now vouches for it (it is grafted automatically)"
        )
    else:
        text = f"MISMATCH {args.id}: " + ", ".join(response.mismatches)
    emit(args.json, document, text)
    if not response.ok:
        raise SystemExit(1)


def _verify_untrusted(client: Client, args: argparse.Namespace) -> None:
    """Verify every untrusted artifact of the served model (e.g. after an upgrade made a
    store's artifacts untrusted): the ones that match become trusted."""
    model = client.info().model_fingerprint
    untrusted = [
        info.artifact_id
        for info in client.list_artifacts()
        if info.provenance.trust == pb.Provenance.TRUST_UNTRUSTED
        and info.model_fingerprint == model
    ]
    outcomes: dict[str, str] = {}
    for artifact_id in untrusted:
        try:
            result = client.verify(artifact_id)
            outcomes[artifact_id] = "verified" if result.ok else "mismatch"
        except KvgraftError as exc:  # another compute profile, too long, ...
            outcomes[artifact_id] = f"not verified: {exc.code}"
        if not args.json:
            print(f"{outcomes[artifact_id]} {artifact_id}", flush=True)
    verified = sum(outcome == "verified" for outcome in outcomes.values())
    summary = f"{verified} of {len(untrusted)} untrusted artifacts verified and now trusted"
    emit(args.json, {"artifacts": outcomes, "verified": verified}, summary)
    if verified < len(untrusted):
        raise SystemExit(1)


def cmd_lookup(client: Client, args: argparse.Namespace) -> None:
    kwargs = _prompt_kwargs(args)
    if "text" in kwargs:
        response = client.lookup(text=kwargs["text"], chat=kwargs["chat"])
    else:
        response = client.lookup(kwargs["token_ids"])
    text = (
        f"{response.matched_tokens} leading tokens are stored ({response.matched_pages} whole "
        "pages): a generate of this prompt would reuse them"
    )
    emit(args.json, message_to_json(response), text)


ENGINE_COMMANDS: dict[str, tuple[Callable[[Client, argparse.Namespace], None], str]] = {
    "deposit": (cmd_deposit, "compute a context on the daemon and store it"),
    "generate": (cmd_generate, "generate, grafting the longest stored prefix"),
    "graft": (cmd_graft, "graft one artifact, append a continuation, generate"),
    "verify": (cmd_verify, "recompute an artifact fresh and compare every hash"),
    "lookup": (cmd_lookup, "how many leading tokens the store holds in whole pages"),
}


def add_engine_arguments(parsers: dict[str, argparse.ArgumentParser]) -> None:
    for name in ("deposit", "generate", "graft", "lookup"):
        parser = parsers[name]
        parser.add_argument("--text", help="prompt text, tokenized by the daemon's model")
        parser.add_argument(
            "--file",
            type=Path,
            metavar="PATH",
            help="prompt text from a file (with --text: the file, a blank line, then the text)",
        )
        parser.add_argument("--tokens", help="prompt token ids, comma-separated")
        parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    for name in ("deposit", "generate", "graft"):
        parsers[name].add_argument(
            "--label", action="append", default=[], metavar="KEY=VALUE", help="label the artifact"
        )
    parsers["deposit"].add_argument("--verified-by", default="", help="who verified the content")
    parsers["deposit"].add_argument(
        "-q", "--quiet", action="store_true", help="print the artifact id only"
    )
    parsers["graft"].add_argument("id", help="artifact id or unique prefix")
    parsers["graft"].add_argument(
        "--allow-untrusted",
        action="store_true",
        help="graft an artifact nobody trusted vouches for (the receipt says so)",
    )
    parsers["verify"].add_argument("id", nargs="?", help="artifact id or unique prefix")
    parsers["verify"].add_argument(
        "--untrusted",
        action="store_true",
        help="verify every untrusted artifact of the served model (those that match are "
        "trusted from then on)",
    )
    for name in ("generate", "graft"):
        parser = parsers[name]
        parser.add_argument(
            "--max-new-tokens",
            type=int,
            default=DEFAULT_MAX_NEW_TOKENS,
            help=f"default {DEFAULT_MAX_NEW_TOKENS}",
        )
        parser.add_argument("--no-cache", action="store_true", help="compute everything fresh")
        parser.add_argument("--deposit", action="store_true", help="store the finished context")
        parser.add_argument("--sample", action="store_true", help="sample instead of argmax")
        parser.add_argument("--temperature", type=float, default=1.0, help="with --sample")
        parser.add_argument("--seed", type=int, default=0, help="with --sample")
