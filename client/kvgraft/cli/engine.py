"""The engine commands of the `kvgraft` command line: deposit, generate, graft, verify, lookup.

Prompts are given as --text (tokenized by the daemon's model; --chat wraps
it in the model's chat template), --file (text read from a file; with --text
too, the file's text, a blank line, then --text) or --tokens 1,2,3.
Decoding is greedy (argmax) unless told otherwise: --temperature T samples at T
(0: greedy, as in OpenAI's API), --sample alone samples at 1.0, --seed N picks the
samples (the same seed, the same tokens), --top-p and --top-k narrow them, --stop TEXT
ends the answer before TEXT (kvgraft.cli.options).
Generated text streams to stdout as it arrives, then a newline (with --logprobs N, a
table of each token's logprob and its step's N likeliest tokens follows); the receipt
follows on stderr, its first line the tokens reused and computed and the
seconds the call took. With --json one document is printed: the receipt's
fields at the top level (hashes in hex; `sampling` null for greedy decoding without
stop strings), plus `text`, `finish_reason`, `deposited_artifact_id`, `elapsed_s`
and, with --logprobs, `tokens` (each with its logprob and top_logprobs).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvgraft.cli import arguments
from kvgraft.cli.arguments import UsageError, read_text
from kvgraft.cli.model_wait import wait_for_model
from kvgraft.cli.options import add_decoding_options, decoding_options
from kvgraft.cli.render import (
    HeldText,
    emit,
    logprob_table,
    message_to_json,
    progress_bar,
    token_to_json,
)
from kvgraft.cli.tenants import grafted_owner
from kvgraft.client.client import Client
from kvgraft.client.engine_calls import DEFAULT_MAX_NEW_TOKENS
from kvgraft.errors import FailedPrecondition, KvgraftError
from kvgraft.results import GenerationStream, Progress
from kvgraft.v1 import kvgraft_pb2 as pb


def _prompt_kwargs(args: argparse.Namespace) -> dict:
    file_text = read_text(args.file).strip() if args.file is not None else None
    if args.tokens is not None:
        if args.text is not None or file_text is not None:
            raise UsageError("give --tokens, or text (--text and/or --file), not both")
        return {"token_ids": args.tokens, "chat": args.chat}
    parts = [part for part in (file_text, args.text) if part is not None]
    if not parts:
        raise UsageError("give the prompt: --text, --file or --tokens")
    return {"text": "\n\n".join(parts), "chat": args.chat}


def _labels(args: argparse.Namespace) -> dict[str, str]:
    return dict(item.split("=", 1) for item in args.label)  # KEY=VALUE: checked by main


def _options(args: argparse.Namespace) -> dict:
    options = {
        "max_new_tokens": args.max_new_tokens,
        "no_cache": args.no_cache,
        "deposit": args.deposit,
        "labels": _labels(args),
        **decoding_options(args),
    }
    if args.logprobs is not None:
        options.update(logprobs=True, top_logprobs=args.logprobs)
    if getattr(args, "allow_untrusted", False):
        options["allow_untrusted"] = True
    return options


def receipt_lines(receipt: pb.Receipt, elapsed_s: float | None = None) -> list[str]:
    """A run's receipt: the tokens reused and computed (and the seconds it took), then
    its hashes and what it grafted."""
    took = f" in {elapsed_s:.2f} s" if elapsed_s is not None else ""
    return [
        f"receipt: reused {receipt.reused_tokens} tokens, computed {receipt.computed_tokens}{took}",
        *receipt_detail_lines(receipt),
    ]


def receipt_detail_lines(receipt: pb.Receipt) -> list[str]:
    """A receipt's hashes, model and profile, and the artifacts it grafted."""
    return (
        [
            f"  input_sha256            {receipt.input_sha256.hex()}",
            f"  prompt_logits_sha256    {receipt.prompt_logits_sha256.hex()}",
            f"  generated_logits_sha256 {receipt.generated_logits_sha256.hex()}",
            f"  model {receipt.model_fingerprint.hex()[:16]}, {receipt.profile.attention}, "
            f"page_tokens {receipt.profile.page_tokens}",
        ]
        + _sampling_lines(receipt)
        + [
            f"  grafted {g.artifact_id[:16]}{grafted_owner(g)}: {g.tokens} tokens, "
            + (f"vouched for by {g.vouched_by.hex()[:16]}" if g.vouched_by else "untrusted")
            for g in receipt.grafted
        ]
    )


def _sampling_lines(receipt: pb.Receipt) -> list[str]:
    """How the receipt's tokens were chosen, when not by argmax alone."""
    if not receipt.HasField("sampling"):
        return []
    sampling = receipt.sampling
    stop = f", stop {list(sampling.stop)!r}" if sampling.stop else ""
    if sampling.greedy:
        return [f"  sampling greedy{stop}"]
    return [
        f"  sampling temperature {sampling.temperature:g}, top_p {sampling.top_p:g}, "
        f"top_k {sampling.top_k}, seed {sampling.seed}{stop}"
    ]


class PromptBar:
    """The prompt's progress while the daemon computes it (tokens done, tokens/s), on a
    terminal's stderr: handed to the client as `on_progress`, closed before the answer."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._args = args
        self._bar = None

    def __call__(self, progress: Progress) -> None:
        if self._bar is None:
            self._bar = progress_bar(self._args, "prompt", total=progress.total, unit="tok")
            if self._bar is None:
                return
            self._bar.n = self._bar.last_print_n = self._bar.initial = progress.reused
        self._bar.update(progress.done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _prompt_bar(args: argparse.Namespace) -> dict:
    """`on_progress` for a call, where its progress would be shown."""
    return {} if args.json or not sys.stderr.isatty() else {"on_progress": PromptBar(args)}


def _run_stream(args: argparse.Namespace, stream: GenerationStream, started: float) -> None:
    shown = False
    bar = stream.on_progress
    held = HeldText(args.stop)
    for token in stream:
        if bar is not None:
            bar.close()
        text = held.add(token.text)
        if not args.json and text:
            sys.stdout.write(text)
            sys.stdout.flush()
            shown = True
    result = stream.result()
    if bar is not None:
        bar.close()
    elapsed_s = time.perf_counter() - started
    if args.json:
        document = {
            **message_to_json(result.receipt.raw),
            "text": result.text,
            "finish_reason": result.finish_reason,
            "deposited_artifact_id": result.deposited_artifact_id,
            "elapsed_s": round(elapsed_s, 4),
        }
        if result.logprobs is not None:
            document["tokens"] = [token_to_json(token) for token in result.logprobs]
        emit(True, document, "")
        return
    rest = held.finish()
    sys.stdout.write(rest)
    if shown or rest:
        print(flush=True)  # the text's own line, before the receipt on stderr
        shown = True
    if result.logprobs:
        print(logprob_table(result.logprobs), flush=True)
    lines = receipt_lines(result.receipt.raw, elapsed_s)
    if result.deposited_artifact_id:
        lines.append(f"deposited {result.deposited_artifact_id}")
    if not shown and result.token_ids and not (args.chat or args.stop) and args.tokens is None:
        lines.append(
            "note: the model ended its answer at once; an instruct (chat) model such as the "
            "default one expects --chat"
        )
    print("\n".join(lines), file=sys.stderr, flush=True)


def cmd_generate(client: Client, args: argparse.Namespace) -> None:
    prompt, options = _prompt_kwargs(args), _options(args)  # usage errors before any call
    wait_for_model(client)
    started = time.perf_counter()
    stream = client.generate_stream(**prompt, **options, **_prompt_bar(args))
    _run_stream(args, stream, started)


def cmd_graft(client: Client, args: argparse.Namespace) -> None:
    prompt, options = _prompt_kwargs(args), _options(args)
    wait_for_model(client)
    started = time.perf_counter()
    stream = client.graft_stream(args.id, **prompt, **options, **_prompt_bar(args))
    _run_stream(args, stream, started)


def cmd_deposit(client: Client, args: argparse.Namespace) -> None:
    prompt = _prompt_kwargs(args)
    wait_for_model(client)
    started = time.perf_counter()
    shown = _prompt_bar(args)
    try:
        response = client.deposit(
            **prompt, labels=_labels(args), verified_by=args.verified_by, **shown
        )
    finally:
        if shown:
            shown["on_progress"].close()
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
        raise UsageError("give an artifact id, or --untrusted to verify every untrusted one")
    wait_for_model(client)
    if args.untrusted:
        _verify_untrusted(client, args)
        return
    response = client.verify(args.id)
    document = message_to_json(response.raw)
    if document["stored"] is not None:  # a manifest keeps no reuse counts: its zeros say none
        del document["stored"]["reused_tokens"], document["stored"]["computed_tokens"]
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
    store's artifacts untrusted): the ones that match become trusted. A daemon without
    its model ready cannot recompute: that is an error naming what waits."""
    info = client.info()
    waiting = [
        i for i in client.list_artifacts() if i.provenance.trust == pb.Provenance.TRUST_UNTRUSTED
    ]
    if waiting and info.model_state != "ready":
        raise FailedPrecondition(
            f"{len(waiting)} untrusted artifacts wait, and kvgraftd at {client.address} "
            + _cannot_compute(info.model_state)
        )
    untrusted = [i.artifact_id for i in waiting if i.model_fingerprint == info.model_fingerprint]
    others = len(waiting) - len(untrusted)
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
    if others:
        summary += (
            f"; {others} untrusted artifacts of other models left as they are (verify them "
            "on a daemon that serves their model)"
        )
    document = {"artifacts": outcomes, "verified": verified, "other_models": others}
    emit(args.json, document, summary)
    if verified < len(untrusted):
        raise SystemExit(1)


def _cannot_compute(model_state: str) -> str:
    """Why a daemon whose model is not ready cannot verify, and what to do (the command
    line waited while it loaded: kvgraft.cli.model_wait)."""
    if model_state.startswith("failed"):
        return f"has no model ({model_state}): fix its --model and restart it"
    return (
        "serves no model (--model none), so it cannot recompute them: run this against a "
        "daemon that serves their model"
    )


def cmd_lookup(client: Client, args: argparse.Namespace) -> None:
    kwargs = _prompt_kwargs(args)
    wait_for_model(client)
    if "text" in kwargs:
        response = client.lookup(text=kwargs["text"], chat=kwargs["chat"])
    else:
        response = client.lookup(kwargs["token_ids"])
    pages = f"{response.matched_pages} whole page{'' if response.matched_pages == 1 else 's'}"
    lines = [
        f"{response.matched_tokens} leading tokens are stored ({pages}): a generate of this "
        "prompt reuses them (all but the last token at most: its logits are computed)"
    ]
    if response.untrusted_tokens:
        artifact = response.untrusted_artifact_id[:16]
        lines.append(
            f"{response.untrusted_tokens} are held by untrusted artifact {artifact}, which is "
            f"not reused until it is trusted: kvgraft verify {artifact} recomputes it (or "
            "trust the key that signed it: [trust] keys)"
        )
    emit(args.json, message_to_json(response), "\n".join(lines))


ENGINE_COMMANDS: dict[str, tuple[Callable[[Client, argparse.Namespace], None], str]] = {
    "deposit": (cmd_deposit, "compute a context on the daemon and store it"),
    "generate": (cmd_generate, "generate, grafting the longest stored prefix"),
    "graft": (cmd_graft, "graft one artifact, append a continuation, generate"),
    "verify": (cmd_verify, "recompute an artifact fresh and compare every hash"),
    "lookup": (cmd_lookup, "how many leading tokens of a prompt the store holds"),
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
        parser.add_argument(
            "--tokens",
            type=arguments.token_ids,
            metavar="IDS",
            help="prompt token ids, comma-separated (1,2,3)",
        )
        parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    for name in ("deposit", "generate", "graft"):
        parsers[name].add_argument(
            "--label", action="append", default=[], metavar="KEY=VALUE", help="label the artifact"
        )
    parsers["deposit"].add_argument(
        "--verified-by", default="", metavar="NAME", help="who verified the content"
    )
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
            type=arguments.uint32,
            default=DEFAULT_MAX_NEW_TOKENS,
            metavar="N",
            help=f"tokens to generate at most (default {DEFAULT_MAX_NEW_TOKENS}; 0: none)",
        )
        parser.add_argument("--no-cache", action="store_true", help="compute everything fresh")
        parser.add_argument("--deposit", action="store_true", help="store the finished context")
        add_decoding_options(parser)
        parser.add_argument(
            "--logprobs",
            type=arguments.logprob_alternatives,
            metavar="N",
            help="show each token's log-probability and the N likeliest tokens of its step "
            f"(0 to {arguments.MAX_TOP_LOGPROBS}; with --json: `tokens`)",
        )
