"""Decoding flags and receipts as the command line and the Python client show them, against
a real daemon serving the tiny random model (cheap, and far from confident: sampling
differs from argmax within a few tokens).

Regressions of issue 31: `--sample --temperature 0` sampled at temperature 1 and a
`--temperature` without `--sample` was ignored (now a temperature samples at it, 0 is
greedy, and the command line and Python agree token for token); `return_logits` gave
bytes (now float32 arrays whose bytes are what the receipt hashes); `stat --manifest`
and `verify --json` showed "reused 0 tokens, computed 0" for a stored receipt, which keeps
no such counts.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvgraft import Client
from kvgraftd.testing.daemon_process import DaemonProcess, wait_model_ready

PROMPT = "1,2,3,4,5"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    served = DaemonProcess.start(tmp_path_factory.mktemp("tiny") / "data", ["--model", "tiny:2"])
    try:
        wait_model_ready(served.address)
        yield served
    finally:
        served.stop()


def test_decoding_flags_and_options_agree(daemon: DaemonProcess) -> None:
    def cli_tokens(*flags: str) -> list[int]:
        result = kvgraft(daemon.address, "--json", "generate", "--tokens", PROMPT, *flags)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["generated_token_ids"]

    with Client(daemon.address) as client:

        def tokens(**options) -> list[int]:
            prompt = [int(t) for t in PROMPT.split(",")]
            return list(client.generate(token_ids=prompt, max_new_tokens=8, **options).token_ids)

        greedy = tokens()
        assert cli_tokens("--max-new-tokens", "8") == greedy
        assert cli_tokens("--max-new-tokens", "8", "--temperature", "0") == greedy
        assert tokens(temperature=0) == tokens(greedy=True, temperature=0) == greedy

        warm = tokens(temperature=0.7, seed=3)
        assert warm != greedy  # it samples
        assert tokens(greedy=False, temperature=0.7, seed=3) == warm
        assert cli_tokens("--max-new-tokens", "8", "--temperature", "0.7", "--seed", "3") == warm
        sampled = cli_tokens(
            "--max-new-tokens", "8", "--sample", "--temperature", "0.7", "--seed", "3"
        )
        assert sampled == warm

        plain = tokens(greedy=False, seed=3)  # sampling at 1.0
        assert plain == tokens(temperature=1.0, seed=3) != greedy
        assert cli_tokens("--max-new-tokens", "8", "--sample", "--seed", "3") == plain

        logits = client.generate(token_ids=[7, 8, 9], max_new_tokens=3, return_logits=True)
        receipt = logits.receipt
        assert logits.generated_logits.shape == (3, logits.prompt_logits.shape[0])
        assert hashlib.sha256(logits.prompt_logits.tobytes()).digest() == (
            receipt.prompt_logits_sha256
        )
        assert hashlib.sha256(logits.generated_logits.tobytes()).digest() == (
            receipt.generated_logits_sha256
        )


def test_stat_manifest_shows_what_a_stored_receipt_keeps(daemon: DaemonProcess) -> None:
    deposited = kvgraft(daemon.address, "--json", "deposit", "--tokens", "3,1,4,1,5,9,2,6")
    document = json.loads(deposited.stdout)
    assert document["computed_tokens"] == 8
    artifact_id = document["artifact_id"]

    text = kvgraft(daemon.address, "stat", "--manifest", artifact_id).stdout.splitlines()
    start = text.index("receipt (as stored: its hashes; a manifest keeps no reuse counts)")
    assert text[start + 1 : start + 4] == [
        f"  input_sha256            {document['input_sha256']}",
        f"  prompt_logits_sha256    {document['prompt_logits_sha256']}",
        f"  generated_logits_sha256 {document['generated_logits_sha256']}",
    ]
    assert not [line for line in text if "reused" in line and "computed" in line]
    stored = json.loads(kvgraft(daemon.address, "--json", "stat", "--manifest", artifact_id).stdout)
    receipt = stored["manifest"]["receipt"]
    assert receipt["input_sha256"] == document["input_sha256"]
    assert "reused_tokens" not in receipt and "computed_tokens" not in receipt
    # nor does `verify --json` say them of the stored receipt (it said 0 and 0 too)
    verified = json.loads(kvgraft(daemon.address, "--json", "verify", artifact_id).stdout)
    assert verified["ok"] and verified["stored"]["input_sha256"] == document["input_sha256"]
    assert "reused_tokens" not in verified["stored"] and "computed_tokens" not in verified["stored"]
    assert verified["recomputed"]["computed_tokens"] == 8


def kvgraft(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KVGRAFT_")}
    return subprocess.run(
        [sys.executable, "-m", "kvgraft", "--server", address, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
    )
