"""An artifact the bucket does not hold yet is never evicted, from its acknowledgement on.

The race of issue 32: with a store budget, the keeper's eviction pass ran between
an artifact's local commit and its entry in the write-back queue (or, written
through, before its upload), so an acknowledged artifact was evicted and never
reached the bucket. Here the race is made deterministic: the store's commit is
wrapped so that the keeper's own pass (`Evictor.evict_past_high`) runs right
after the commit, before the remote tier's view gets control back. The remote
tier is wired as the daemon wires it (`RemoteService.open`), in front of a real
S3 server (SeaweedFS) behind a link the test takes down (tests/remote/s3_link.py).

* write-back, the bucket down: the artifact committed is still stored and
  queued after the pass; once the queue holds the whole budget, a write is
  refused saying so (not "pinned artifacts", which was false), and its queue
  entry is taken out again; with the bucket back, the queue drains and the
  uploaded artifacts make room.
* write-through: the artifact is held until its upload ends, so the call
  returns with the artifact in the bucket (it was: evicted first, the upload
  found nothing, and the call still said OK).
* a write-through upload that fails says the local copy is not held: a retry
  is what uploads it (it said "Nothing is lost", and a budget could evict it).
* a queue entry that cannot be written (no inode left on the data disk, the data
  directory deleted) stores nothing and says why.
* a view cannot be built without the holds the evictor sees.
"""

from __future__ import annotations

import inspect
import random
import shutil
from pathlib import Path

import pytest

from kvgraft.errors import FailedPrecondition, ResourceExhausted, Unavailable
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.config import DaemonConfig
from kvgraftd.remote.backed_store import RemoteBackedStore
from kvgraftd.remote.push_queue import WriteBackQueue
from kvgraftd.remote.service import RemoteService
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.eviction import CacheBudget
from kvgraftd.store.page_records import page_records_of
from kvgraftd.store.signing import Signer, TrustPolicy
from kvgraftd.testing.s3_server import SeaweedS3, s3_env
from tests.remote.s3_link import S3Link
from tests.support.factory import random_artifact
from tests.support.small_disks import tmpfs

BUCKET = "kvgraft"


def small_artifact(rng: random.Random):
    return random_artifact(
        rng, num_layers=2, kv_heads=2, head_dim=16, kv_dtype=pb.KV_DTYPE_FLOAT32,
        tokens=100, page_tokens=16,
    )  # fmt: skip


def open_remote(data: Path, s3: SeaweedS3, link: S3Link, write: str, monkeypatch):
    """A store with a budget of two artifacts, its remote tier as the daemon wires it, and
    the keeper's eviction pass hooked right after every local commit."""
    for name, value in s3_env().items():
        monkeypatch.setenv(name, value)
    store = Store(data / "store", initial_map_bytes=1 << 22, min_free_bytes=0,
                  budget=CacheBudget(artifacts=2))  # fmt: skip
    config = DaemonConfig(
        data=data, remote_endpoint=link.endpoint, remote_bucket=BUCKET,
        remote_prefix=f"holds-{write}", remote_write=write, remote_timeout_s=5.0,
    )  # fmt: skip
    trust = TrustPolicy(Signer.generate())
    remote = RemoteService.open(config, store, trust)
    commit = store.commit_artifact

    def commit_then_keeper_pass(*args):
        result = commit(*args)
        store.evictor.evict_past_high()  # the keeper wakes on the commit: it runs now
        return result

    monkeypatch.setattr(store, "commit_artifact", commit_then_keeper_pass)
    return store, remote, remote.view(store, read_through=False), trust


def put(view, trust: TrustPolicy, artifact) -> str:
    records = page_records_of(artifact.pages)
    return view.commit_artifact(artifact.manifest, records, trust.computed(artifact.id)).artifact_id


def in_bucket(s3: SeaweedS3, prefix: str, artifact) -> bool:
    key = f"{prefix}/{artifact.manifest.model_fingerprint.hex()}/manifests/{artifact.id}"
    return s3.client().list_objects_v2(Bucket=BUCKET, Prefix=key)["KeyCount"] == 1


def test_write_back_never_evicts_what_waits_for_its_upload(s3, tmp_path, monkeypatch) -> None:
    rng = random.Random(32)
    link = S3Link(s3.ports["s3"], mode="down")
    store, remote, view, trust = open_remote(tmp_path, s3, link, "back", monkeypatch)
    try:
        first, second, third = (small_artifact(rng) for _ in range(3))
        put(view, trust, first)
        put(view, trust, second)  # past the high watermark: the pass evicts what it may
        assert store.evictor.counters.artifacts == 0
        assert {aid for aid, _ in store.list_records(b"", 10)} == {first.id, second.id}
        assert sorted(remote.queue.pending()) == sorted([first.id, second.id])

        with pytest.raises(ResourceExhausted) as refused:
            put(view, trust, third)
        message = str(refused.value)
        assert "2 artifacts" in message and "not yet uploaded to the remote tier" in message
        assert "pinned" not in message  # none is
        assert sorted(remote.queue.pending()) == sorted([first.id, second.id])  # not `third`
        assert remote.queue.backlog() == 2

        link.set_mode("up")  # the bucket is back: the queue drains (now, not at its backoff)
        assert remote.queue.drain()[1] == []
        assert remote.queue.backlog() == 0
        assert in_bucket(s3, "holds-back", first) and in_bucket(s3, "holds-back", second)
        put(view, trust, third)  # uploaded artifacts make room now
        assert store.evictor.counters.artifacts >= 1
        assert store.usage(third.id) is not None
    finally:
        remote.stop()
        store.close()
        link.close()


def test_write_through_holds_the_artifact_until_it_is_uploaded(s3, tmp_path, monkeypatch):
    rng = random.Random(33)
    link = S3Link(s3.ports["s3"])
    store, remote, view, trust = open_remote(tmp_path, s3, link, "through", monkeypatch)
    try:
        assert remote.remote.check()  # answered, however long the start-up probe took
        pinned, fresh = small_artifact(rng), small_artifact(rng)
        put(view, trust, pinned)
        store.set_pinned(pinned.id, True)  # so the pass can only take `fresh`
        put(view, trust, fresh)  # the pass runs before the upload
        assert in_bucket(s3, "holds-through", fresh)
        assert store.usage(fresh.id) is not None  # and nothing was evicted under the upload
        assert store.evictor.counters.artifacts == 0
    finally:
        remote.stop()
        store.close()
        link.close()


def test_a_queue_entry_that_cannot_be_written_stores_nothing(s3, tmp_path, monkeypatch):
    with tmpfs(tmp_path / "few-inodes", "size=32m,nr_inodes=64") as disk:
        link = S3Link(s3.ports["s3"], mode="down")
        store = remote = None
        try:
            store, remote, view, trust = open_remote(disk, s3, link, "back", monkeypatch)
            kept = small_artifact(random.Random(34))
            put(view, trust, kept)
            filler = 0
            while True:  # every inode taken: the next queue entry has none
                try:
                    (disk / f"filler-{filler}").touch()
                except OSError:
                    break
                filler += 1
            refused = small_artifact(random.Random(35))
            with pytest.raises(ResourceExhausted, match="cannot be queued for its upload"):
                put(view, trust, refused)
            assert store.usage(refused.id) is None
            assert remote.queue.pending() == [kept.id] and remote.queue.backlog() == 1
        finally:
            if remote is not None:
                remote.stop()
            if store is not None:
                store.close()
            link.close()


def test_a_failed_write_through_upload_says_to_retry(s3, tmp_path, monkeypatch) -> None:
    """Regression (issue 32's review): it said "Nothing is lost: retry, or run `kvgraft
    remote sync`", but its hold ends with the call, so a budget may evict the local copy
    before any sync: a retry of the call is the safe way, and the message says so."""
    link = S3Link(s3.ports["s3"], mode="down")
    store, remote, view, trust = open_remote(tmp_path, s3, link, "through", monkeypatch)
    try:
        artifact = small_artifact(random.Random(36))
        with pytest.raises(Unavailable) as failed:
            put(view, trust, artifact)
        message = str(failed.value)
        assert "stored locally" in message and "Retry this call" in message
        assert "may be evicted" in message and "Nothing is lost" not in message
        assert store.usage(artifact.id) is not None
        assert not store.evictor.keep(bytes.fromhex(artifact.id))  # as said: not held
    finally:
        remote.stop()
        store.close()
        link.close()


def test_a_queue_entry_in_a_deleted_data_directory_says_so(tmp_path) -> None:
    """Regression (issue 32's review): any error but a full disk escaped raw (INTERNAL)."""
    queue = WriteBackQueue(tmp_path / "data" / "remote-queue", push=lambda artifact_id: None)
    shutil.rmtree(tmp_path / "data")
    artifact_id = "ab" * 32
    entry = queue.committing(artifact_id, stored=lambda: False)
    with pytest.raises(FailedPrecondition, match="was the data directory deleted"), entry:
        pass  # the commit: never reached
    assert not queue.holds(bytes.fromhex(artifact_id)) and queue.backlog() == 0


def test_a_view_needs_the_holds_the_evictor_sees() -> None:
    """Regression (issue 32's review): without `uploads` a view fell back to holds of its
    own, which no evictor asked: its write-through uploads could be evicted under way."""
    uploads = inspect.signature(RemoteBackedStore).parameters["uploads"]
    assert uploads.default is inspect.Parameter.empty
