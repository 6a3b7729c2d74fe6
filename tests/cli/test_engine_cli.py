"""The engine as a newcomer meets it: `kvgraft generate/graft/deposit/lookup` and the typed
results of `kvgraft.Client`, against a real daemon serving the real default model.

Each test guards a defect found by following the README as a new user: the receipt
glued to the generated text, the end-of-turn token printed as text, an instruct model
answering nothing without --chat and no word about it, `client.graft` generating 0
tokens by default (the CLI's default was 32), results that were raw protobuf messages,
and `kvgraft lookup --text` offered by --help and then refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvgraft import (
    AskResult,
    Client,
    DepositResult,
    GenerateResult,
    Receipt,
    Token,
    VerifyResult,
)
from kvgraft.cli.engine import _options
from kvgraft.cli.main import build_parser
from kvgraft.client.engine_calls import DEFAULT_MAX_NEW_TOKENS, _generate_options
from kvgraftd.testing.daemon_process import DaemonProcess, wait_model_ready

GUIDE = Path(__file__).resolve().parents[2] / "examples" / "veltria.md"
QUESTION = "What is the capital of Veltria?"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, real_model_args):
    served = DaemonProcess.start(tmp_path_factory.mktemp("engine-cli") / "data", real_model_args)
    try:
        wait_model_ready(served.address)
        yield served
    finally:
        served.stop()


def kvgraft(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "KVGRAFT_SERVER"}
    return subprocess.run(
        [sys.executable, "-m", "kvgraft", "--server", daemon.address, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )


def test_generated_text_and_receipt_are_apart(daemon: DaemonProcess) -> None:
    result = kvgraft(daemon, "generate", "--chat", "--text", "Say hello.", "--max-new-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n") and result.stdout.strip()  # the text on its own line
    assert "<|im_end|>" not in result.stdout  # control tokens are not text
    first = result.stderr.splitlines()[0]
    assert first.startswith("receipt: reused 0 tokens, computed "), result.stderr
    assert first.endswith(" s")  # how long it took
    document = json.loads(
        kvgraft(daemon, "--json", "generate", "--chat", "--text", "Say hello.").stdout
    )
    assert "<|im_end|>" not in document["text"] and document["elapsed_s"] > 0


def test_an_instruct_model_without_chat_gets_a_hint(daemon: DaemonProcess) -> None:
    """Regression: without --chat the default model answers with its end-of-turn token
    only; the CLI printed `<|im_end|>` and nothing said why."""
    result = kvgraft(daemon, "generate", "--text", "What is the capital of France?")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""  # greedy: the model ends its turn at once, every time
    assert "an instruct (chat) model such as the default one expects --chat" in result.stderr
    answered = kvgraft(daemon, "generate", "--chat", "--text", "What is the capital of France?")
    assert answered.stdout.strip() and "expects --chat" not in answered.stderr


def test_python_and_cli_share_the_default_token_budget(daemon: DaemonProcess) -> None:
    """Regression: `client.graft(id, text=...)` generated 0 tokens (the CLI 32)."""
    parsed = build_parser().parse_args(["graft", "abcdef12", "--text", "x"])
    assert parsed.max_new_tokens == DEFAULT_MAX_NEW_TOKENS == 32
    assert _options(build_parser().parse_args(["generate", "--text", "x"]))["max_new_tokens"] == 32
    sent = _generate_options("generate", None, {})
    assert sent.max_new_tokens == 32  # what Client.generate and Client.graft send by default
    assert _generate_options("generate", None, {"return_logits": True}).max_new_tokens == 16
    with Client(daemon.address, transfer_timeout_s=300) as client:
        artifact_id = client.deposit("Once upon a time, in a quiet village,").artifact_id
        result = client.graft(artifact_id, " there lived")
    cli = kvgraft(daemon, "--json", "graft", artifact_id, "--text", " there lived")
    assert cli.returncode == 0, cli.stderr
    assert list(result.token_ids) == json.loads(cli.stdout)["generated_token_ids"]
    assert 0 < len(result.token_ids) <= 32
    with Client(daemon.address, transfer_timeout_s=300) as client:
        with_logits = client.generate("Once upon a time", return_logits=True)
    assert len(with_logits.generated_logits) == len(with_logits.token_ids) > 0


def test_results_are_typed_with_their_protobuf_at_hand(daemon: DaemonProcess) -> None:
    guide = GUIDE.read_text().strip()
    with Client(daemon.address, transfer_timeout_s=300) as client:
        stored = client.deposit(guide, chat=True)
        assert isinstance(stored, DepositResult) and isinstance(stored.receipt, Receipt)
        again = Receipt.from_proto(stored.raw.receipt)  # results are values: equal, hashable
        assert again == stored.receipt and hash(again) == hash(stored.receipt)
        assert stored.computed_tokens == stored.raw.receipt.computed_tokens > 256
        asked = f"{guide}\n\n{QUESTION}"
        stream = client.generate_stream(asked, chat=True, max_new_tokens=12)
        tokens = list(stream)
        grafted = stream.result()
        assert all(isinstance(token, Token) for token in tokens)
        assert isinstance(grafted, GenerateResult)
        assert grafted.text == "".join(token.text for token in tokens)
        assert grafted.token_ids == tuple(token.token_id for token in tokens)
        assert grafted.reused_tokens >= 256 and grafted.raw.receipt.reused_tokens == (
            grafted.reused_tokens
        )
        fresh = client.generate(asked, chat=True, max_new_tokens=12, no_cache=True)
        assert fresh.reused_tokens == 0 and fresh.receipt.hashes == grafted.receipt.hashes
        verified = client.verify(stored.artifact_id[:12])
        assert isinstance(verified, VerifyResult) and verified.ok and verified.mismatches == ()
        assert verified.recomputed.hashes == verified.stored.hashes
        answer = client.ask("What is the capital of the island of Nowhere?", max_new_tokens=4)
        assert isinstance(answer, AskResult)
        assert (answer.path, answer.matched_entry) == ("generate", None)
        assert answer.decode_tokens == len(answer.receipt.generated_token_ids) <= 4
    # Regression: Python said '' where the command line said "none"; JSON now says null.
    asked = ["ask", "--text", "What is the capital of the island of Nowhere?"]
    document = json.loads(kvgraft(daemon, "--json", *asked, "--max-new-tokens", "2").stdout)
    assert (document["path"], document["matched_entry"]) == ("generate", None)
    said = kvgraft(daemon, *asked, "--max-new-tokens", "2").stderr.splitlines()[0]
    assert said == "path: generate, matched_entry: none"


def test_lookup_takes_text_and_file_like_generate(daemon: DaemonProcess) -> None:
    """Regression: `kvgraft lookup --text` was offered by --help and then refused."""
    deposit = kvgraft(daemon, "deposit", "-q", "--chat", "--file", str(GUIDE))
    assert deposit.returncode == 0, deposit.stderr
    artifact_id = deposit.stdout.strip()
    assert len(artifact_id) == 64 and int(artifact_id, 16) >= 0  # the id and nothing else
    prompt = ["--chat", "--file", str(GUIDE), "--text", QUESTION]
    looked_up = json.loads(kvgraft(daemon, "--json", "lookup", *prompt).stdout)
    generated = json.loads(
        kvgraft(daemon, "--json", "generate", *prompt, "--max-new-tokens", "1").stdout
    )
    assert int(looked_up["matched_tokens"]) == generated["reused_tokens"] >= 256
    # --file then --text is the file's text, a blank line, the text
    joined = GUIDE.read_text().strip() + "\n\n" + QUESTION
    same = json.loads(
        kvgraft(
            daemon, "--json", "generate", "--chat", "--text", joined, "--max-new-tokens", "1"
        ).stdout
    )
    assert same["input_sha256"] == generated["input_sha256"]
    text = kvgraft(daemon, "lookup", *prompt)
    assert f"{looked_up['matched_tokens']} leading tokens are stored" in text.stdout
