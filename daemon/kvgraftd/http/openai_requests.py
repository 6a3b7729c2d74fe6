"""OpenAI's request bodies read into the engine's requests: every field checked, by name.

`chat_request` reads a `POST /v1/chat/completions` body, `completion_request` a
`POST /v1/completions` body; each gives a `Call`: the gRPC request the engine service
runs (a GenerateRequest, or a GraftRequest when the body's `kvgraft.graft` names an
artifact) and what the response needs (stream, usage, logprobs). Field for field as
OpenAI's API reference spells them, so the official `openai` package works unchanged:

* `temperature` 0 decodes greedily; absent, it is OpenAI's 1.0. A sampled request
  without a `seed` gets a random one, which its receipt records: every answer can be
  reproduced.
* `max_tokens` and `max_completion_tokens` are one limit (default DEFAULT_MAX_TOKENS).
* `n` other than 1, tools, logit bias, penalties other than 0 and response formats other
  than text are refused by name (400): the engine does not do them, and a silent
  difference would be a wrong answer. Unknown fields are ignored, as SDKs add new ones.
* The `kvgraft` object (`extra_body` in the `openai` package) carries the extensions:
  `no_cache`, `deposit`, `graft`, `allow_untrusted`, `keep`.

Every problem is an InvalidArgument naming the field and the fix (the HTTP layer turns
it into OpenAI's error JSON with status 400). Nothing here touches the engine.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from kvgraft.errors import InvalidArgument
from kvgraft.v1 import kvgraft_pb2 as pb

DEFAULT_MAX_TOKENS = 1024
MAX_SEED = 2**64 - 1
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


def chat_request(body: Any, keep_default: bool) -> Call:
    """A chat completion body; `keep_default`: whether conversations are kept (chat_cache)."""
    body = _object(body, "the request body")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages must be a non-empty array of {role, content} objects")
    conversation = pb.Conversation(
        messages=[_message(message, index) for index, message in enumerate(messages)]
    )
    return _call(body, pb.Prompt(conversation=conversation), keep_default, chat=True)


def completion_request(body: Any) -> Call:
    """A (legacy) completion body: `prompt` a string or an array of token ids."""
    body = _object(body, "the request body")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        wire = pb.Prompt(text=prompt)
    elif isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        wire = pb.Prompt(tokens=pb.TokenIds(ids=prompt))
    else:
        raise InvalidArgument(
            "prompt must be a non-empty string or a non-empty array of token ids (one "
            "prompt: send batches as separate requests)"
        )
    if body.get("echo"):
        raise InvalidArgument("echo is not supported: the response holds the completion only")
    if body.get("suffix"):
        raise InvalidArgument("suffix is not supported: this model completes at the end only")
    return _call(body, wire, keep_default=False, chat=False)


def _call(body: dict, prompt: pb.Prompt, keep_default: bool, chat: bool) -> Call:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidArgument("model is required: GET /v1/models lists the served model")
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise InvalidArgument(f"{name} is not supported by kvgraft; leave it out")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise InvalidArgument("response_format other than text is not supported; leave it out")
    n = body.get("n", 1)
    if n not in (1, None):
        raise InvalidArgument(f"n={n!r}: kvgraft returns one choice per request; send n=1")
    extensions = _extensions(body.get("kvgraft"))
    options = _options(body, chat, keep_default and not extensions.get("deposit"))
    for name in ("no_cache", "deposit", "allow_untrusted", "keep"):
        if name in extensions:
            setattr(options, name, extensions[name])
    stream = _flag(body, "stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise InvalidArgument('stream_options must be an object, e.g. {"include_usage": true}')
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
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is None:
        limit = DEFAULT_MAX_TOKENS
    if not _is_int(limit) or limit < 1:
        raise InvalidArgument(f"max_tokens must be a whole number of at least 1, not {limit!r}")
    options.max_new_tokens = limit
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    if temperature == 0:
        options.greedy = True
    else:
        options.greedy = False
        options.temperature = temperature
        seed = body.get("seed")
        if seed is None:
            seed = secrets.randbits(63)  # the receipt records it: the answer can be replayed
        if not _is_int(seed) or not 0 <= seed <= MAX_SEED:
            raise InvalidArgument(f"seed must be a whole number in 0..2^64-1, not {seed!r}")
        options.seed = seed
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise InvalidArgument("top_p must be above 0 (1 keeps every token)")
    options.top_p = top_p
    top_k = body.get("top_k", 0)
    if top_k == -1:
        top_k = 0  # vLLM's spelling of "all"
    if not _is_int(top_k) or top_k < 0:
        raise InvalidArgument(f"top_k must be a whole number, 0 (or -1) for all, not {top_k!r}")
    options.top_k = top_k
    options.stop.extend(_stops(body.get("stop")))
    _logprobs(body, chat, options)
    return options


def _logprobs(body: dict, chat: bool, options: pb.GenerateOptions) -> None:
    """Chat: `logprobs` true and `top_logprobs` 0-20. Completions: `logprobs` N (0-5)."""
    logprobs = body.get("logprobs")
    if chat:
        if logprobs not in (None, True, False):
            raise InvalidArgument("logprobs must be true or false")
        top = body.get("top_logprobs")
        if top is not None:
            if not _is_int(top) or not 0 <= top <= 20:
                raise InvalidArgument(f"top_logprobs must be a whole number in 0..20, not {top!r}")
            if not logprobs:
                raise InvalidArgument("top_logprobs needs logprobs: true")
            options.top_logprobs = top
        options.logprobs = bool(logprobs)
    elif logprobs is not None:
        if not _is_int(logprobs) or not 0 <= logprobs <= 5:
            raise InvalidArgument(f"logprobs must be a whole number in 0..5, not {logprobs!r}")
        options.logprobs = True
        options.top_logprobs = logprobs


def _message(message: Any, index: int) -> pb.ChatMessage:
    if not isinstance(message, dict):
        raise InvalidArgument(f"messages[{index}] must be an object with role and content")
    role = message.get("role")
    if role not in ROLES:
        raise InvalidArgument(
            f"messages[{index}].role {role!r} is not supported: use system, developer, user or "
            "assistant (tool calls are not supported)"
        )
    content = message.get("content")
    if isinstance(content, list):  # content parts: text ones only
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise InvalidArgument(
                f"messages[{index}].content: only text parts are supported (no images or audio)"
            )
        content = "".join(str(part.get("text", "")) for part in content)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise InvalidArgument(f"messages[{index}].content must be a string or text parts")
    return pb.ChatMessage(role=ROLES[role], content=content)


def _stops(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidArgument("stop must be a string or an array of up to 4 strings")
    return [s for s in stops if s]  # "" stops nothing


def _extensions(value: Any) -> dict:
    if value is None:
        return {}
    extensions = _object(value, "kvgraft")
    unknown = sorted(set(extensions) - set(EXTENSIONS))
    if unknown:
        raise InvalidArgument(
            f"kvgraft.{unknown[0]} is not an extension: use {', '.join(EXTENSIONS)}"
        )
    for name in ("no_cache", "deposit", "allow_untrusted", "keep"):
        if name in extensions and not isinstance(extensions[name], bool):
            raise InvalidArgument(f"kvgraft.{name} must be true or false")
    graft = extensions.get("graft")
    if graft is not None and (not isinstance(graft, str) or not graft):
        raise InvalidArgument("kvgraft.graft must be an artifact id (or a unique prefix of one)")
    return extensions


def _object(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what} must be a JSON object")
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be true or false")
    return value


def _number(body: dict, name: str, default: float, least: float, most: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{name} must be a number in {least:g}..{most:g}")
    if not least <= value <= most:
        raise InvalidArgument(f"{name} {value:g} is outside {least:g}..{most:g}")
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
