"""A tiny-model kvgraftd for the HTTP tests of bad input: up in seconds, fast to answer.

`tiny_daemon(data_dir)` serves `tiny:0` (a small random Llama, no tokenizer: completions
send token ids, chat requests are read whole and then refused for the missing template)
with max_context_tokens MAX_CONTEXT_TOKENS, so no request computes for long, and the HTTP
API on a free port. It waits until /health says ready, stops the daemon on exit, and then
checks that its log holds no traceback: every refusal was a decision.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvgraftd.testing.daemon_process import DaemonProcess
from tests.http.model_daemon import wait_until_healthy

TINY_MODEL = "tiny:0"
MAX_CONTEXT_TOKENS = 256
TINY_ARGS = [
    *("--model", TINY_MODEL, "--page-tokens", "16", "--block-tokens", "64"),
    *("--max-context-tokens", str(MAX_CONTEXT_TOKENS), "--max-call-s", "20"),
]


@contextmanager
def tiny_daemon(data_dir: Path) -> Iterator[DaemonProcess]:
    daemon = DaemonProcess.start(data_dir, TINY_ARGS)
    try:
        wait_until_healthy(daemon)
        yield daemon
    finally:
        daemon.stop()
    assert "Traceback" not in daemon.log(), daemon.log()
