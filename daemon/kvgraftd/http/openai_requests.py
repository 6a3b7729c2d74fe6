"""OpenAI's request bodies read into the engine's requests: every field checked, by name.

`parse_body` reads a body's bytes as strict JSON (no NaN or Infinity, nested at most
MAX_JSON_DEPTH levels, so no later walk of it can recurse too deep). `chat_request` reads
a `POST /v1/chat/completions` body, `completion_request` a `POST /v1/completions` body;
each gives a `Call`: the gRPC request the engine service runs (a GenerateRequest, or a
GraftRequest when the body's `kvgraft.graft` names an artifact) and what the response
needs (stream, usage, logprobs). Field for field as OpenAI's API reference spells them,
so the official `openai` package works unchanged:

* `temperature` 0 decodes greedily; absent, it is OpenAI's 1.0. A sampled request
  without a `seed` gets a random one, which its receipt records: every answer can be
  reproduced.
* `max_tokens` and `max_completion_tokens` are one limit (default DEFAULT_MAX_TOKENS).
* `n` other than 1, tools, logit bias, penalties other than 0 and response formats other
  than text are refused by name (400): the engine does not do them, and a silent
  difference would be a wrong answer. Unknown fields are ignored, as SDKs add new ones.
* The `kvgraft` object (`extra_body` in the `openai` package) carries the extensions:
  `no_cache`, `deposit`, `graft`, `allow_untrusted`, `keep`.

Every problem is an InvalidArgument naming the field as the client spelled it, in its
message and in its `param` (OpenAI's error `param`), with the fix; the HTTP layer turns it
into OpenAI's error JSON with status 400. A value is checked as what it becomes: within
its proto field and the engine's bounds (max_tokens at most MAX_NEW_TOKENS, top_k and
token ids uint32s), text that UTF-8 can carry (no lone surrogate), temperature and top_p
as the float32s the engine reads (kvgraft.sampling: 1e-300 is 0 there, which means the
default). So nothing this module passes fails later for its value, and the engine's own
checks, which speak gRPC's names (`max_new_tokens`), are never what an HTTP client reads.
Nothing here touches the engine.
"""

from __future__ import annotations

import json
import reprlib
import secrets
from dataclasses import dataclass
from typing import Any

from kvgraft.errors import InvalidArgument
from kvgraft.sampling import nucleus_mass, sampling_temperature
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.engine.requests.service import (
    MAX_NEW_TOKENS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
)

DEFAULT_MAX_TOKENS = 1024
MAX_SEED = 2**64 - 1  # GenerateOptions.seed is a uint64
MAX_UINT32 = 2**32 - 1  # top_k and token ids are uint32s
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound on a completion's `logprobs`
# OpenAI's bodies nest a few levels (messages[i].content[j].text); a tool's JSON Schema a
# dozen. 64 leaves room for any of them and keeps every walk of a body (==, repr, the
# depth check itself) far below Python's recursion limit of 1000.
MAX_JSON_DEPTH = 64
SHOWN_CHARS = 60  # of a refused name, in a message
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
EXTENSIONS = ("no_cache", "deposit", "graft", "allow_untrusted", "keep")
# Fields the engine does not do: refused unless they hold their neutral value.
NEUTRAL = {
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none", "auto"),
    "audio": (None,),
    "modalities": (None, ["text"]),
}


@dataclass(frozen=True)
class Call:
    """An engine request read from an HTTP body, and how its answer is written."""

    model: str
    request: pb.GenerateRequest | pb.GraftRequest
    stream: bool
    include_usage: bool  # streaming: a last chunk with the usage
    logprobs: bool
    chat: bool  # chat shapes (messages) rather than completion shapes (text)


def parse_body(raw: bytes | bytearray) -> Any:
    """The JSON value of a request body; InvalidArgument for anything but strict JSON
    nested at most MAX_JSON_DEPTH levels."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:  # 100,000 `[`: json's C parser stops at the recursion limit
        raise _too_deep() from None
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"the request body is not JSON ({exc}); send a JSON object") from None
    except UnicodeDecodeError as exc:
        raise InvalidArgument(
            f"the request body is not UTF-8 text ({exc}); send JSON in UTF-8"
        ) from None
    except ValueError as exc:  # an integer of more than 4300 digits
        raise InvalidArgument(
            f"the request body holds a number Python will not read ({str(exc).split(':')[0]}); "
            "send numbers of at most 4300 digits"
        ) from None
    _check_depth(body)
    return body


def chat_request(body: Any, keep_default: bool) -> Call:
    """A chat completion body; `keep_default`: whether conversations are kept (chat_cache)."""
    body = json_object(body, "the request body")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument(
            "messages must be a non-empty array of {role, content} objects", param="messages"
        )
    conversation = pb.Conversation(
        messages=[_message(message, index) for index, message in enumerate(messages)]
    )
    return _call(body, pb.Prompt(conversation=conversation), keep_default, chat=True)


def completion_request(body: Any) -> Call:
    """A (legacy) completion body: `prompt` a string or an array of token ids."""
    body = json_object(body, "the request body")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        wire = pb.Prompt(text=checked_text(prompt, "prompt"))
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        bad = next((t for t in prompt if not 0 <= t <= MAX_UINT32), None)
        if bad is not None:
            raise InvalidArgument(
                f"prompt holds {_shown(bad)}, which is not a token id (0..{MAX_UINT32})",
                param="prompt",
            )
        wire = pb.Prompt(tokens=pb.TokenIds(ids=prompt))
    else:
        raise InvalidArgument(
            "prompt must be a non-empty string or a non-empty array of token ids (one "
            "prompt: send batches as separate requests)",
            param="prompt",
        )
    if body.get("echo"):
        raise InvalidArgument(
            "echo is not supported: the response holds the completion only", param="echo"
        )
    if body.get("suffix"):
        raise InvalidArgument(
            "suffix is not supported: this model completes at the end only", param="suffix"
        )
    return _call(body, wire, keep_default=False, chat=False)


def _call(body: dict, prompt: pb.Prompt, keep_default: bool, chat: bool) -> Call:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidArgument(
            "model is required: GET /v1/models lists the served model", param="model"
        )
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise InvalidArgument(f"{name} is not supported by kvgraft; leave it out", param=name)
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise InvalidArgument(
            "response_format other than text is not supported; leave it out",
            param="response_format",
        )
    n = body.get("n", 1)
    if n not in (1, None) or isinstance(n, bool):
        raise InvalidArgument(
            f"n={_shown(n)}: kvgraft returns one choice per request; send n=1", param="n"
        )
    extensions = _extensions(body.get("kvgraft"))
    options = _options(body, chat, keep_default and not extensions.get("deposit"))
    for name in ("no_cache", "deposit", "allow_untrusted", "keep"):
        if name in extensions:
            setattr(options, name, extensions[name])
    stream = flag(body, "stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise InvalidArgument(
            'stream_options must be an object, e.g. {"include_usage": true}',
            param="stream_options",
        )
    include_usage = bool(stream_options.get("include_usage")) and stream
    graft = extensions.get("graft")
    request: pb.GenerateRequest | pb.GraftRequest
    if graft:
        request = pb.GraftRequest(artifact_id=graft, continuation=prompt, options=options)
    else:
        request = pb.GenerateRequest(prompt=prompt, options=options)
    # _logprobs sets `logprobs` whenever it sets top_logprobs (chat requires it, a
    # completion's N implies it)
    return Call(model, request, stream, include_usage, options.logprobs, chat)


def _options(body: dict, chat: bool, keep: bool) -> pb.GenerateOptions:
    options = pb.GenerateOptions(keep=keep)
    # the newer name first; either one, as the client sent it, in what it is told
    limit_name = next(
        (n for n in ("max_completion_tokens", "max_tokens") if body.get(n) is not None),
        "max_tokens",
    )
    limit = body.get(limit_name)
    if limit is None:
        limit = DEFAULT_MAX_TOKENS
    options.max_new_tokens = _whole(
        limit, limit_name, 1, MAX_NEW_TOKENS, f"the most this daemon generates is {MAX_NEW_TOKENS}"
    )
    seed = body.get("seed")
    if seed is not None:
        _whole(seed, "seed", 0, MAX_SEED)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    if temperature == 0:
        options.greedy = True
    else:
        options.greedy = False
        options.temperature = sampling_temperature(temperature, "temperature")
        # the receipt records a random seed: the answer can be replayed
        options.seed = secrets.randbits(63) if seed is None else seed
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise InvalidArgument("top_p must be above 0 (1 keeps every token)", param="top_p")
    options.top_p = nucleus_mass(top_p, "top_p")
    top_k = body.get("top_k", 0)
    if _is_int(top_k) and top_k == -1:
        top_k = 0  # vLLM's spelling of "all"
    options.top_k = _whole(top_k, "top_k", 0, MAX_UINT32, "0 (or -1) keeps every token")
    options.stop.extend(_stops(body.get("stop")))
    _logprobs(body, chat, options)
    return options


def _logprobs(body: dict, chat: bool, options: pb.GenerateOptions) -> None:
    """Chat: `logprobs` true and `top_logprobs` 0-20. Completions: `logprobs` N (0-5)."""
    logprobs = body.get("logprobs")
    if chat:
        if logprobs is not None and not isinstance(logprobs, bool):
            raise InvalidArgument("logprobs must be true or false", param="logprobs")
        top = body.get("top_logprobs")
        if top is not None:
            options.top_logprobs = _whole(top, "top_logprobs", 0, MAX_TOP_LOGPROBS)
            if not logprobs:
                raise InvalidArgument("top_logprobs needs logprobs: true", param="top_logprobs")
        options.logprobs = bool(logprobs)
    elif logprobs is not None:
        options.top_logprobs = _whole(logprobs, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
        options.logprobs = True


def _message(message: Any, index: int) -> pb.ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidArgument(f"{where} must be an object with role and content", param=where)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidArgument(
            f"{where}.role {_shown(role)} is not supported: use system, developer, user or "
            "assistant (tool calls are not supported)",
            param=f"{where}.role",
        )
    content = message.get("content")
    if isinstance(content, list):  # content parts: text ones only
        for part, value in enumerate(content):
            if not isinstance(value, dict) or value.get("type") != "text":
                raise InvalidArgument(
                    f"{where}.content[{part}]: only text parts are supported (no images or audio)",
                    param=f"{where}.content",
                )
            if not isinstance(value.get("text"), str):
                raise InvalidArgument(
                    f"{where}.content[{part}].text must be a string",
                    param=f"{where}.content",
                )
        content = "".join(part["text"] for part in content)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise InvalidArgument(
            f"{where}.content must be a string or text parts", param=f"{where}.content"
        )
    return pb.ChatMessage(role=ROLES[role], content=checked_text(content, f"{where}.content"))


def _stops(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        raise InvalidArgument(
            f"stop must be a string or an array of up to {MAX_STOP_STRINGS} strings of at most "
            f"{MAX_STOP_CHARS} characters",
            param="stop",
        )
    return [checked_text(s, "stop") for s in stops if s]  # "" stops nothing


def _extensions(value: Any) -> dict:
    if value is None:
        return {}
    extensions = json_object(value, "kvgraft")
    unknown = sorted(set(extensions) - set(EXTENSIONS))
    if unknown:
        name = f"kvgraft.{unknown[0][:SHOWN_CHARS]}"
        raise InvalidArgument(
            f"{name} is not an extension: use {', '.join(EXTENSIONS)}", param=name
        )
    for name in ("no_cache", "deposit", "allow_untrusted", "keep"):
        if name in extensions and not isinstance(extensions[name], bool):
            raise InvalidArgument(f"kvgraft.{name} must be true or false", param=f"kvgraft.{name}")
    graft = extensions.get("graft")
    if graft is not None and (not isinstance(graft, str) or not graft):
        raise InvalidArgument(
            "kvgraft.graft must be an artifact id (or a unique prefix of one)",
            param="kvgraft.graft",
        )
    if graft is not None:
        checked_text(graft, "kvgraft.graft")
    return extensions


def json_object(value: Any, what: str) -> dict:
    """`value` if it is a JSON object; InvalidArgument naming `what` otherwise."""
    if not isinstance(value, dict):
        param = None if what == "the request body" else what
        raise InvalidArgument(f"{what} must be a JSON object", param=param)
    return value


def flag(body: dict, name: str, default: bool = False) -> bool:
    """Field `name` of `body`: true or false (absent or null: `default`)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be true or false", param=name)
    return value


def _number(body: dict, name: str, default: float, least: float, most: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{name} must be a number in {least:g}..{most:g}", param=name)
    if not least <= value <= most:  # NaN too (Python's json reads it; parse_body does not)
        raise InvalidArgument(f"{name} {_shown(value)} is outside {least:g}..{most:g}", param=name)
    return float(value)


def _whole(value: Any, name: str, least: int, most: int, why: str = "") -> int:
    """`value` if it is a whole number in least..most; InvalidArgument naming `name`."""
    if _is_int(value) and least <= value <= most:
        return value
    hint = f" ({why})" if why else ""
    raise InvalidArgument(
        f"{name} must be a whole number in {least}..{most}{hint}, not {_shown(value)}", param=name
    )


def checked_text(value: str, name: str) -> str:
    """`value` if UTF-8 can carry it (protobuf's strings are UTF-8, so is the tokenizer's
    input): a lone surrogate such as JSON's "\\ud800" is refused."""
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(
            f"{name} holds a lone surrogate ({value[exc.start]!a} at character "
            f"{exc.start}), which is not text: escape a character beyond U+FFFF as a pair "
            '("\\ud83d\\ude00"), or send it unescaped in UTF-8',
            param=name,
        ) from None
    return value


def _check_depth(body: Any) -> None:
    """InvalidArgument if `body` nests more than MAX_JSON_DEPTH arrays and objects (walked
    with a stack of its own: this check cannot recurse too deep itself)."""
    stack = [(body, 0)] if isinstance(body, dict | list) else []
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value
        if depth == MAX_JSON_DEPTH:
            raise _too_deep()
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))


def _too_deep() -> InvalidArgument:
    return InvalidArgument(
        f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep; "
        "send a flatter body"
    )


def _refuse_constant(name: str) -> float:
    raise InvalidArgument(
        f"the request body is not JSON: {name} is not a JSON number; send a number"
    )


def _shown(value: Any) -> str:
    """`value` as a message quotes it: its repr, cut (reprlib: a long list or number is
    never written out whole)."""
    return reprlib.repr(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
