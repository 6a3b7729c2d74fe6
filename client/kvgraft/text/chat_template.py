"""Chat templates (a model's `tokenizer.chat_template`), rendered as transformers renders them.

Contract: `ChatTemplate(source).render(messages, add_generation_prompt, **context)` gives the
text transformers' `apply_chat_template(..., tokenize=False)` gives for the same template,
messages and special tokens (tested against it for every template in ../shared/vocab):
jinja2's immutable sandbox with `trim_blocks` and `lstrip_blocks`, loop controls, `tojson`
without HTML escaping, `raise_exception`, `strftime_now`, a `namespace` that refuses names
beginning with "_"; message keys whose value is None dropped, a message's reasoning
passed under the names templates read (`reasoning_content`, `thinking`), transformers'
`{% generation %}` blocks rendered as their content. Only plain data (str, numbers, bools,
lists, dicts) reaches a template. A template that does not compile, or that raises while
rendering (its own raise_exception, or any error of its code), is a TemplateFailure naming
it and its message: templates are third-party code, run in the sandbox and never trusted
with Python. A string or list a template multiplies may hold at most MAX_REPEATED items;
the sandbox bounds `range` (jinja2's 100,000), but not the loops a template nests: a
template is the operator's choice (the model file's, or --chat-template), never a
request's.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_REPEATED = 1 << 20  # items of a string or list a template's `*` may make
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# a probe conversation whose answers open with a reasoning block, as reasoning models write
_REASONED = "<think>\nLet me see.\n</think>\n\n"
_PROBE = [
    {"role": "user", "content": "one"},
    {"role": "assistant", "content": _REASONED + "two"},
    {"role": "user", "content": "three"},
    {"role": "assistant", "content": _REASONED + "four"},
    {"role": "user", "content": "five"},
]


class TemplateFailure(ValueError):
    """A chat template that did not compile or render; the message says which and why."""


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore names (no reach into Python's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}`: its content, as it renders
    it where no assistant mask is asked for."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        line = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_content"), [], [], body).set_lineno(line)

    def _content(self, caller) -> str:
        return caller()


class _Environment(ImmutableSandboxedEnvironment):
    """The sandbox, with `*` bounded: "x" * 10**10 is refused, not allocated."""

    intercepted_binops = frozenset({"*"})

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for sequence, times in ((left, right), (right, left)):
                repeated = isinstance(sequence, str | list | tuple) and isinstance(times, int)
                if repeated and len(sequence) * times > MAX_REPEATED:
                    raise jinja2.exceptions.SecurityError(
                        f"the template repeats a sequence past {MAX_REPEATED} items"
                    )
        return super().call_binop(context, operator, left, right)


@functools.lru_cache(maxsize=16)
def _compiled(source: str) -> jinja2.Template:
    environment = _Environment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    environment.globals["namespace"] = _Namespace
    return environment.from_string(source)


class ChatTemplate:
    """One chat template's source, compiled once (see the module's contract)."""

    def __init__(self, source: str, name: str = "the chat template") -> None:
        if not source:
            raise TemplateFailure(f"{name} has no chat template")
        self.source = source
        self.name = name
        try:
            self._template = _compiled(source)
        except jinja2.exceptions.TemplateError as error:
            raise TemplateFailure(f"{name}'s chat template does not compile: {error}") from None

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = False, **context: Any
    ) -> str:
        """The conversation as the template writes it; `context`: bos_token, eos_token,
        tools, and whatever else the template reads (enable_thinking, ...)."""
        chat = []
        for message in _plain(messages):
            if not isinstance(message, dict):
                raise TemplateFailure(f"a message must be an object, not {message!r}")
            chat.append(_with_reasoning({k: v for k, v in message.items() if v is not None}))
        context = {"tools": None, "documents": None, **context}
        try:
            return self._template.render(
                messages=chat, add_generation_prompt=add_generation_prompt, **_plain(context)
            )
        except jinja2.exceptions.TemplateError as error:
            raise TemplateFailure(f"{self.name}'s chat template refused: {error}") from None
        except Exception as error:  # the template's own code failed (1 / 0, "a" + 1, ...)
            raise TemplateFailure(
                f"{self.name}'s chat template failed: {type(error).__name__}: {error}"
            ) from None

    def rewritten_turns(self, **context: Any) -> str:
        """ "" where the template renders each earlier turn as it was when it was answered
        (so a conversation reuses every earlier turn), else what changes: the template
        renders a probe conversation after each answer (with a reasoning block, as
        reasoning models write) and the next rendering must begin with the last one and its
        answer."""
        for turn in (1, 3):
            try:
                asked = self.render(_PROBE[:turn], True, **context) + _PROBE[turn]["content"]
                later = self.render(_PROBE[: turn + 2], True, **context)
            except TemplateFailure as refused:
                return f"the probe conversation was refused ({refused})"
            if not later.startswith(asked):
                at = first_difference(asked, later)
                return (
                    f"it renders answer {turn // 2 + 1} otherwise once the conversation goes on "
                    f"(from {asked[at : at + 24]!r} to {later[at : at + 24]!r}): reuse stops there"
                )
        return ""


def first_difference(first: Sequence, second: Sequence) -> int:
    """Where two texts (or id lists) first differ (the shorter one's length where it is the
    other's start)."""
    pairs = zip(first, second, strict=False)
    return next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(first), len(second)))


def stability(source: str | None, name: str, **context: Any) -> str:
    """What `kvgraft info` says of a model's template: "none", "stable" (a conversation
    reuses every earlier turn), or how it rewrites earlier turns (rewritten_turns)."""
    if not source:
        return "none"
    try:
        return ChatTemplate(source, name).rewritten_turns(**context) or "stable"
    except TemplateFailure as failure:
        return str(failure)
    except Exception as error:  # never the load's failure: Info says it
        return f"{name}'s chat template could not be probed ({type(error).__name__}: {error})"


def _plain(value: Any) -> Any:
    """`value` rebuilt of plain JSON types (a subclass's value as its base type's)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, str):  # subclasses (enums): the value, none of their methods
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if callable(getattr(value, "item", None)):  # a numpy scalar
        return _plain(value.item())
    raise TemplateFailure(f"a chat template reads plain data only, not {type(value).__name__}")


def _with_reasoning(message: Any) -> Any:
    if not isinstance(message, dict):
        return message
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}
