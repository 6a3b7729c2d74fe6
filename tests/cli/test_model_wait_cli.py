"""Engine commands wait for a model that is still loading (issue 47, item 6).

Was: `make serve` says "serving" while the model still loads, and the quick start's
first command, `kvgraft deposit`, failed with UNAVAILABLE "the model is still loading".
Now every command that needs the engine waits for the model within --timeout, as
`ollama run` does, saying so on stderr: a refreshing line on a terminal, plain lines
elsewhere, and stdout untouched (with --json it holds the one document).

The daemon is the real kvgraftd in its own process, serving the tiny model, whose load
(the real one) is held until the test opens a gate: it starts only once a file exists.
So the commands meet the loading state for certain, however fast or loaded the machine,
and the test decides when the load goes on.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

from kvgraft import Client
from kvgraftd.testing.daemon_process import DaemonProcess

# kvgraftd, its model's load held until the file sys.argv[1] exists (then the real load);
# what follows it on the command line is DaemonProcess's `python -m kvgraftd ARGS`.
GATED_LOAD = """
import os, sys, time
from kvgraftd.engine.model.model_adapter import ModelAdapter
gate, load = sys.argv[1], ModelAdapter.load
def held(*args, **kwargs):
    while not os.path.exists(gate):
        time.sleep(0.05)
    return load(*args, **kwargs)
ModelAdapter.load = held
from kvgraftd.main import main
main(sys.argv[sys.argv.index("kvgraftd") + 1 :])
"""
WAITING = re.compile(r"waiting for the model to load \(\d+ s\)…")
ERASE = "\r\x1b[K"
TOKENS = ["--tokens", "1,2,3,4,5"]


@pytest.fixture
def gated(tmp_path: Path):
    """(daemon whose model loads once `gate` exists, gate)."""
    gate = tmp_path / "gate"
    daemon = DaemonProcess.start(
        tmp_path / "data",
        ["--model", "tiny:0"],
        prefix=[sys.executable, "-c", GATED_LOAD, str(gate)],
    )
    try:
        yield daemon, gate
    finally:
        daemon.stop()


def start(
    daemon: DaemonProcess, *args: str, stderr=subprocess.PIPE, stdin=None
) -> subprocess.Popen:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KVGRAFT_")}
    return subprocess.Popen(
        [sys.executable, "-m", "kvgraft", "--server", daemon.address, *args],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=environment,
    )


def read_terminal(fd: int, until: str | None = None) -> str:
    """What the command wrote to its terminal, up to `until` (None: to its end)."""
    seen = b""
    while until is None or until.encode() not in seen:
        ready, _, _ = select.select([fd], [], [], 120)
        assert ready, f"the terminal stayed silent; it showed {seen!r}"
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the command ended, its terminal closed
            break
        if not chunk:
            break
        seen += chunk
    return seen.decode()


def test_engine_commands_wait_for_the_model_to_load(gated, tmp_path: Path) -> None:
    daemon, gate = gated
    with Client(daemon.address) as client:
        assert client.info().model_state == "loading"  # held: it stays so until the gate

    # The quick start's first command, its stderr a pipe: plain lines.
    plain = start(daemon, "deposit", *TOKENS)
    assert plain.stderr is not None
    first = plain.stderr.readline()  # was: "kvgraft: error: UNAVAILABLE: the model is ..."
    assert WAITING.fullmatch(first.rstrip("\n")), first + plain.stderr.read()
    # --json: the wait is on stderr, stdout keeps its one document
    scripted = start(daemon, "--json", "deposit", *TOKENS)
    assert scripted.stderr is not None
    assert WAITING.fullmatch(scripted.stderr.readline().rstrip("\n"))
    # On a terminal: one line, rewritten as the seconds pass.
    terminal, terminal_end = pty.openpty()
    shown = start(daemon, "deposit", "-q", *TOKENS, stderr=terminal_end)
    os.close(terminal_end)
    on_terminal = read_terminal(terminal, until="…")
    # Every command that needs the model waits, and --timeout bounds the wait: here the
    # model still loads when it has passed (4 s: eleven commands start at once on a machine
    # of two cores, and a look at the model within less could run out before it answers).
    entries = tmp_path / "entries.jsonl"
    entries.write_text('{"problem": "1+1?", "solution": "2", "answer": "2"}\n')
    bounded = {
        " ".join(command): start(daemon, "--timeout", "4", *command, stdin=subprocess.DEVNULL)
        for command in [
            ["generate", *TOKENS],
            ["graft", "ab" * 8, *TOKENS],
            ["verify", "ab" * 8],
            ["verify", "--untrusted"],
            ["lookup", *TOKENS],
            ["chat"],
            ["ask", "--text", "1+1?"],
            ["library", "add", "--problem", "1+1?", "--solution", "2", "--answer", "2"],
            ["library", "ls"],
            ["library", "rm", "ab" * 8],
            ["library", "import", str(entries)],
        ]
    }
    for command, process in bounded.items():
        out, err = process.communicate(timeout=120)
        assert (process.returncode, out) == (1, ""), (command, err)
        assert WAITING.fullmatch(err.splitlines()[0]), (command, err)
        assert err.splitlines()[-1] == (
            f"kvgraft: error: DEADLINE_EXCEEDED: the model of kvgraftd at {daemon.address} is "
            "still loading after 4 s: give it longer with --timeout S (in Python, "
            "wait_for_model(timeout_s=S)), or see the daemon's log"
        ), command

    gate.touch()  # the load goes on; each waiting command then runs
    out, err = plain.communicate(timeout=120)
    assert plain.returncode == 0, err
    artifact_id = out.splitlines()[0].removeprefix("deposited ")
    assert re.fullmatch("[0-9a-f]{64}", artifact_id), out
    assert out.splitlines()[1].startswith("receipt: reused ")  # the three ran at once
    assert all(WAITING.fullmatch(line) for line in [first.rstrip("\n"), *err.splitlines()])

    out, err = scripted.communicate(timeout=120)
    assert scripted.returncode == 0, err
    assert json.loads(out)["artifact_id"] == artifact_id  # the same context, one artifact
    assert all(WAITING.fullmatch(line) for line in err.splitlines())

    out, _ = shown.communicate(timeout=120)
    assert (shown.returncode, out) == (0, f"{artifact_id}\n")
    on_terminal += read_terminal(terminal)
    os.close(terminal)
    # each look rewrites the line (no newline), and the line is erased when the wait ends
    # (what the deposit writes after it is its own)
    waited = re.match(rf"(?:{re.escape(ERASE)}{WAITING.pattern})+{re.escape(ERASE)}", on_terminal)
    assert waited is not None, on_terminal
    assert "waiting" not in on_terminal[waited.end() :]


def test_a_ready_model_or_none_is_not_waited_for(gated, start_daemon) -> None:
    """Nothing is shown when the model is ready at once; a daemon without a model gives
    the engine's own refusal at once (nothing to wait for)."""
    daemon, gate = gated
    gate.touch()
    with Client(daemon.address) as client:
        assert client.wait_for_model(timeout_s=120) == "ready"
    ran = start(daemon, "lookup", *TOKENS)
    out, err = ran.communicate(timeout=120)
    assert (ran.returncode, err) == (0, "")
    assert out.startswith("0 leading tokens are stored")

    store_only = start_daemon()  # --model none
    ran = start(store_only, "generate", *TOKENS)
    out, err = ran.communicate(timeout=120)
    assert (ran.returncode, out) == (1, "")
    assert err.startswith("kvgraft: error: FAILED_PRECONDITION: this daemon runs without a model")
