"""A hung or dying S3 server never stalls the start nor a local request.

Issue 32's probe: a hung endpoint made the start take 45 s (the bucket check,
retried), a write-back Deposit take 40 s, and every time the breaker let a
request through as its probe, the requests under way waited ~40 s with it.
The remote tier's timeout here is an hour, so any wait on the hung server
would show as a call that never ends (the client's deadline), never as a
figure to compare. The server sits behind a link the test switches between
up, down (each request's connection closed unanswered) and hung (never an
answer), recording every request it refuses (tests/remote/s3_link.py):

* hung from the start: the daemon serves while its first probe hangs;
  Deposit (written back), Generate, Lookup and a Graft of an unknown id answer
  from the local store; a write-through daemon's PutArtifact fails at once,
  saying the artifact is stored locally; no read reached the server;
* back up: the breaker closes (a probe, not a request, found it), the
  write-back backlog drains;
* down while answering: the first request's read is made once (botocore's
  retries made it three), then the breaker is open and no request asks again;
* hung again: while the breaker's probe hangs, requests answer from the
  local store and none reaches the server.
"""

from __future__ import annotations

import random
import time

import pytest

from kvgraft import Client
from kvgraft.errors import NotFound, Unavailable
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.testing.daemon_process import wait_model_ready
from kvgraftd.testing.s3_server import s3_env
from tests.remote.s3_link import S3Link
from tests.support.factory import random_artifact

BUCKET = "kvgraft"
MODEL = ["--model", "tiny:0", "--page-tokens", "16", "--block-tokens", "64"]
MODEL += ["--device-budget-bytes", "16MiB", "--host-budget-bytes", "16MiB"]  # fast starts
PROBE = "GET /kvgraft?list-type=2"  # the breaker's check: a one-key listing
READS = "GET /kvgraft/hung/"  # chains, manifests, pages


def remote_args(link: S3Link, write: str) -> list[str]:
    return [
        *("--remote-endpoint", link.endpoint, "--remote-bucket", BUCKET),
        *("--remote-prefix", "hung", "--remote-write", write, "--remote-timeout-s", "3600"),
    ]


def wait_for(condition, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_a_hung_bucket_never_stalls_the_start_nor_a_request(s3, start_daemon) -> None:
    link = S3Link(s3.ports["s3"], mode="hung")
    try:
        back = start_daemon(extra_args=MODEL + remote_args(link, "back"), env=s3_env())
        assert "not answering yet" in back.log()  # it serves while its first probe hangs
        assert link.refused("hung", PROBE)
        through = start_daemon(extra_args=remote_args(link, "through"), env=s3_env())
        wait_model_ready(back.address)
        _served_locally(back, through, link)
        _back_up(back, link)
        _down_while_answering(back, link)
        _probe_hangs(back, link)
    finally:
        link.close()


def _served_locally(back, through, link: S3Link) -> None:
    with Client(back.address, timeout_s=60) as client, Client(through.address) as other:
        prompt = list(range(5, 45))
        deposited = client.deposit(token_ids=prompt)  # written back: queued
        grafted = client.generate(token_ids=[*prompt, 7], max_new_tokens=2)
        local = 40 if grafted.receipt.raw.profile.products else 32  # tail page: row-invariant
        assert grafted.reused_tokens == local
        assert client.lookup(prompt).matched_tokens == local
        with pytest.raises(NotFound):
            client.graft("ab" * 32, token_ids=[5], max_new_tokens=1)
        status = client.remote_status()
        assert (status.reachable, status.backlog_artifacts) == (False, 1)
        assert client.stat(deposited.artifact_id).info.artifact_id == deposited.artifact_id

        artifact = random_artifact(
            random.Random(7), num_layers=2, kv_heads=2, head_dim=16,
            kv_dtype=pb.KV_DTYPE_FLOAT32, tokens=40, page_tokens=16,
        )  # fmt: skip
        with pytest.raises(Unavailable, match=r"stored locally.*not answered yet"):
            other.put_artifact(artifact)  # not tried: the bucket has never answered
        assert other.stat(artifact.id).info.artifact_id == artifact.id
    assert link.refused("hung", READS) == []  # no request waited on the hung server


def _back_up(back, link: S3Link) -> None:
    link.set_mode("up")  # the hung probe's connection ends: the next probe finds it back
    with Client(back.address, timeout_s=60) as client:
        wait_for(lambda: client.lookup([1, 2, 3]) and client.remote_status().reachable, "a probe")
        wait_for(lambda: client.remote_status().backlog_artifacts == 0, "the drain")
        assert client.remote_status().uploaded_artifacts == 1


def _down_while_answering(back, link: S3Link) -> None:
    link.set_mode("down")
    with Client(back.address, timeout_s=60) as client:
        prompt = list(range(100, 140))  # nothing local: the bucket is asked for page 0
        for _ in range(3):
            assert client.generate(token_ids=prompt, max_new_tokens=1).reused_tokens == 0
        asked = link.refused("down", READS)
        assert len(asked) == 1 and "/chains/" in asked[0], asked  # once, then the breaker
        assert not client.remote_status().reachable


def _probe_hangs(back, link: S3Link) -> None:
    link.set_mode("hung")
    with Client(back.address, timeout_s=60) as client:
        prompt = list(range(200, 240))
        wait_for(
            lambda: client.lookup(prompt) and link.refused("hung", PROBE)[1:], "a probe to hang"
        )  # the first hung probe was the start's
        for _ in range(3):
            assert client.generate(token_ids=prompt, max_new_tokens=1).reused_tokens == 0
            assert client.lookup(prompt).matched_tokens == 0
        assert not client.remote_status().reachable
    assert link.refused("hung", READS) == []
