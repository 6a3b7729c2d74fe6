"""The engine commands of the `kvgraft` command line: deposit, generate, graft, verify, lookup.

Prompts are given as --text (tokenized by the daemon's model; --chat wraps
it in the model's chat template) or --tokens 1,2,3. Generated text streams
to stdout as it arrives; the receipt follows on stderr. With --json one
document is printed: the receipt's fields at the top level (hashes in hex),
plus `text` and `deposited_artifact_id`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable

from kvgraft.client import Client
from kvgraft.errors import InvalidArgument, KvgraftError
from kvgraft.render import emit, message_to_json
from kvgraft.v1 import kvgraft_pb2 as pb


def _prompt_kwargs(args: argparse.Namespace) -> dict:
    if (args.text is None) == (args.tokens is None):
        raise InvalidArgument("give either --text or --tokens")
    if args.tokens is not None:
        try:
            ids = [int(t) for t in args.tokens.replace(",", " ").split()]
        except ValueError:
            raise InvalidArgument("--tokens takes integers separated by commas") from None
        return {"token_ids": ids, "chat": args.chat}
    return {"text": args.text, "chat": args.chat}


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
    return options


def receipt_lines(receipt: pb.Receipt) -> list[str]:
    return [
        f"reused {receipt.reused_tokens} tokens, computed {receipt.computed_tokens}",
        f"input_sha256            {receipt.input_sha256.hex()}",
        f"prompt_logits_sha256    {receipt.prompt_logits_sha256.hex()}",
        f"generated_logits_sha256 {receipt.generated_logits_sha256.hex()}",
        f"model {receipt.model_fingerprint.hex()[:16]}, {receipt.profile.attention}, "
        f"page_tokens {receipt.profile.page_tokens}",
    ]


def _run_stream(args: argparse.Namespace, responses: Iterable[pb.GenerateResponse]) -> None:
    result = None
    for response in responses:
        if response.HasField("token") and not args.json:
            sys.stdout.write(response.token.text)
            sys.stdout.flush()
        elif response.HasField("result"):
            result = response.result
    if result is None:
        raise KvgraftError("the stream ended without a result")
    if args.json:
        document = {
            **message_to_json(result.receipt),
            "text": result.text,
            "deposited_artifact_id": result.deposited_artifact_id,
        }
        emit(True, document, "")
        return
    print()
    lines = receipt_lines(result.receipt)
    if result.deposited_artifact_id:
        lines.append(f"deposited {result.deposited_artifact_id}")
    print("\n".join(lines), file=sys.stderr)


def cmd_generate(client: Client, args: argparse.Namespace) -> None:
    _run_stream(args, client.generate(**_prompt_kwargs(args), **_options(args)))


def cmd_graft(client: Client, args: argparse.Namespace) -> None:
    _run_stream(args, client.graft(args.id, **_prompt_kwargs(args), **_options(args)))


def cmd_deposit(client: Client, args: argparse.Namespace) -> None:
    response = client.deposit(
        **_prompt_kwargs(args), labels=_labels(args), verified_by=args.verified_by
    )
    document = {"artifact_id": response.artifact_id, **message_to_json(response.receipt)}
    text = "\n".join([f"deposited {response.artifact_id}", *receipt_lines(response.receipt)])
    emit(args.json, document, text)


def cmd_verify(client: Client, args: argparse.Namespace) -> None:
    response = client.verify(args.id)
    document = message_to_json(response)
    if response.ok:
        text = f"verified {args.id}: every page and receipt hash matches a fresh run"
    else:
        text = f"MISMATCH {args.id}: " + ", ".join(response.mismatches)
    emit(args.json, document, text)
    if not response.ok:
        raise SystemExit(1)


def cmd_lookup(client: Client, args: argparse.Namespace) -> None:
    kwargs = _prompt_kwargs(args)
    if "text" in kwargs:
        raise InvalidArgument("lookup takes --tokens (text is tokenized by the daemon only)")
    response = client.lookup(kwargs["token_ids"])
    text = f"{response.matched_tokens} tokens in stored whole pages"
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
        parser.add_argument("--tokens", help="prompt token ids, comma-separated")
        parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    for name in ("deposit", "generate", "graft"):
        parsers[name].add_argument(
            "--label", action="append", default=[], metavar="KEY=VALUE", help="label the artifact"
        )
    parsers["deposit"].add_argument("--verified-by", default="", help="who verified the content")
    parsers["graft"].add_argument("id", help="artifact id or unique prefix")
    parsers["verify"].add_argument("id", help="artifact id or unique prefix")
    for name in ("generate", "graft"):
        parser = parsers[name]
        parser.add_argument("--max-new-tokens", type=int, default=32, help="default 32")
        parser.add_argument("--no-cache", action="store_true", help="compute everything fresh")
        parser.add_argument("--deposit", action="store_true", help="store the finished context")
        parser.add_argument("--sample", action="store_true", help="sample instead of argmax")
        parser.add_argument("--temperature", type=float, default=1.0, help="with --sample")
        parser.add_argument("--seed", type=int, default=0, help="with --sample")
