"""The OpenAI-compatible API's refusals: 401, 400, 404, 413 and 429, in OpenAI's error JSON.

One guarded daemon serves the module: a bearer token, one request computing at a time
and no queue, so a second request while one streams is refused at once. Every refusal
is `{"error": {"message", "type", "code"}}` with the status OpenAI's clients expect and
a message that names what to fix; none leaves a traceback in the daemon's log.
"""

from __future__ import annotations

import json

import httpx2
import openai
import pytest

from tests.http.model_daemon import DONE, assert_error, model_daemon, sse_lines

TOKEN = "kvgraft-http-test-token-93c1e0a7"
MAX_REQUEST_BYTES = 4 << 20  # the least max_request_bytes the daemon accepts
LONG_ANSWER = [{"role": "user", "content": "Count from 1 to 300, separated by commas."}]
LONG_TOKENS = 400  # runs for seconds even on a fast machine (it counts on past 400 tokens):
# the second request must meet it still running


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    home = tmp_path_factory.mktemp("openai-errors")
    token_file = home / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    guarded = [
        "--token-file",
        str(token_file),
        "--max-running-contexts",
        "1",
        "--max-queued-requests",
        "0",
        "--max-request-bytes",
        str(MAX_REQUEST_BYTES),
    ]
    with model_daemon(home / "data", guarded) as started:
        yield started
    assert "Traceback" not in started.log()


@pytest.fixture(scope="module")
def http(daemon):
    with httpx2.Client(
        base_url=daemon.http_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120
    ) as client:
        yield client


@pytest.fixture(scope="module")
def model_id(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def chat_body(model_id: str, **fields) -> dict:
    body = {
        "model": model_id,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 4,
        "temperature": 0,
    }
    body.update(fields)
    return body


def test_the_token_is_required_except_for_health(daemon) -> None:
    base_url = daemon.http_url + "/v1"
    # no key at all (the openai package refuses to send none: raw requests)
    for route in ("/models", "/chat/completions"):
        bare = httpx2.request("GET" if route == "/models" else "POST", base_url + route, timeout=30)
        error = assert_error(bare, 401, "token")
        assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
    wrong = openai.OpenAI(base_url=base_url, api_key="wrong-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.models.list()
    assert refused.value.status_code == 401
    assert refused.value.body["code"] == "invalid_api_key"
    api = openai.OpenAI(base_url=base_url, api_key=TOKEN, max_retries=0)
    model_id = api.models.list().data[0].id
    answer = api.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Say hi."}], max_tokens=2
    )
    assert 0 < answer.usage.completion_tokens <= 2
    health = httpx2.get(daemon.http_url + "/health", timeout=30)
    assert (health.status_code, health.json()) == (200, {"status": "ready"})


FIVE_STOPS = ["a", "b", "c", "d", "e"]
BAD_BODIES = {
    "missing messages": ({"messages": None}, "messages"),
    "messages not a list": ({"messages": "Say hi."}, "messages"),
    "a bad role": ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    "temperature a word": ({"temperature": "hot"}, "temperature"),
    "three choices": ({"n": 3}, "n=3"),
    "no tokens": ({"max_tokens": 0}, "max_tokens"),
    "top_p above 1": ({"top_p": 1.5}, "top_p"),
    "five stop strings": ({"stop": FIVE_STOPS}, "stop"),
    "an unknown extension": ({"kvgraft": {"colour": "blue"}}, "kvgraft.colour"),
}


@pytest.mark.parametrize("case", BAD_BODIES, ids=list(BAD_BODIES))
def test_a_bad_body_is_400_naming_the_field(http, model_id, case) -> None:
    fields, named = BAD_BODIES[case]
    body = {k: v for k, v in chat_body(model_id, **fields).items() if v is not None}
    error = assert_error(http.post("/v1/chat/completions", json=body), 400, named)
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_argument")


def test_a_body_that_is_not_json_is_400(http) -> None:
    refused = http.post(
        "/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert assert_error(refused, 400, "JSON")["type"] == "invalid_request_error"


def test_an_unknown_model_or_route_is_404(http, model_id) -> None:
    unknown = http.post("/v1/chat/completions", json=chat_body("gpt-4"))
    assert assert_error(unknown, 404, "'gpt-4'", model_id)["type"] == "not_found_error"
    assert_error(http.post("/v1/embeddings", json={"input": "hi"}), 404, "/v1/embeddings")
    assert_error(http.get("/v1/models/gpt-4"), 404, "'gpt-4'")


def test_a_body_over_max_request_bytes_is_413(http, model_id) -> None:
    body = chat_body(model_id, messages=[{"role": "user", "content": "x" * MAX_REQUEST_BYTES}])
    refused = http.post("/v1/chat/completions", content=json.dumps(body).encode())
    assert_error(refused, 413, "max_request_bytes", str(MAX_REQUEST_BYTES))
    # without a Content-Length (chunked): counted as it arrives
    encoded = json.dumps(body).encode()
    pieces = (encoded[at : at + (1 << 20)] for at in range(0, len(encoded), 1 << 20))
    chunked = http.post("/v1/chat/completions", content=pieces)
    assert_error(chunked, 413, "max_request_bytes")
    assert http.post("/v1/chat/completions", json=chat_body(model_id)).status_code == 200


def test_a_request_beyond_the_queue_is_429_with_retry_after(http, model_id) -> None:
    long_body = chat_body(model_id, messages=LONG_ANSWER, max_tokens=LONG_TOKENS, stream=True)
    with http.stream("POST", "/v1/chat/completions", json=long_body) as running:
        assert running.status_code == 200
        events = sse_lines(running)
        first = json.loads(next(events))
        assert first["choices"][0]["finish_reason"] is None
        # the one running slot is taken and nothing may wait: refused at once
        refused = http.post("/v1/chat/completions", json=chat_body(model_id))
        error = assert_error(refused, 429, "max_running_contexts")
        assert (error["type"], refused.headers["retry-after"]) == ("rate_limit_error", "1")
        rest = list(events)
    assert rest[-1] == DONE
    last = json.loads(rest[-2])
    assert last["choices"][0]["finish_reason"] == "length"
    assert len(last["kvgraft"]["receipt"]["generated_token_ids"]) == LONG_TOKENS
    assert http.post("/v1/chat/completions", json=chat_body(model_id)).status_code == 200


def test_the_log_has_no_traceback(daemon) -> None:
    assert "Traceback" not in daemon.log()
