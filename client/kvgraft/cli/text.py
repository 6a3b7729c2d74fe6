"""`kvgraft tokenize` and `kvgraft detokenize`: a GGUF model's tokenizer and chat template,
offline (no daemon: a vocabulary-only GGUF is enough; without --model, the default
model's), with the code the daemon runs.

tokenize: `--text T`, `--file F` or stdin; `--messages FILE.json` (a list of
{"role", "content"} objects, or {"messages": [...]}) renders a conversation with the file's
template or `--chat-template FILE` and tokenizes it as the daemon does (message text as
text: kvgraft.text.chat_tokens); `--add-special` puts the file's BOS/EOS around a text;
`--no-parse-special` reads control tokens' texts as text. Prints the ids on one line;
`--pieces` one id and its text a line; `--json` one document: the ids, their count, each
piece (its text, or its bytes where they are not UTF-8 alone, as llama.cpp's server
gives them), and the rendered text of a conversation.

detokenize: `--ids 1,2,3` (or ids on stdin) back to text; `--skip-special` leaves control
tokens out. A file kvgraft cannot read (no tokenizer, an unknown tokenizer model or
pre-tokenizer) is refused naming what it holds; a template that refuses the
conversation says why.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from kvgraft.cli.arguments import UsageError, read_text, token_ids
from kvgraft.errors import FailedPrecondition, InvalidArgument
from kvgraft.text.chat_template import TemplateFailure
from kvgraft.text.chat_tokens import ChatTokens, TransformersText
from kvgraft.text.default_model import default_model_path
from kvgraft.text.gguf_tokenizer import GgufTokenizer
from kvgraft.text.token_pieces import piece, token_bytes


def cmd_tokenize(args: argparse.Namespace) -> None:
    if args.messages is not None and (args.add_special or args.no_parse_special):
        raise UsageError(
            "--add-special and --no-parse-special are for a text; a conversation's markup is "
            "the template's and its messages are always text"
        )
    if args.messages is None and (args.chat_template or args.no_generation_prompt):
        raise UsageError("--chat-template and --no-generation-prompt go with --messages")
    tokenizer = _tokenizer(args)
    rendered = None
    if args.messages is not None:
        messages = _messages(args.messages)
        if args.chat_template is not None:
            tokenizer.chat_template = read_text(args.chat_template)
        if not tokenizer.chat_template:
            raise FailedPrecondition(
                f"{args.model} has no chat template: give one with --chat-template FILE"
            )

        def render(messages: list, prompt: bool) -> str:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=prompt)

        chat = ChatTokens(TransformersText(tokenizer), render, tokenizer.chat_template)
        prompt = not args.no_generation_prompt
        try:
            rendered = render(messages, prompt)
            ids = chat.ids(messages, prompt)
        except TemplateFailure as refused:
            raise InvalidArgument(f"{refused}; give another with --chat-template") from None
    else:
        text = _input_text(args)
        ids = tokenizer.encode(
            text, add_special_tokens=args.add_special, split_special_tokens=args.no_parse_special
        )
    pieces = [piece(raw) for raw in token_bytes(tokenizer, ids)]
    if args.json:
        document = {"model": str(args.model), "count": len(ids), "tokens": ids, "pieces": pieces}
        if rendered is not None:
            document["rendered"] = rendered
        print(json.dumps(document, indent=2, ensure_ascii=False))
    elif args.pieces:
        for index, text in zip(ids, pieces, strict=True):
            print(f"{index:>8} {text!r}")
    else:
        print(" ".join(map(str, ids)))


def cmd_detokenize(args: argparse.Namespace) -> None:
    tokenizer = _tokenizer(args)
    ids = args.ids if args.ids is not None else _ids_from(sys.stdin.read())
    size = len(tokenizer)
    beyond = [index for index in ids if index >= size]
    if beyond:
        raise InvalidArgument(
            f"token id {beyond[0]} is not in {args.model}'s vocabulary of {size} tokens"
        )
    text = tokenizer.decode(ids, skip_special_tokens=args.skip_special)
    if args.json:
        print(json.dumps({"model": str(args.model), "text": text}, indent=2, ensure_ascii=False))
    else:
        sys.stdout.write(text + "\n")


TEXT_COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], None], str]] = {
    "tokenize": (cmd_tokenize, "a GGUF model's token ids of a text or conversation (offline)"),
    "detokenize": (cmd_detokenize, "the text of token ids, by a GGUF model's tokenizer (offline)"),
}


def add_text_arguments(parsers: dict[str, argparse.ArgumentParser]) -> None:
    for name in TEXT_COMMANDS:
        parsers[name].add_argument(
            "--model",
            type=Path,
            metavar="FILE",
            help="a GGUF file, a vocabulary-only one will do (default: the default model's)",
        )
    tokenize = parsers["tokenize"]
    source = tokenize.add_mutually_exclusive_group()
    source.add_argument("--text", help="the text (default: --file, or stdin)")
    source.add_argument("--file", type=Path, help="a UTF-8 text file to tokenize")
    source.add_argument(
        "--messages", type=Path, metavar="FILE.json", help="a conversation to render and tokenize"
    )
    tokenize.add_argument(
        "--chat-template", type=Path, metavar="FILE", help="a Jinja template instead of the file's"
    )
    tokenize.add_argument(
        "--no-generation-prompt",
        action="store_true",
        help="with --messages: no opening of the assistant's turn at the end",
    )
    tokenize.add_argument(
        "--add-special", action="store_true", help="the file's BOS/EOS around the text"
    )
    tokenize.add_argument(
        "--no-parse-special", action="store_true", help="control tokens' texts stay text"
    )
    tokenize.add_argument("--pieces", action="store_true", help="one id and its text a line")
    detokenize = parsers["detokenize"]
    detokenize.add_argument("--ids", type=token_ids, help="token ids, e.g. 1,2,3 (default: stdin)")
    detokenize.add_argument("--skip-special", action="store_true", help="leave control tokens out")


def _tokenizer(args: argparse.Namespace) -> GgufTokenizer:
    if args.model is None:
        args.model = default_model_path()
    if not args.model.is_file():
        raise UsageError(f"{args.model} does not exist or is not a file: give a GGUF file")
    try:
        return GgufTokenizer.load(args.model)
    except ValueError as error:
        raise FailedPrecondition(str(error)) from None


def _input_text(args: argparse.Namespace) -> str:
    if args.text is not None:
        return args.text
    if args.file is not None:
        return read_text(args.file)
    return sys.stdin.read()


def _messages(path: Path) -> list:
    try:
        document = json.loads(read_text(path))
    except json.JSONDecodeError as error:
        raise UsageError(f"{path} is not JSON ({error})") from None
    if isinstance(document, dict):
        document = document.get("messages")
    if not isinstance(document, list) or not all(isinstance(m, dict) for m in document):
        raise UsageError(
            f'{path}: give a list of messages, e.g. [{{"role": "user", "content": "hi"}}]'
        )
    return document


def _ids_from(text: str) -> list[int]:
    try:
        return token_ids(text)
    except argparse.ArgumentTypeError as error:
        raise UsageError(f"stdin: {error}") from None
