"""Both completion endpoints of a real daemon, fed any JSON by Hypothesis: never a 5xx.

One tiny-model daemon (tests.http.tiny_daemon: token-id prompts compute for real, with a
small max_context_tokens so that none computes for long; chat bodies are read whole, then
refused for the missing template) gets, on `POST /v1/chat/completions` and
`POST /v1/completions`:

* any JSON value as the body (objects, arrays, strings with lone surrogates, huge and
  negative integers, floats from 1e-300 to 1e300, NaN and Infinity as Python writes them);
* valid bodies with some fields, top-level or nested (a message's role and content, the
  `kvgraft` extensions, stream_options), set to a weird value: the above, integers at
  and past the uint32 and uint64 bounds, denormals, strings too long, nesting 100,000
  deep (spliced into the JSON text, which Python could not write) and just past
  MAX_JSON_DEPTH;
* raw bytes: deep `[`, cut JSON, bytes that are not UTF-8.

After each request: the status is below 500; the body, a stream's events included, holds
no "internal" error code and no traceback. At the end the daemon's log holds no
traceback. Bounded: EXAMPLES per strategy, derandomized (the same cases every run), a
deadline on every request; about 20 s here.
"""

from __future__ import annotations

import json
import math

import httpx2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgraftd.http.openai_requests import MAX_JSON_DEPTH
from tests.http.tiny_daemon import TINY_MODEL, tiny_daemon
from tests.support.fuzz_settings import fuzz_settings

EXAMPLES = 80
FUZZ = fuzz_settings(EXAMPLES)
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
REQUEST_TIMEOUT_S = 30.0
# Stand-ins for values json.dumps cannot write, spliced into its text afterwards.
DEEP_MARK, DEEP = "\x00deep-100000\x00", 100_000
JUST_TOO_DEEP_MARK = "\x00deep-limit\x00"


def _splice(text: str) -> str:
    deep = "[" * DEEP + "]" * DEEP
    too_deep = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    return text.replace(json.dumps(DEEP_MARK), deep).replace(
        json.dumps(JUST_TOO_DEEP_MARK), too_deep
    )


# ----------------------------------------------------------------------------------------
# values

EDGE_NUMBERS = [
    0, 1, -1, 2, 4096, 4097, 2**31, 2**32 - 1, 2**32, 2**63, 2**64 - 1, 2**64, 10**12,
    10**400, -(2**64), 0.0, -0.0, 1e-300, 1e-45, 1e-40, 1.4e-45, 1e-5, 1e-4, 0.5, 1.0,
    1.0000001, 2.0, 2.0000001, 1e300, math.inf, -math.inf, math.nan,
]  # fmt: skip
EDGE_TEXTS = [
    "", " ", "\ud800x", "x\udfff", "\ud83d\ude00", "\x00", "<|im_end|>", "é" * 300,
    "a" * 5000, "tiny:0", "0" * 64, "user", "text",
]  # fmt: skip
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(EDGE_NUMBERS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(EDGE_TEXTS),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
# nesting in 1 of 10 weird values: each refuses the whole body, which tells little else
weird = st.integers(0, 9).flatmap(
    lambda i: st.sampled_from([DEEP_MARK, JUST_TOO_DEEP_MARK]) if i == 9 else json_values
)

# Values that reach deep code (a token-id prompt the tiny model takes, a short answer)
PLAUSIBLE = {
    "prompt": st.lists(st.integers(0, 511), min_size=1, max_size=12),
    "max_tokens": st.integers(1, 4),
    "temperature": st.sampled_from([0, 0.7, 1.5, 1e-4, 2]),
    "top_p": st.sampled_from([1, 0.5, 1e-45, 2.0**-149]),
    "top_k": st.sampled_from([0, -1, 1, 5]),
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.sampled_from([None, " 7", ["a", "b"]]),
    "logprobs": st.sampled_from([None, True, False, 0, 5]),
    "stream": st.booleans(),
}
TOP_FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "n", "stop", "logprobs", "top_logprobs", "seed", "stream",
    "stream_options", "echo", "suffix", "kvgraft", "frequency_penalty", "presence_penalty",
    "logit_bias", "tools", "tool_choice", "response_format", "modalities", "user",
]  # fmt: skip
NESTED_FIELDS = [
    ("messages", 0, "role"), ("messages", 0, "content"), ("kvgraft", "graft"),
    ("kvgraft", "no_cache"), ("kvgraft", "deposit"), ("kvgraft", "keep"),
    ("stream_options", "include_usage"),
]  # fmt: skip


def _valid(endpoint: str) -> dict:
    body: dict = {"model": TINY_MODEL, "max_tokens": 2, "kvgraft": {}, "stream_options": {}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = [5, 17, 301]
    return body


@st.composite
def mutated_bodies(draw, endpoint: str) -> str:
    """A valid body of `endpoint` with plausible values in some fields (they reach the
    engine) and weird values in at most two (a body refused for its first weird field
    tells nothing about the others)."""
    body = _valid(endpoint)
    for name in draw(st.lists(st.sampled_from(sorted(PLAUSIBLE)), max_size=4, unique=True)):
        body[name] = draw(PLAUSIBLE[name])
    for name in draw(st.lists(st.sampled_from(TOP_FIELDS), max_size=2, unique=True)):
        body[name] = draw(weird)
    for path in draw(st.lists(st.sampled_from(NESTED_FIELDS), max_size=1)):
        target = body
        for key in path[:-1]:  # through what the top-level mutations left
            if isinstance(key, int):
                target = target[key] if isinstance(target, list) and len(target) > key else None
            else:
                target = target.get(key) if isinstance(target, dict) else None
        if isinstance(target, dict):
            target[path[-1]] = draw(weird)
    return _splice(json.dumps(body))  # NaN and Infinity as Python writes them


raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"[" * DEEP, b'{"a":' * DEEP, b'{"model": ', b"\xff\xfe{}", b"", b"null"]),
)


# ----------------------------------------------------------------------------------------
# the daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with tiny_daemon(tmp_path_factory.mktemp("http-fuzz") / "data") as started:  # no traceback
        yield started


@pytest.fixture(scope="module")
def http(daemon):
    with httpx2.Client(base_url=daemon.http_url, timeout=REQUEST_TIMEOUT_S) as client:
        yield client


def _post(http: httpx2.Client, path: str, raw: bytes) -> None:
    """One request; fail on a 5xx, an internal error (a stream's too) or a traceback."""
    headers = {"content-type": "application/json"}
    with http.stream("POST", path, content=raw, headers=headers) as response:
        text = response.read().decode()
    assert response.status_code < 500, f"{response.status_code} for {raw[:300]!r}: {text}"
    assert '"code":"internal"' not in text and "Traceback" not in text, text
    if response.status_code >= 400:
        assert json.loads(text)["error"]["message"], text


@pytest.mark.parametrize("endpoint", PATHS)
def test_any_json_body_gets_a_clear_answer(http, endpoint) -> None:
    @FUZZ
    @given(value=json_values)
    def run(value) -> None:
        _post(http, PATHS[endpoint], json.dumps(value).encode())

    run()


@pytest.mark.parametrize("endpoint", PATHS)
def test_weird_fields_get_a_clear_answer(http, endpoint) -> None:
    @FUZZ
    @given(text=mutated_bodies(endpoint))
    def run(text: str) -> None:
        _post(http, PATHS[endpoint], text.encode())

    run()


@pytest.mark.parametrize("endpoint", PATHS)
def test_raw_bytes_get_a_clear_answer(http, endpoint) -> None:
    @settings(FUZZ, max_examples=EXAMPLES // 4)
    @given(raw=raw_bodies)
    def run(raw: bytes) -> None:
        _post(http, PATHS[endpoint], raw)

    run()
