"""A real-model kvgraftd for the HTTP tests, and the wire details every HTTP test reads.

`model_daemon(data_dir, extra_args)` starts the default model's daemon
(the HTTP API on a free port), waits until /health says the model is ready, and stops it on exit.
`sse_events(text)` splits a server-sent-events body into its events, checking the framing
(one `data: ` line per event, a blank line after each, `data: [DONE]` last);
`assert_error(response, status, names)` checks OpenAI's error JSON.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx2

from kvgraftd.testing.daemon_process import DaemonProcess
from tests.conftest import MODEL_CACHE

# The default model from the tests' shared cache (converted on first use: the daemon then
# takes ~30 s longer to be ready). Not the `real_model_args` fixture: it loads the model
# into the test process too, which these tests never need.
MODEL_ARGS = ["--model", "", "--model-cache", str(MODEL_CACHE)]

DONE = "[DONE]"


@contextmanager
def model_daemon(data_dir: Path, extra_args: list[str] | None = None) -> Iterator[DaemonProcess]:
    daemon = DaemonProcess.start(data_dir, [*MODEL_ARGS, *(extra_args or [])])
    try:
        wait_until_healthy(daemon)
        yield daemon
    finally:
        daemon.stop()


def wait_until_healthy(daemon: DaemonProcess, timeout_s: float = 300.0) -> None:
    """Until GET /health (open even with a token) says the model is ready."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = httpx2.get(daemon.http_url + "/health", timeout=30).json()["status"]
        if state == "ready":
            return
        if state.startswith("failed") or time.monotonic() > deadline:
            raise RuntimeError(f"the model is not ready: {state}\n{daemon.log()}")
        time.sleep(0.2)


def sse_events(text: str) -> list[dict | str]:
    """The events of a whole SSE body: each a JSON object, the last the string [DONE]."""
    assert text.endswith(f"data: {DONE}\n\n"), text[-300:]
    blocks = text.split("\n\n")
    assert blocks[-1] == ""
    events: list[dict | str] = []
    for block in blocks[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block
        data = block[len("data: ") :]
        events.append(data if data == DONE else json.loads(data))
    assert events.index(DONE) == len(events) - 1
    return events


def sse_lines(response: httpx2.Response) -> Iterator[str]:
    """The `data: ` payloads of a streaming response as they arrive (blank lines dropped)."""
    for line in response.iter_lines():
        if line:
            assert line.startswith("data: "), line
            yield line[len("data: ") :]


def assert_error(response: httpx2.Response, status: int, *names: str) -> dict:
    """`response` is OpenAI's error JSON with `status`, its message naming each of `names`."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert {"message", "type", "code"} <= set(error)
    assert all(isinstance(error[key], str) and error[key] for key in ("message", "type", "code"))
    for name in names:
        assert name in error["message"], error
    return error
