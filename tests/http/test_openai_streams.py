"""Server-sent events read by a client no one here wrote (raw httpx2), hang-ups and drains.

A stream is `data: {json}` events, each followed by a blank line, ending with
`data: [DONE]`; its text equals the non-streamed answer's, for chat and for completions.
A client that hangs up mid-stream has its request dropped before its answer is done,
and the daemon goes on serving without a traceback. A daemon told to stop (SIGTERM)
while a stream is in flight finishes that stream, then exits 0.
"""

from __future__ import annotations

import json
import signal
import time

import httpx2
import pytest

from tests.http.model_daemon import DONE, model_daemon, sse_events, sse_lines
from tests.support.metrics_scrape import unlabelled_metrics

QUESTION = [{"role": "user", "content": "What is the capital of Spain?"}]
LONG_ANSWER = [{"role": "user", "content": "Count from 1 to 300, separated by commas."}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    metrics = ["--metrics-listen", "127.0.0.1:0"]
    with model_daemon(tmp_path_factory.mktemp("openai-streams"), metrics) as started:
        yield started
    assert "Traceback" not in started.log()


@pytest.fixture(scope="module")
def http(daemon):
    with httpx2.Client(base_url=daemon.http_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model_id(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def streamed(http: httpx2.Client, path: str, body: dict) -> list[dict | str]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(response.read().decode())


def test_a_chat_stream_is_framed_as_server_sent_events(http, model_id) -> None:
    body = {"model": model_id, "messages": QUESTION, "max_tokens": 24, "temperature": 0}
    whole = http.post("/v1/chat/completions", json=body).json()
    events = streamed(http, "/v1/chat/completions", body)
    chunks = events[:-1]
    assert events[-1] == DONE and len(chunks) >= 2
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert last["kvgraft"]["receipt"] == whole["kvgraft"]["receipt"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert all("usage" not in c for c in chunks)  # only when include_usage asks


def test_a_completion_stream_has_the_same_text(http, model_id) -> None:
    body = {"model": model_id, "prompt": "The capital of Spain is", "max_tokens": 12}
    body |= {"temperature": 0, "stream_options": {"include_usage": True}}
    whole = http.post("/v1/completions", json=body).json()
    events = streamed(http, "/v1/completions", body)
    *chunks, usage, done = events
    assert done == DONE and {c["object"] for c in events[:-1]} == {"text_completion"}
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["kvgraft"]["receipt"] == whole["kvgraft"]["receipt"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    assert usage["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]


def test_a_client_that_hangs_up_mid_stream_is_dropped(http, model_id, daemon) -> None:
    steps_before = unlabelled_metrics(daemon)["kvgraft_batch_steps_total"]
    body = {"model": model_id, "messages": LONG_ANSWER, "max_tokens": 200, "temperature": 0}
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        events = sse_lines(response)
        assert [json.loads(next(events))["object"] for _ in range(2)] == [
            "chat.completion.chunk"
        ] * 2
    # closed after two chunks: the engine drops the request at its next step
    deadline = time.monotonic() + 60
    while (sample := unlabelled_metrics(daemon))["kvgraft_requests_running"]:
        assert time.monotonic() < deadline, "the hung-up request is still computing"
        time.sleep(0.05)
    # the whole answer would take 200 steps: its prompt's, then one per token after the first
    assert sample["kvgraft_batch_steps_total"] - steps_before < 200
    after = http.post("/v1/chat/completions", json={**body, "messages": QUESTION, "max_tokens": 4})
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4
    assert "Traceback" not in daemon.log()


def test_a_stream_in_flight_finishes_when_the_daemon_is_told_to_stop(tmp_path) -> None:
    # a drain long enough for the answer even on a loaded machine (30 s by default)
    draining = ["--drain-s", "300"]
    with model_daemon(tmp_path / "data", draining) as daemon, httpx2.Client(timeout=300) as http:
        model_id = http.get(daemon.http_url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model_id, "messages": LONG_ANSWER, "max_tokens": 64, "temperature": 0}
        url = daemon.http_url + "/v1/chat/completions"
        with http.stream("POST", url, json={**body, "stream": True}) as response:
            events = sse_lines(response)
            assert json.loads(next(events))["choices"][0]["finish_reason"] is None
            daemon.proc.send_signal(signal.SIGTERM)
            rest = list(events)
        assert rest[-1] == DONE
        last = json.loads(rest[-2])
        assert last["choices"][0]["finish_reason"] == "length"
        assert len(last["kvgraft"]["receipt"]["generated_token_ids"]) == 64
        assert daemon.proc.wait(300) == 0
    assert "Traceback" not in daemon.log()
