"""kill -9 with write-back, a store budget and the bucket down: nothing acknowledged is lost.

Issue 32's done-when. A store-only daemon writes back to a real S3 server
(SeaweedFS) through a link the test takes down (tests/remote/s3_link.py), with
a store budget a few dozen artifacts fill. Each round, with the bucket down,
client threads put artifacts until the daemon is killed (-9) at a random
moment; puts past what the budget can take are refused, saying the upload
queue holds it. The daemon restarts on the same data directory, the bucket
still down:

* every artifact acknowledged this round is stored, whole, and queued for
  upload (none was evicted: the bucket has none of them);
* every artifact acknowledged in an earlier round is in the store or, whole,
  in the bucket (an evicted one was uploaded first).

Then the bucket comes back and a sync drains the queue: every artifact acknowledged
so far is in the store or in the bucket, and the next round's puts make room
by evicting uploaded ones.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from dataclasses import dataclass, field

from kvgraft import Client
from kvgraft.artifact import Artifact, page_sizes
from kvgraft.errors import KvgraftError, ResourceExhausted, Unavailable
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.testing.s3_server import SeaweedS3, s3_env
from tests.remote.s3_link import S3Link
from tests.support.factory import random_artifact
from tests.support.store_audit import assert_served_whole

BUCKET = "kvgraft"
PREFIX = "crash"
ROUNDS = 3
PUT_THREADS = 2
FULL = "not yet uploaded to the remote tier"  # what a refused put says holds the budget


@dataclass
class Round:
    attempted: dict[str, Artifact] = field(default_factory=dict)
    acked: dict[str, Artifact] = field(default_factory=dict)
    refusals: list[str] = field(default_factory=list)
    failures: list[tuple[float, BaseException]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def small_artifact(rng: random.Random) -> Artifact:
    """2 to 14 pages of at most 4 KiB: a 1 MiB budget takes a few dozen."""
    return random_artifact(
        rng, num_layers=2, kv_heads=2, head_dim=16, kv_dtype=pb.KV_DTYPE_FLOAT32,
        tokens=rng.randint(16, 100), page_tokens=16,
    )  # fmt: skip


def put_loop(address: str, rng: random.Random, round_: Round, stop: threading.Event) -> None:
    with Client(address, timeout_s=30) as client:
        while not stop.is_set():
            artifact = small_artifact(rng)
            with round_.lock:
                round_.attempted[artifact.id] = artifact
            try:
                client.put_artifact(artifact)
            except ResourceExhausted as exc:
                round_.refusals.append(str(exc))
                stop.wait(0.02)  # the queue holds the budget: every put is refused now
                continue
            except KvgraftError as exc:
                round_.failures.append((time.monotonic(), exc))
                return
            with round_.lock:
                round_.acked[artifact.id] = artifact


class Bucket:
    """What the bucket holds under PREFIX now (one listing)."""

    def __init__(self, s3: SeaweedS3) -> None:
        self._client = s3.client()
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=PREFIX)
        self._keys = {item["Key"] for page in pages for item in page.get("Contents", ())}

    def holds(self, artifact: Artifact) -> bool:
        """The manifest, hashing to the id, and every page (the server checked each one's
        SHA-256 on its way in: x-amz-checksum-sha256)."""
        base = f"{PREFIX}/{artifact.manifest.model_fingerprint.hex()}"
        manifest = f"{base}/manifests/{artifact.id}"
        if manifest not in self._keys:
            return False
        body = self._client.get_object(Bucket=BUCKET, Key=manifest)["Body"].read()
        assert hashlib.sha256(body).hexdigest() == artifact.id
        pages = {f"{base}/pages/{digest.hex()}" for digest in page_sizes(artifact.manifest)}
        return pages <= self._keys


def crash_round(daemon, link: S3Link, rng: random.Random, earlier: dict[str, Artifact], s3):
    link.set_mode("down")
    round_ = Round()
    stop = threading.Event()
    threads = [
        threading.Thread(
            target=put_loop, args=(daemon.address, random.Random(rng.random()), round_, stop)
        )
        for _ in range(PUT_THREADS)
    ]
    for thread in threads:
        thread.start()
    time.sleep(rng.uniform(0.1, 1.5))
    killed_at = time.monotonic()
    daemon.kill()
    stop.set()
    for thread in threads:
        thread.join()
    assert "Traceback" not in daemon.log(), daemon.log()
    for seen_at, exc in round_.failures:  # before the kill nothing fails but a full budget
        assert seen_at >= killed_at and isinstance(exc, Unavailable), repr(exc)
    assert all(FULL in message for message in round_.refusals), round_.refusals[:1]

    daemon.launch()  # the bucket still down
    with Client(daemon.address, timeout_s=60) as client:
        listed = {info.artifact_id for info in client.list_artifacts()}
        queued = {path.name for path in (daemon.data_dir / "remote-queue").iterdir()}
        lost = set(round_.acked) - listed
        assert not lost, f"acknowledged, never uploaded, and gone: {sorted(lost)}"
        assert set(round_.acked) <= queued
        for aid, sent in round_.acked.items():
            assert_served_whole(client.get_artifact(aid), sent)
        bucket = Bucket(s3)
        for aid in set(earlier) - listed:
            assert bucket.holds(earlier[aid]), f"{aid} is neither stored nor in the bucket"
    earlier.update(round_.acked)
    return round_


def test_acknowledged_write_back_artifacts_survive_kill_9(s3, start_daemon) -> None:
    rng = random.Random(3207)
    link = S3Link(s3.ports["s3"], mode="down")
    remote = ["--remote-endpoint", link.endpoint, "--remote-bucket", BUCKET]
    remote += ["--remote-prefix", PREFIX, "--remote-write", "back", "--remote-timeout-s", "5"]
    daemon = start_daemon(extra_args=[*remote, "--store-budget-bytes", "1MiB"], env=s3_env())
    acked: dict[str, Artifact] = {}
    refused = 0
    try:
        for _ in range(ROUNDS):
            round_ = crash_round(daemon, link, rng, acked, s3)
            refused += len(round_.refusals)
            link.set_mode("up")  # the bucket is back: a sync drains the backlog now
            with Client(daemon.address, timeout_s=60) as client:
                synced = client.remote_sync(push=True, pull=False)
                assert list(synced.failures) == [] and synced.backlog_artifacts == 0
                listed = {info.artifact_id for info in client.list_artifacts()}
            bucket = Bucket(s3)
            for aid in set(acked) - listed:
                assert bucket.holds(acked[aid]), f"{aid} is neither stored nor in the bucket"
    finally:
        link.close()
    assert len(acked) > 0 and refused > 0  # the budget was filled: the race was run
