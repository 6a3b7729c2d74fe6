"""`kvgraft chat`: a multi-turn chat with the daemon's model in the terminal, as `ollama run`.

Each turn sends the whole conversation so far as Prompt.conversation (the daemon
renders it with the model's chat template) with keep=True: the daemon keeps every
turn's finished context, so the next turn grafts all the earlier ones and computes
only the new message and the template's tokens around it. --system gives a system
prompt; the decoding flags are generate's (kvgraft.cli.options), greedy by default.

Interactive (the default): `>>> ` reads a message, the answer streams to stdout, then
one short dim line on stderr says the tokens reused and computed and the decode rate
(generated tokens per second from the first token on). /reset starts a new
conversation (the system prompt stays), /exit, Ctrl-D or Ctrl-C at the prompt ends it
(quietly, exit status 0: no call was running). Ctrl-C during an answer cancels that
call and leaves the turn out of the conversation. A daemon's error during a turn
(a conversation past max_context_tokens, ...) is printed and the chat goes on.

--json, for scripts: the user's messages come from stdin, one per line (blank lines
skipped), and each turn is written as one JSON line (no prompts, no colours): its
text, finish_reason, tokens reused, computed and generated, tokens_per_s, the receipt's
hashes in hex and its sampling (null when greedy without stop strings). An error ends
the run with one JSON line {"error": {"code", "message"}} and exit 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator

from kvgraft.cli import arguments
from kvgraft.cli.arguments import UsageError, is_utf8
from kvgraft.cli.model_wait import wait_for_model
from kvgraft.cli.options import add_decoding_options, decoding_options
from kvgraft.cli.render import HeldText, message_to_json
from kvgraft.client.client import Client
from kvgraft.errors import KvgraftError
from kvgraft.results import GenerateResult

DEFAULT_CHAT_MAX_NEW_TOKENS = 512
Messages = list[dict[str, str]]


def cmd_chat(client: Client, args: argparse.Namespace) -> None:
    options = {"max_new_tokens": args.max_new_tokens, "keep": True, **decoding_options(args)}
    wait_for_model(client)  # before the prompt, as `ollama run` does
    if args.json:
        _scripted(client, args, options)
    else:
        _interactive(client, args, options)


def _answer(
    client: Client, options: dict, messages: Messages, show: Callable[[str], None]
) -> tuple[GenerateResult, float]:
    """One turn: the answer to `messages`, each piece of its text handed to `show` as it
    streams (never a stop string), and its decode rate in tokens/s. Ctrl-C cancels the
    call (the daemon stops at its next step) and is raised on."""
    stream = client.generate_stream(messages=messages, **options)
    held = HeldText(options.get("stop", ()))
    first_token_at = None
    try:
        for token in stream:
            first_token_at = first_token_at or time.perf_counter()
            show(held.add(token.text))
        result = stream.result()
    except KeyboardInterrupt:
        stream.cancel()
        raise
    # from the first token to the end: one forward pass per generated token
    decode_s = time.perf_counter() - (first_token_at or time.perf_counter())
    show(held.finish())
    return result, len(result.token_ids) / decode_s if decode_s > 0 else 0.0


def _first_messages(args: argparse.Namespace) -> Messages:
    return [{"role": "system", "content": args.system}] if args.system else []


def _interactive(client: Client, args: argparse.Namespace, options: dict) -> None:
    with contextlib.suppress(ImportError):  # not on every platform; input() works without
        import readline  # noqa: F401  (line editing and history for input())
    messages = _first_messages(args)
    _note(f"chat with kvgraftd at {client.address}: /reset starts anew, /exit or Ctrl-D ends")
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return
        except KeyboardInterrupt:  # at the prompt: the user leaves, as with Ctrl-D
            print()  # the shell's prompt on a line of its own, not after ours
            return
        except UnicodeDecodeError:
            _note("that line is not UTF-8 text: type it again")
            continue
        text = line.strip()
        if text in ("/exit", "/bye"):
            return
        if text == "/reset":
            messages = _first_messages(args)
            _note("a new conversation")
            continue
        if text.startswith("/"):
            _note(f"{text.split()[0]} is no command: /reset starts anew, /exit ends")
            continue
        if not text:
            continue
        if not is_utf8(line):
            _note("that line is not UTF-8 text: type it again")
            continue
        asked = [*messages, {"role": "user", "content": line}]
        try:
            result, rate = _answer(client, options, asked, _write)
        except KeyboardInterrupt:
            print(flush=True)
            _note("stopped: this turn is left out of the conversation")
            continue
        except KvgraftError as exc:
            print(flush=True)
            print(f"kvgraft: error: {exc.code}: {exc}", file=sys.stderr, flush=True)
            _note("this turn is left out of the conversation; /reset starts anew")
            continue
        print(flush=True)
        messages = [*asked, {"role": "assistant", "content": result.text}]
        _note(_summary(result, rate))


def _write(text: str) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def _summary(result: GenerateResult, rate: float) -> str:
    cut = " · cut at --max-new-tokens" if result.finish_reason == "length" else ""
    return (
        f"reused {result.reused_tokens} tokens, computed {result.computed_tokens} · "
        f"{len(result.token_ids)} tokens at {rate:.1f} tokens/s{cut}"
    )


def _note(text: str) -> None:
    """A line about the chat (not the model's words), on stderr; dim on a terminal."""
    if sys.stderr.isatty() and "NO_COLOR" not in os.environ:
        text = f"\033[2m{text}\033[0m"
    print(text, file=sys.stderr, flush=True)


def _scripted(client: Client, args: argparse.Namespace, options: dict) -> None:
    messages = _first_messages(args)
    for number, line in enumerate(_stdin_messages(), start=1):
        asked = [*messages, {"role": "user", "content": line}]
        try:
            result, rate = _answer(client, options, asked, lambda text: None)
        except KvgraftError as exc:  # one JSON line, as every other line of the run
            print(json.dumps({"error": {"code": exc.code, "message": str(exc)}}), flush=True)
            print(f"kvgraft: error: {exc.code}: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        messages = [*asked, {"role": "assistant", "content": result.text}]
        print(json.dumps(_turn_document(number, result, rate)), flush=True)


def _stdin_messages() -> Iterator[str]:
    """The user's messages on stdin, one per line; UsageError for bytes that are not UTF-8."""
    number = 0
    try:
        for number, line in enumerate(sys.stdin, start=1):
            if not is_utf8(line):
                raise UsageError(f"stdin line {number} is not UTF-8 text")
            if line.strip():
                yield line.rstrip("\r\n")
    except UnicodeDecodeError:
        raise UsageError(f"stdin line {number + 1} is not UTF-8 text") from None


def _turn_document(number: int, result: GenerateResult, rate: float) -> dict:
    receipt = result.receipt
    return {
        "turn": number,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "reused_tokens": result.reused_tokens,
        "computed_tokens": result.computed_tokens,
        "generated_tokens": len(result.token_ids),
        "tokens_per_s": round(rate, 2),
        "input_sha256": receipt.input_sha256.hex(),
        "prompt_logits_sha256": receipt.prompt_logits_sha256.hex(),
        "generated_logits_sha256": receipt.generated_logits_sha256.hex(),
        "sampling": message_to_json(receipt.raw.sampling) if receipt.sampling else None,
    }


CHAT_COMMANDS = {
    "chat": (cmd_chat, "chat with the model in the terminal, each turn reusing the earlier ones"),
}


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", metavar="TEXT", help="a system prompt, first in the chat")
    parser.add_argument(
        "--max-new-tokens",
        type=arguments.uint32,
        default=DEFAULT_CHAT_MAX_NEW_TOKENS,
        metavar="N",
        help=f"tokens per answer at most (default {DEFAULT_CHAT_MAX_NEW_TOKENS})",
    )
    add_decoding_options(parser)
