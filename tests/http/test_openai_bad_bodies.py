"""Bodies that once broke the OpenAI API, and the words of its refusals (issue 47).

One tiny-model daemon serves the module (tests.http.tiny_daemon: it fails the module if
its log holds a traceback). Each body here was a 500 with a traceback, or an answer that
meant something else than asked; each is now a 400 in OpenAI's error JSON whose message
and `param` name the field as the client sent it:

* nesting past Python's recursion limit, in the body or inside a message's content, and
  nesting past MAX_JSON_DEPTH that Python could still read;
* a lone surrogate ("\\ud800") in any text the engine would carry;
* integers past their proto fields (top_k a uint32, max_tokens, token ids) or past a
  float (temperature 10**400), an integer Python will not read (5,000 digits), NaN;
* values that become another meaning as the engine's float32: temperature 1e-300 is 0
  (read as 1.0), top_p 1e-300 is 0 (read as "keep every token").

And OpenAI's words: `max_tokens` is called max_tokens (not max_new_tokens), `param` is
set, a model not served is `model_not_found`, a prompt past the context is
`context_length_exceeded`; the official `openai` package reads them.
"""

from __future__ import annotations

import json

import httpx2
import openai
import pytest

from kvgraft.sampling import MIN_TOP_P
from kvgraftd.http.openai_requests import MAX_JSON_DEPTH
from tests.http.model_daemon import assert_error
from tests.http.tiny_daemon import MAX_CONTEXT_TOKENS, TINY_MODEL, tiny_daemon

DEEP = 100_000  # far past Python's recursion limit (1000)
PROMPT = [5, 17, 301, 42]  # token ids of the tiny model's vocabulary (512)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with tiny_daemon(tmp_path_factory.mktemp("bad-bodies") / "data") as started:
        yield started


@pytest.fixture(scope="module")
def http(daemon):
    with httpx2.Client(base_url=daemon.http_url, timeout=60) as client:
        yield client


def chat_body(**fields) -> dict:
    body = {"model": TINY_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return {**body, **fields}


def completion_body(**fields) -> dict:
    body = {"model": TINY_MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    return {**body, **fields}


def post_raw(http: httpx2.Client, path: str, raw: bytes) -> httpx2.Response:
    return http.post(path, content=raw, headers={"content-type": "application/json"})


def assert_refused(response: httpx2.Response, param: str | None, *names: str) -> dict:
    """A 400 invalid_request_error naming `names`, with OpenAI's `param` set to `param`."""
    error = assert_error(response, 400, *names)
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "invalid_argument",
        param,
    ), error
    assert "Traceback" not in error["message"]
    return error


# ----------------------------------------------------------------------------------------
# item 3: 500s with a traceback


def _deep_content() -> bytes:
    """A valid chat body whose content nests DEEP arrays (well-formed JSON)."""
    body = json.dumps(chat_body(messages=[{"role": "user", "content": "@"}]))
    return body.replace('"@"', "[" * DEEP + "]" * DEEP).encode()


def _nested(depth: int) -> bytes:
    """A completion body (one level) with an unknown field nesting `depth` arrays in it:
    well within what Python reads."""
    body = json.dumps(completion_body())
    return f'{body[:-1]}, "extra": {"[" * depth}{"]" * depth}}}'.encode()


DEEP_BODIES = {
    "100,000 [": b"[" * DEEP,
    '100,000 {"a":': b'{"a":' * DEEP,
    "100,000 [] inside content": _deep_content(),
    f"{MAX_JSON_DEPTH + 1} levels": _nested(MAX_JSON_DEPTH),
}


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("case", DEEP_BODIES, ids=list(DEEP_BODIES))
def test_deep_nesting_is_400(http, path, case) -> None:
    refused = post_raw(http, path, DEEP_BODIES[case])
    assert_refused(refused, None, f"more than {MAX_JSON_DEPTH} levels deep")


def test_nesting_up_to_the_limit_is_served(http) -> None:
    served = post_raw(http, COMPLETIONS, _nested(MAX_JSON_DEPTH - 1))  # the body is a level
    assert served.status_code == 200, served.text


SURROGATE = "\ud800x"  # json.dumps writes it as the escape "\ud800": valid JSON, not text
SURROGATES = {
    "chat content": (CHAT, chat_body(messages=[{"role": "user", "content": SURROGATE}])),
    "a content part": (
        CHAT,
        chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]),
    ),
    "a prompt": (COMPLETIONS, completion_body(prompt=SURROGATE)),
    "a stop string": (COMPLETIONS, completion_body(stop=["ok", SURROGATE])),
    "kvgraft.graft": (COMPLETIONS, completion_body(kvgraft={"graft": SURROGATE})),
}
SURROGATE_PARAMS = {
    "chat content": "messages[0].content",
    "a content part": "messages[0].content",
    "a prompt": "prompt",
    "a stop string": "stop",
    "kvgraft.graft": "kvgraft.graft",
}


@pytest.mark.parametrize("case", SURROGATES, ids=list(SURROGATES))
def test_a_lone_surrogate_is_400(http, case) -> None:
    path, body = SURROGATES[case]
    param = SURROGATE_PARAMS[case]
    refused = post_raw(http, path, json.dumps(body).encode())
    assert_refused(refused, param, param, "lone surrogate", "\\ud800")


HUGE_NUMBERS = {
    "top_k 2^32": ({"top_k": 2**32, "temperature": 1}, "top_k", "4294967295"),
    "top_k 2^64": ({"top_k": 2**64, "temperature": 1}, "top_k", "4294967295"),
    "max_tokens 10^12": ({"max_tokens": 10**12}, "max_tokens", "4096"),
    "temperature 10^400": ({"temperature": 10**400}, "temperature", "0..2"),
    "a token id 2^40": ({"prompt": [5, 2**40]}, "prompt", "4294967295"),
    "seed 2^64": ({"seed": 2**64}, "seed", "18446744073709551615"),
}


@pytest.mark.parametrize("case", HUGE_NUMBERS, ids=list(HUGE_NUMBERS))
def test_a_number_past_its_field_is_400(http, case) -> None:
    fields, param, bound = HUGE_NUMBERS[case]
    refused = http.post(COMPLETIONS, json=completion_body(**fields))
    assert_refused(refused, param, param, bound)


def test_what_python_json_reads_beyond_json_is_400(http) -> None:
    body = json.dumps(completion_body(temperature=0.5))
    for literal in ("NaN", "Infinity", "-Infinity"):
        refused = post_raw(http, COMPLETIONS, body.replace("0.5", literal).encode())
        assert_refused(refused, None, literal, "not a JSON number")
    long_number = body.replace("0.5", "9" * 5000).encode()  # Python reads 4300 digits at most
    assert_refused(post_raw(http, COMPLETIONS, long_number), None, "4300 digits")


def test_a_role_that_is_not_a_string_is_400(http) -> None:
    for role in (["user"], {"user": 1}):
        refused = http.post(CHAT, json=chat_body(messages=[{"role": role, "content": "hi"}]))
        assert_refused(refused, "messages[0].role", "messages[0].role")


# ----------------------------------------------------------------------------------------
# item 4: values that are another meaning as the engine's float32


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_temperature_that_is_0_as_a_float32_is_400(http, path) -> None:
    body = chat_body if path == CHAT else completion_body
    refused = http.post(path, json=body(temperature=1e-300))
    error = assert_refused(refused, "temperature", "temperature 1e-300", "0.0001", "1.0")
    assert "send 0 to decode greedily" in error["message"]
    # above float32's range for 0, below the least the engine samples at: the same words
    assert_refused(http.post(path, json=body(temperature=1e-5)), "temperature", "0.0001")


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_top_p_that_is_0_as_a_float32_is_400(http, path) -> None:
    body = chat_body if path == CHAT else completion_body
    refused = http.post(path, json=body(temperature=1, top_p=1e-300))
    assert_refused(refused, "top_p", "top_p 1e-300", f"{MIN_TOP_P:.4g}", "keep every token")


def test_the_least_values_sample_as_asked(http) -> None:
    """top_p MIN_TOP_P keeps the likeliest token only: the greedy answer, token for token;
    temperature 0.0001 (9.99999975e-05 as a float32) is served."""
    greedy = http.post(COMPLETIONS, json=completion_body(max_tokens=8))
    least_p = http.post(
        COMPLETIONS, json=completion_body(max_tokens=8, temperature=1.5, top_p=MIN_TOP_P, seed=3)
    )
    assert greedy.status_code == least_p.status_code == 200, least_p.text
    ids = [r.json()["kvgraft"]["receipt"]["generated_token_ids"] for r in (greedy, least_p)]
    assert ids[0] == ids[1] and len(ids[0]) == 8
    cold = http.post(COMPLETIONS, json=completion_body(temperature=0.0001, seed=3))
    assert cold.status_code == 200, cold.text


# ----------------------------------------------------------------------------------------
# item 7: OpenAI's words


def test_max_tokens_past_the_limit_is_named_as_sent(daemon) -> None:
    api = openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="none", max_retries=0)
    for name in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as refused:
            api.chat.completions.create(
                model=TINY_MODEL, messages=[{"role": "user", "content": "hi"}], **{name: 40000}
            )
        error = refused.value
        assert (error.status_code, error.param, error.code) == (400, name, "invalid_argument")
        assert f"{name} must be a whole number in 1..4096" in error.message
        assert "max_new_tokens" not in error.message


PARAMS = {
    "temperature": {"temperature": "hot"},
    "top_p": {"top_p": 1.5},
    "top_k": {"top_k": -2},
    "n": {"n": 3},
    "stop": {"stop": ["a", "b", "c", "d", "e"]},
    "logprobs": {"logprobs": "yes"},
    "top_logprobs": {"logprobs": True, "top_logprobs": 21},
    "seed": {"seed": -1},
    "stream": {"stream": "yes"},
    "model": {"model": ""},
    "messages": {"messages": []},
    "messages[0].role": {"messages": [{"role": "tool", "content": "x"}]},
    "kvgraft.keep": {"kvgraft": {"keep": 1}},
    "frequency_penalty": {"frequency_penalty": 0.5},
}


@pytest.mark.parametrize("param", PARAMS, ids=list(PARAMS))
def test_every_refusal_sets_param(http, param) -> None:
    assert_refused(http.post(CHAT, json=chat_body(**PARAMS[param])), param, param)


def test_a_model_not_served_is_model_not_found(daemon) -> None:
    api = openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError) as refused:
        api.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    error = refused.value
    assert (error.status_code, error.code, error.param) == (404, "model_not_found", "model")
    assert "'gpt-4'" in error.message and TINY_MODEL in error.message


@pytest.mark.parametrize("max_tokens", [10, 1])
def test_a_prompt_past_the_context_is_context_length_exceeded(http, max_tokens) -> None:
    prompt = [7] * (MAX_CONTEXT_TOKENS + 1 - max_tokens)  # one token too many, with max_tokens
    refused = http.post(COMPLETIONS, json=completion_body(prompt=prompt, max_tokens=max_tokens))
    error = assert_error(refused, 400, f"max_context_tokens={MAX_CONTEXT_TOKENS}")
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "context_length_exceeded",
        "prompt",
    )
    fits = http.post(COMPLETIONS, json=completion_body(prompt=prompt[1:], max_tokens=max_tokens))
    assert fits.status_code == 200, fits.text
