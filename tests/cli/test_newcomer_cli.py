"""What a newcomer met on the command line (issue 47, item 8), against a real daemon
serving the tiny model (no tokenizer, no chat template: token ids in).

Each test guards one defect: `kvgraft publish` printing the published artifact's id as
if it were the one given (it is a second artifact, with a new id); trust spelled three
ways (`TRUST_COMPUTED` in JSON, `computed` in ls, `computed (computed)` in stat); a
tiny model's chat refusal sending the user to text, which it then refused too; and
Ctrl-C at `kvgraft chat`'s empty prompt saying that a call was cancelled.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys

import pytest

from kvgraft import Client
from kvgraftd.testing.daemon_process import DaemonProcess, wait_model_ready
from tests.support.factory import random_artifact

TOKENS = [7, 8, 9, 10, 11]


def kvgraft(*args: str, server: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """`python -m kvgraft --server S ARGS`, with no KVGRAFT_* setting nor terminal width."""
    environment = {
        k: v for k, v in os.environ.items() if not k.startswith("KVGRAFT_") and k != "COLUMNS"
    }
    return subprocess.run(
        [sys.executable, "-m", "kvgraft", "--server", server, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
    )


def kvgraft_json(*args: str, server: str) -> dict:
    result = kvgraft("--json", *args, server=server)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    served = DaemonProcess.start(
        tmp_path_factory.mktemp("newcomer") / "data", ["--model", "tiny:0"]
    )
    try:
        wait_model_ready(served.address)
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def deposited(daemon: DaemonProcess) -> str:
    """A context this daemon computed: trusted, its origin "computed"."""
    with Client(daemon.address) as client:
        return client.deposit(token_ids=TOKENS).artifact_id


def test_publish_prints_the_new_artifacts_id(daemon: DaemonProcess, deposited: str) -> None:
    published = kvgraft("publish", deposited[:16], server=daemon.address)
    assert published.returncode == 0, published.stderr
    shared_id = published.stdout.split()[1]
    assert re.fullmatch("[0-9a-f]{64}", shared_id) and shared_id != deposited
    # was: "published SHARED_ID (...)", as if it were the id given
    assert published.stdout == (
        f"published {shared_id} (the operator's), a new artifact over the pages of "
        f"{deposited[:16]}: every tenant may graft it by this id and reuse its pages; only its "
        "owner may delete it\n"
    )
    document = kvgraft_json("publish", deposited, server=daemon.address)  # again: the same one
    assert (document["artifact_id"], document["published_from"]) == (shared_id, deposited)
    assert document["shared"] is True
    assert kvgraft("publish", shared_id, "--withdraw", server=daemon.address).returncode == 0


def test_trust_is_one_word_everywhere(daemon: DaemonProcess, deposited: str) -> None:
    uploaded = random_artifact(random.Random(47), tokens=8)
    with Client(daemon.address) as client:
        client.put_artifact(uploaded)  # from outside, unsigned: untrusted
        key = client.info().signing_key.hex()[:16]  # which vouches for what it computed

    stat = kvgraft("stat", deposited, server=daemon.address).stdout.splitlines()
    assert f"trust computed, vouched by {key}" in stat  # was: "trust computed (computed), ..."
    stat = kvgraft("stat", uploaded.id, server=daemon.address).stdout.splitlines()
    assert "trust untrusted (origin: upload)" in stat
    header, *rows = kvgraft("ls", server=daemon.address).stdout.splitlines()
    column = header.index("trust")
    trusts = {row[:16]: row[column:].split()[0] for row in rows}
    assert trusts == {deposited[:16]: "computed", uploaded.id[:16]: "untrusted"}

    # was: "TRUST_COMPUTED" in every JSON document
    assert kvgraft_json("stat", deposited, server=daemon.address)["provenance"]["trust"] == (
        "computed"
    )
    listed = kvgraft_json("ls", server=daemon.address)["artifacts"]
    assert {a["artifact_id"]: a["provenance"]["trust"] for a in listed} == {
        deposited: "computed",
        uploaded.id: "untrusted",
    }
    grafted = kvgraft_json(
        "graft", deposited, "--tokens", "12", "--max-new-tokens", "1", server=daemon.address
    )
    assert [(g["artifact_id"], g["trust"]) for g in grafted["grafted"]] == [(deposited, "computed")]


def test_a_tiny_models_refusals_advise_what_works(daemon: DaemonProcess) -> None:
    token_ids = (
        "send token ids (kvgraft generate --tokens 1,2,3; token_ids= in Python; a "
        "/v1/completions prompt of ids)"
    )
    chat = kvgraft("--json", "chat", server=daemon.address, stdin="Hello\n")
    assert chat.returncode == 1
    assert json.loads(chat.stdout)["error"] == {  # was: "... no chat template; send plain text"
        "code": "INVALID_ARGUMENT",
        "message": "model tiny:0 has no tokenizer nor chat template, so it reads neither a "
        f"conversation nor text: {token_ids}",
    }
    text = kvgraft("generate", "--text", "Hello", server=daemon.address)
    assert (text.returncode, text.stderr) == (
        1,
        "kvgraft: error: INVALID_ARGUMENT: model tiny:0 has no tokenizer, so it reads no "
        f"text: {token_ids}\n",
    )
    # the advice works
    ids = kvgraft("generate", "--tokens", "1,2,3", "--max-new-tokens", "2", server=daemon.address)
    assert ids.returncode == 0, ids.stderr
    assert ids.stderr.startswith("receipt: reused ")


def test_ctrl_c_at_the_chat_prompt_exits_quietly(daemon: DaemonProcess) -> None:
    environment = {k: v for k, v in os.environ.items() if k not in ("KVGRAFT_SERVER", "NO_COLOR")}
    chat = subprocess.Popen(
        [sys.executable, "-m", "kvgraft", "--server", daemon.address, "chat"],
        stdin=subprocess.PIPE,  # no terminal: input() reads the pipe, as it reads a tty
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=environment,
        # Python raises KeyboardInterrupt only where SIGINT was not ignored at its start
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert chat.stderr is not None and chat.stdout is not None
        note = chat.stderr.readline().decode()
        assert note == (
            f"chat with kvgraftd at {daemon.address}: /reset starts anew, /exit or Ctrl-D ends\n"
        )
        assert os.read(chat.stdout.fileno(), 4) == b">>> "  # at the prompt, waiting
        while True:
            chat.send_signal(signal.SIGINT)
            try:  # a signal that came just before input() began its read waits for the next
                chat.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        out, err = chat.communicate(timeout=60)
    finally:
        if chat.poll() is None:
            chat.kill()
    # was: exit 130 and "kvgraft: interrupted: the call was cancelled"
    assert (chat.returncode, out, err) == (0, b"\n", b"")
