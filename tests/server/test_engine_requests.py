"""Engine requests seen from outside: a client that cancels a long prompt stops its
computation at the next step; live KV is bounded across requests (one larger than the
budget is refused, the rest wait their turn); a long prompt reports its progress.

Real daemons in their own processes, serving the tiny seeded model; figures read from
their Prometheus endpoint.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time

import pytest

from kvgraft import Client, Progress
from kvgraft.errors import DeadlineExceeded, ResourceExhausted
from kvgraftd.testing.daemon_process import DaemonProcess, wait_model_ready
from tests.support.metrics_scrape import unlabelled_metrics

LONG_PROMPT = [t % 500 for t in range(30_000)]  # seconds of prefill for the tiny model
BUDGET = 40_000 * 2 * 2 * 2 * 16 * 4  # 40,000 positions of the tiny model's K and V


def _idle(daemon: DaemonProcess, timeout_s: float = 120) -> dict[str, float]:
    """The metrics once no engine request runs or waits."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = unlabelled_metrics(daemon)
        busy = samples.get("kvgraft_requests_running", 0) + samples.get(
            "kvgraft_batch_waiting_passes", 0
        )
        if not busy or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


@pytest.fixture
def tiny_daemon(start_daemon) -> DaemonProcess:
    daemon = start_daemon(
        extra_args=[
            "--model",
            "tiny:1",
            "--metrics-listen",
            "127.0.0.1:0",
            "--max-context-tokens",
            "60000",
            "--max-live-kv-bytes",
            str(BUDGET),
        ]
    )
    wait_model_ready(daemon.address)
    return daemon


def test_a_cancelled_prompt_stops_computing(tiny_daemon) -> None:
    """Regression: prompts whose clients had cancelled were computed to their end (116 CPU
    seconds), and a 3-token request behind them waited 107 s."""
    leaving = Client(tiny_daemon.address, compute_timeout_s=1.0)
    with leaving, pytest.raises(DeadlineExceeded):
        leaving.generate(token_ids=LONG_PROMPT, max_new_tokens=1)
    samples = _idle(tiny_daemon)
    assert samples["kvgraft_requests_running"] == 0
    assert samples["kvgraft_batch_abandoned_total"] == 1
    # it stopped at the step after the client left, long before the prompt's end
    assert samples["kvgraft_batch_tokens_total"] < len(LONG_PROMPT) / 2
    with Client(tiny_daemon.address) as client:
        assert client.generate(token_ids=[1, 2, 3], max_new_tokens=2).receipt.computed_tokens == 5


def test_live_kv_beyond_the_budget_is_refused_and_given_back(tiny_daemon) -> None:
    with Client(tiny_daemon.address) as client:
        with pytest.raises(ResourceExhausted, match="max_live_kv_bytes"):
            client.generate(token_ids=LONG_PROMPT + LONG_PROMPT[:12_000], max_new_tokens=1)
        assert client.generate(token_ids=LONG_PROMPT[:3000], max_new_tokens=1).text is not None
    samples = _idle(tiny_daemon)
    assert samples["kvgraft_live_kv_bytes"] == 0  # every reservation given back
    assert samples["kvgraft_live_kv_budget_bytes"] == BUDGET


def test_a_long_prompt_reports_its_progress(tiny_daemon) -> None:
    with Client(tiny_daemon.address) as client:
        stored = client.deposit(token_ids=LONG_PROMPT[:1000])
        seen: list = []
        prompt = LONG_PROMPT[:6000]
        with_progress = client.generate(token_ids=prompt, max_new_tokens=2, on_progress=seen.append)
        without = client.generate(token_ids=prompt, max_new_tokens=2)
        assert with_progress.receipt.hashes == without.receipt.hashes
        reused = with_progress.reused_tokens
        assert reused == 1000 == stored.receipt.computed_tokens
        # one as it starts (what was grafted counts as done), then about every half second
        assert seen[0] == Progress(done=reused, total=len(prompt), reused=reused)
        assert all(p.total == len(prompt) and p.reused == reused for p in seen)
        assert [p.done for p in seen] == sorted(p.done for p in seen)
        assert seen[-1].done <= len(prompt)

        # a deposit that reports its progress stores the same artifact
        deposits: list = []
        again = client.deposit(token_ids=LONG_PROMPT[:1000], on_progress=deposits.append)
        assert again.artifact_id == stored.artifact_id
        assert again.receipt.hashes == stored.receipt.hashes
        assert deposits[0] == Progress(done=999, total=1000, reused=999)


def test_the_command_line_shows_a_prompt_bar_on_a_terminal(tiny_daemon) -> None:
    """`kvgraft generate` and `deposit` draw the prompt's progress on a terminal's stderr
    (and only there: piped, the output is what it was)."""
    tokens = ",".join(str(t) for t in LONG_PROMPT[:4000])
    for command in (["generate", "--max-new-tokens", "1"], ["deposit"]):
        shown = _on_a_terminal(tiny_daemon.address, [*command, "--tokens", tokens])
        assert re.search(r"prompt: +\d+%\|.*\| *\d+/4000 \[.*tok/s\]", shown), shown
        piped = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvgraft",
                "--server",
                tiny_daemon.address,
                *command,
                "--tokens",
                tokens,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert piped.returncode == 0 and "prompt:" not in piped.stderr, piped.stderr


def _on_a_terminal(address: str, args: list[str]) -> str:
    """What `kvgraft ARGS` writes to stderr when stderr is a terminal."""
    controller, terminal = pty.openpty()
    # a terminal of 24 rows and 120 columns (a new one has none: no room for a bar)
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    process = subprocess.Popen(
        [sys.executable, "-m", "kvgraft", "--server", address, *args],
        stdout=subprocess.DEVNULL,
        stderr=terminal,
    )
    os.close(terminal)
    out = b""
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the process closed its end
            break
        if not chunk:
            break
        out += chunk
    os.close(controller)
    assert process.wait(timeout=120) == 0, out
    return out.decode(errors="replace")
