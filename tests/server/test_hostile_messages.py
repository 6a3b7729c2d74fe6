"""Hostile text in requests: what an error repeats of it, and how soon it answers.

* An error quotes what it refuses: a 10,000-character id, or a Replicate source made of
  terminal escapes, bidirectional overrides, a newline and 10,000 characters, comes back
  escaped and cut, the message's advice whole (the daemon: store only).
* Ask with 200,000 "!" (50,000 tokens, within max_context_tokens) answers at once, and with
  400,000 (past it) is INVALID_ARGUMENT at once; both ran to their deadline, normalizing the
  question in time quadratic in the run of "!" (the real model: a tokenizer).
"""

from __future__ import annotations

import grpc
import pytest

from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraft.v1 import kvgraft_pb2_grpc as pb_grpc
from kvgraftd.testing.daemon_process import wait_model_ready

CODE = grpc.StatusCode
HOSTILE = "\x1b[2J\u202e\u2066evil\u2069\nINFO forged log line\x00" + "x" * 10_000


def _refusal(call, request, *, stream: bool = False) -> grpc.RpcError:
    """The error `call` answers `request` with (a generous deadline: an answer is at once)."""
    with pytest.raises(grpc.RpcError) as caught:
        answer = call(request, timeout=60)
        if stream:
            list(answer)
    return caught.value


def _shown_safely(details: str) -> None:
    """Nothing in it moves a terminal's cursor or reorders its text; nothing is long."""
    assert all(c.isprintable() for c in details), repr(details)
    assert len(details) < 600, details


def test_an_error_repeats_hostile_input_escaped_and_cut(daemon) -> None:
    with grpc.insecure_channel(daemon.address) as channel:
        stub = pb_grpc.KvgraftStub(channel)

        error = _refusal(stub.Stat, pb.StatRequest(artifact_id="a" * 10_000))
        assert error.code() == CODE.INVALID_ARGUMENT
        _shown_safely(error.details())
        assert error.details() == (
            f"'{'a' * 63}…[10002 chars] is not an artifact id: give 8 to 64 hex characters"
        )

        error = _refusal(stub.Replicate, pb.ReplicateRequest(source=HOSTILE + ":1"), stream=True)
        assert error.code() == CODE.INVALID_ARGUMENT  # not a host name: refused as such
        details = error.details()
        _shown_safely(details)
        assert details.startswith(
            "Replicate needs the source as host:port or a gRPC target such as unix:PATH or "
            "dns:///host:port (its host is not a host name or "
            "address: got '\\x1b[2J\\u202e\\u2066evil\\u2069\\nINFO forged log line\\x00xxxx"
        )
        assert "…[10013 chars] the address at which this daemon reaches it" in details

        error = _refusal(stub.Stat, pb.StatRequest(artifact_id="\u202eabcdef12"))
        assert error.code() == CODE.INVALID_ARGUMENT
        assert error.details().startswith("'\\u202eabcdef12' is not an artifact id")


def test_ask_refuses_an_overlong_question_at_once(start_daemon, real_model_args) -> None:
    daemon = start_daemon(extra_args=[*real_model_args, "--max-context-tokens", "65536"])
    wait_model_ready(daemon.address)
    with grpc.insecure_channel(daemon.address) as channel:
        ask = pb_grpc.KvgraftStub(channel).Ask
        within = pb.AskRequest(text="!" * 200_000 + "a", library_tag="none-such")
        error = _refusal(ask, within)  # normalized in linear time: on to the library path
        assert error.code() == CODE.NOT_FOUND, error.details()
        assert error.details().startswith("the library has no entries tagged 'none-such'")

        error = _refusal(ask, pb.AskRequest(text="!" * 400_000 + "a"))
        assert error.code() == CODE.INVALID_ARGUMENT, error.details()
        assert error.details() == (  # 4 characters a token, "a", the chat template
            "the question is 100031 tokens, more than max_context_tokens=65536; shorten it"
        )
