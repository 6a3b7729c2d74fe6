"""Sampling controls, stop strings, log-probabilities and `kvgraft chat` (issue 33), from the
command line and kvgraft.Client, against one real daemon serving the real default model.

A conversation kept turn by turn (keep=True) must be grafted whole by the next turn; a
stop string must end the text before it, streamed or not; a seeded sample with top-p
and top-k must be reproducible down to its receipt, which records how it was drawn;
the daemon's refusals come back as kvgraft errors in its words, never a traceback.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys

import pytest

from kvgraft import Client
from kvgraft.errors import InvalidArgument
from kvgraft.results import Sampling, TokenLogprob
from kvgraft.sampling import as_float32
from kvgraftd.testing.daemon_process import DaemonProcess, wait_model_ready

# a prompt the default model answers with the count and its end of turn, in both products
COUNTING = "List the numbers 1 to 10, separated by commas."
SEEDED = ["--temperature", "0.8", "--top-p", "0.9", "--top-k", "40"]
HASHES = ("input_sha256", "prompt_logits_sha256", "generated_logits_sha256")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, real_model_args):
    served = DaemonProcess.start(tmp_path_factory.mktemp("chat-cli") / "data", real_model_args)
    try:
        wait_model_ready(served.address)
        yield served
    finally:
        served.stop()


def kvgraft(daemon: DaemonProcess, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("KVGRAFT_SERVER", "NO_COLOR")}
    return subprocess.run(
        [sys.executable, "-m", "kvgraft", "--server", daemon.address, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )


def test_chat_json_grafts_every_earlier_turn(daemon: DaemonProcess) -> None:
    questions = "What is the capital of France?\n\nAnd of Italy?\nAnd of Spain?\n"  # a blank line
    run = kvgraft(
        daemon,
        "chat",
        "--json",
        "--system",
        "You answer in one sentence.",
        "--max-new-tokens",
        "24",
        stdin=questions,
    )
    assert run.returncode == 0, run.stderr
    turns = [json.loads(line) for line in run.stdout.splitlines()]
    assert [turn["turn"] for turn in turns] == [1, 2, 3]  # the blank line is no turn
    for turn in turns:
        assert turn["text"].strip() and turn["finish_reason"] in ("stop", "length")
        assert all(re.fullmatch("[0-9a-f]{64}", turn[name]) for name in HASHES)
        assert turn["tokens_per_s"] > 0 and turn["generated_tokens"] > 0
        assert turn["sampling"] is None  # greedy, no stop strings
    assert "Paris" in turns[0]["text"] and "Rome" in turns[1]["text"]
    # Each turn keeps its context (prompt and answer), so the next one grafts it: measured,
    # all of it (the answer re-rendered by the template is the tokens generated). Without
    # keep only a shared template prefix would be reused.
    for before, after in itertools.pairwise(turns):
        whole_context = before["reused_tokens"] + before["computed_tokens"]
        assert after["reused_tokens"] >= 0.9 * whole_context, (before, after)
    assert turns[2]["reused_tokens"] > turns[1]["reused_tokens"] > turns[0]["reused_tokens"]


def test_chat_reads_lines_resets_and_says_what_it_reused(daemon: DaemonProcess) -> None:
    """Without --json (here from a pipe): the answers on stdout, one dim line per turn on
    stderr (plain: not a terminal); /reset starts the same conversation anew, so the
    same question is answered alike and its prompt is grafted but for its last token."""
    run = kvgraft(
        daemon, "chat", "--max-new-tokens", "6", stdin="Hello!\n/nonsense\n/reset\nHello!\n"
    )
    assert run.returncode == 0, run.stderr
    answers = [part.strip() for part in run.stdout.split(">>> ") if part.strip()]
    assert len(answers) == 2 and answers[0] == answers[1], run.stdout
    summaries = re.findall(
        r"^reused (\d+) tokens, computed (\d+) · (\d+) tokens at [\d.]+ tokens/s", run.stderr, re.M
    )
    assert len(summaries) == 2, run.stderr
    (first_reused, first_computed, generated), (reused, computed, _) = (
        [int(count) for count in summary] for summary in summaries
    )
    prompt_tokens = first_reused + first_computed - generated
    # the kept context holds the whole prompt; its last token is computed for its logits
    assert (reused, computed) == (prompt_tokens - 1, 1 + generated)
    assert "/nonsense is no command: /reset starts anew, /exit ends" in run.stderr
    assert "a new conversation" in run.stderr and "\033[" not in run.stderr


def test_generate_stops_before_a_stop_string(daemon: DaemonProcess) -> None:
    streamed = kvgraft(daemon, "generate", "--chat", "--text", COUNTING, "--stop", ", 5")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == "1, 2, 3, 4\n"  # held back as it streamed: ", 5" never shows
    assert "  sampling greedy, stop [', 5']" in streamed.stderr.splitlines()
    document = json.loads(
        kvgraft(daemon, "--json", "generate", "--chat", "--text", COUNTING, "--stop", ", 5").stdout
    )
    assert (document["text"], document["finish_reason"]) == ("1, 2, 3, 4", "stop")
    assert document["sampling"]["greedy"] is True and document["sampling"]["stop"] == [", 5"]
    cut = kvgraft(
        daemon, "--json", "generate", "--chat", "--text", COUNTING, "--max-new-tokens", "5"
    )
    assert (json.loads(cut.stdout)["text"], json.loads(cut.stdout)["finish_reason"]) == (
        "1, 2,",
        "length",
    )
    counted = json.loads(kvgraft(daemon, "--json", "generate", "--chat", "--text", COUNTING).stdout)
    assert counted["text"] == "1, 2, 3, 4, 5, 6, 7, 8, 9, 10" and counted["sampling"] is None
    assert counted["finish_reason"] == "stop"  # the model ended its turn
    too_many = [arg for stop in "abcde" for arg in ("--stop", stop)]
    refused = kvgraft(daemon, "generate", "--chat", "--text", COUNTING, *too_many)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr == (
        "kvgraft: error: INVALID_ARGUMENT: stop takes at most 4 strings of 1 to 256 "
        "characters; 5 given, of [1] characters\n"
    )


def test_seeded_sampling_with_top_p_and_top_k_is_reproducible(daemon: DaemonProcess) -> None:
    def sample(seed: str) -> dict:
        run = kvgraft(
            daemon, "--json", "generate", "--chat", "--text", "Tell me about the sea.",
            "--max-new-tokens", "12", *SEEDED, "--seed", seed,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout)

    first, again, other = sample("3"), sample("3"), sample("4")
    assert first["text"] == again["text"] and first["text"] != other["text"]
    assert [first[name] for name in HASHES] == [again[name] for name in HASHES]
    assert first["generated_logits_sha256"] != other["generated_logits_sha256"]
    assert first["sampling"] == {
        "greedy": False,
        "temperature": as_float32(0.8),  # what the receipt covers: the wire's float32
        "top_p": as_float32(0.9),
        "top_k": 40,
        "seed": 3,
        "stop": [],
    }


def test_logprobs_give_each_token_and_its_alternatives(daemon: DaemonProcess) -> None:
    asked = ["generate", "--chat", "--text", "Say hello.", "--max-new-tokens", "6"]
    document = json.loads(kvgraft(daemon, "--json", *asked, "--logprobs", "2").stdout)
    tokens = document["tokens"]
    assert [t["token_id"] for t in tokens] == document["generated_token_ids"]
    assert "".join(t["text"] for t in tokens) == document["text"]
    for token in tokens:
        assert token["logprob"] <= 0 and len(token["top_logprobs"]) == 2
        best, second = token["top_logprobs"]
        assert best["logprob"] >= second["logprob"]
        # greedy: the chosen token is the likeliest, with the very same logprob
        assert (best["token_id"], best["logprob"]) == (token["token_id"], token["logprob"])
    shown = kvgraft(daemon, *asked, "--logprobs", "2")
    lines = shown.stdout.splitlines()
    assert lines[0] == document["text"] and lines[1].split() == ["token", "logprob", "likeliest"]
    assert len(lines) == 2 + len(tokens)
    assert lines[2].startswith(repr(tokens[0]["text"]))
    assert f"{tokens[0]['logprob']:.4f}" in lines[2]
    plain = json.loads(kvgraft(daemon, "--json", *asked).stdout)
    assert "tokens" not in plain and plain["generated_token_ids"] == document["generated_token_ids"]


def test_client_messages_with_stop_and_top_k_round_trip(daemon: DaemonProcess) -> None:
    messages = [
        {"role": "system", "content": "You count."},
        {"role": "user", "content": COUNTING},
    ]
    with Client(daemon.address) as client:
        result = client.generate(
            messages=messages,
            stop=", 6",
            top_k=40,
            temperature=0.5,
            seed=7,
            max_new_tokens=40,
            top_logprobs=1,
        )
        assert (result.text, result.finish_reason) == ("1, 2, 3, 4, 5", "stop")
        assert result.receipt.sampling == Sampling(
            greedy=False, temperature=0.5, top_p=1.0, top_k=40, seed=7, stop=(", 6",)
        )
        assert [token.token_id for token in result.logprobs] == list(result.token_ids)
        first = result.logprobs[0]
        assert first.logprob <= 0 and first.top_logprobs == (
            TokenLogprob(first.token_id, first.text, first.logprob),  # the likeliest: "1"
        )
        plain = client.generate(messages=messages, max_new_tokens=4)
        assert plain.logprobs is None and plain.receipt.sampling is None
        assert plain.finish_reason == "length"
        # What the daemon refuses comes back in its words, as a kvgraft error
        with pytest.raises(InvalidArgument, match=r"^top_p 1\.5 is outside 0\.\.1 "):
            client.generate(messages=messages, temperature=0.7, top_p=1.5)
        with pytest.raises(InvalidArgument, match=r"^stop takes at most 4 strings .* 5 given"):
            client.generate(messages=messages, stop=["a", "b", "c", "d", "e"])
        with pytest.raises(InvalidArgument, match=r"^message 1 has role 'robot'"):
            client.generate(messages=[messages[0], {"role": "robot", "content": "x"}])
        # What the call sees on its own is refused before anything is sent
        with pytest.raises(ValueError, match=r"^top_k=40 with greedy decoding"):
            client.generate(messages=messages, top_k=40)
        with pytest.raises(TypeError, match=r"^messages\[0\] is \('user', 'hi'\)"):
            client.generate(messages=[("user", "hi")])
        with pytest.raises(InvalidArgument, match="give one of text, token_ids or messages"):
            client.generate("hi", messages=messages)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["generate", "--text", "x", "--top-k", "3"],
            "--top-k chooses among samples: add --sample or --temperature T",
        ),
        (
            ["chat", "--top-p", "0.9", "--top-k", "3"],
            "--top-p and --top-k choose among samples: add --sample or --temperature T",
        ),
        (
            ["chat", "--top-p", "1.5"],
            "argument --top-p: 1.5 is not a top-p: give a number above 0 and at most 1, e.g. 0.9",
        ),
        (
            ["graft", "abcdef12", "--text", "x", "--logprobs", "21"],
            "argument --logprobs: 21 is too large: at most 20",
        ),
    ],
)
def test_decoding_flags_that_would_be_ignored_are_usage_errors(args, message: str) -> None:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KVGRAFT_")}
    run = subprocess.run(
        [sys.executable, "-m", "kvgraft", "--server", "127.0.0.1:1", "--json", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment,
    )
    assert run.returncode == 2 and run.stderr.splitlines()[-1].endswith(f"error: {message}")
    assert json.loads(run.stdout) == {"error": {"code": "INVALID_ARGUMENT", "message": message}}
