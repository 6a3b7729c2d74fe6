"""A conversation as token ids, with every message's text tokenized as text.

Contract: the only control tokens (a tokenizer's special tokens: `<|im_start|>`,
`<|eot_id|>`, ...) in `ChatTokens.ids(messages, ...)` are those the chat template's own
markup writes. Every string of a message (its content, a name, a tool's result: each
string value in it, at any depth) is tokenized as plain text, so a message holding the
template's markers reads as those characters and cannot open a turn of another role (a
forged system turn). Tokens a tokenizer adds that are not control tokens (Qwen 3's
`<think>`, a tool-call tag) stay what text makes of them, as in llama.cpp, where only
control tokens need `parse_special`.

How: where no message string holds a control token's text (every conversation but a
hostile one), the ids are the rendering tokenized with control tokens parsed: exactly what
rendering then tokenizing the whole string gave before this module (tested against
transformers' `apply_chat_template` for every template in `../shared/vocab`). Where one
does, each such occurrence is replaced by a placeholder, a private-use character that is
in no message and not in the template, before rendering; the rendering is cut at the
control tokens the markup wrote, and each piece between them, its placeholders put back,
is tokenized with control tokens not parsed. Both paths cut at control tokens the same
way, so a byte-level BPE vocabulary (SmolLM2, Llama 3, Qwen) gives the same ids for the
same pieces; a SentencePiece vocabulary may start a piece with its prefix space there.

Assumed of a template: its markup next to a message's text is never part of a control
token's text (a template that writes `<|im_` and lets the message finish it); no real one
does. Raw prompts (`/v1/completions`, gRPC's `Prompt.text` without `chat`) are the
caller's whole prompt: `ModelAdapter.encode` parses their control tokens, as llama.cpp's
server and vLLM do. This module must not import transformers: the tokenizer comes through
`Tokenizer`.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from kvgraft.errors import InvalidArgument

# Supplementary Private Use Area-A: no tokenizer gives these characters a meaning, and no
# text a client sends is likely to hold many of them (those it holds are skipped).
PLACEHOLDER_FIRST = 0xF0000
PLACEHOLDER_LAST = 0xFFFFD

Messages = list[dict[str, Any]]
Render = Callable[[Messages, bool], str]


class Tokenizer(Protocol):
    """What ChatTokens needs of a tokenizer."""

    def control_tokens(self) -> Mapping[str, int]:
        """Each control token's text and id."""
        ...

    def encode(self, text: str, parse_special: bool) -> list[int]:
        """The ids of `text`; control tokens' texts become their ids only with parse_special."""
        ...


class ChatTokens:
    """A model's conversations as token ids: its tokenizer, its template's renderer."""

    def __init__(self, tokenizer: Tokenizer, render: Render, template: str) -> None:
        self._tokenizer = tokenizer
        self._render = render
        self._template = template
        self._ids = dict(tokenizer.control_tokens())
        # longest first: the alternation then takes the longest token at a position
        texts = sorted((text for text in self._ids if text), key=len, reverse=True)
        self._controls = re.compile("|".join(map(re.escape, texts))) if texts else None

    def ids(self, messages: Messages, add_generation_prompt: bool) -> list[int]:
        strings = list(_strings(messages))
        if self._controls is None or not any(self._controls.search(s) for s in strings):
            return self._tokenizer.encode(self._render(messages, add_generation_prompt), True)
        return self._escaped(messages, strings, add_generation_prompt)

    def _escaped(self, messages: Messages, strings: list[str], add_prompt: bool) -> list[int]:
        """The ids of a conversation whose strings hold control tokens' texts, as text."""
        assert self._controls is not None
        found = sorted({m.group() for s in strings for m in self._controls.finditer(s)})
        taken = set("".join(strings)) | set(self._template)
        free = (chr(c) for c in range(PLACEHOLDER_FIRST, PLACEHOLDER_LAST + 1))
        placeholder = dict(zip(found, (c for c in free if c not in taken), strict=False))
        if len(placeholder) < len(found):  # 65,534 characters taken: not a conversation
            raise InvalidArgument(
                "the conversation holds every character of Unicode's private use area A "
                "and a control token's text; send fewer of them"
            )
        back = {ord(mark): text for text, mark in placeholder.items()}

        def hide(text: str) -> str:
            return self._controls.sub(lambda m: placeholder[m.group()], text)

        rendered = self._render(_mapped(messages, hide), add_prompt)
        ids: list[int] = []
        start = 0
        for control in self._controls.finditer(rendered):  # the markup's own
            ids += self._text(rendered[start : control.start()].translate(back))
            ids.append(self._ids[control.group()])
            start = control.end()
        return ids + self._text(rendered[start:].translate(back))

    def _text(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, False) if text else []


class TransformersText:
    """`Tokenizer` over a transformers tokenizer (its added tokens marked special are the
    control tokens; `split_special_tokens` leaves them text).

    transformers does not pass `split_special_tokens` with the call: it sets it on the one
    Rust tokenizer the object holds, then encodes. Two threads encoding at once, one
    parsing and one not, could each encode with the other's setting (message text read
    with control tokens parsed: a forged turn). So every encode of a tokenizer holds that
    tokenizer's lock (one per tokenizer object, however many wrap it)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._lock = _lock_of(tokenizer)

    def control_tokens(self) -> dict[str, int]:
        added = self._tokenizer.added_tokens_decoder
        return {token.content: index for index, token in added.items() if token.special}

    def encode(self, text: str, parse_special: bool, add_special: bool = False) -> list[int]:
        """`add_special`: the tokenizer's own BOS/EOS around the text (llama.cpp's /tokenize)."""
        with self._lock:
            return self._tokenizer.encode(
                text, add_special_tokens=add_special, split_special_tokens=not parse_special
            )


_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its lock
_locks_lock = threading.Lock()


def _lock_of(tokenizer) -> threading.Lock:
    with _locks_lock:
        return _locks.setdefault(tokenizer, threading.Lock())


def _strings(value: Any):
    """Every string value in a message structure (dict keys are the template's names)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def _mapped(value: Any, change: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return change(value)
    if isinstance(value, Mapping):
        return {key: _mapped(item, change) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_mapped(item, change) for item in value]
    return value
