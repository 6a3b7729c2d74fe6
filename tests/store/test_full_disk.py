"""A disk that fills up under the store: every write fails cleanly, nothing takes the daemon down.

On a real filesystem that fills (a small tmpfs: the `small_disk` fixture of tests/conftest.py):

* a disk filled by another process between the store's free-space check and its write:
  the write fails with RESOURCE_EXHAUSTED, whether the segment write or LMDB's commit
  meets the full disk (LMDB reports a short write as EIO), and the store goes on;
* LMDB's reader table is a sparse file written through a shared mapping: a reader
  taking a slot on a page of it never written before, on a full disk, was SIGBUS;
* a daemon with `cache = "auto"` on a full disk answers every Generate with a fresh
  run's receipt, counts the deposits it skipped, and stops without a traceback.
"""

from __future__ import annotations

import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest

from kvgraft import Client
from kvgraft.artifact import Artifact
from kvgraft.errors import ResourceExhausted
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.lmdb_env import LmdbEnv
from kvgraftd.store.page_records import page_records_of
from kvgraftd.testing.daemon_process import DaemonProcess, wait_model_ready
from tests.support.factory import random_artifact
from tests.support.small_disks import fill


def _copy(artifact: Artifact, label: str) -> Artifact:
    """The same pages under another manifest: committing it writes the index only."""
    manifest = artifact.manifest
    return Artifact.build(
        model_fingerprint=manifest.model_fingerprint,
        layout=manifest.layout,
        profile=manifest.profile,
        token_ids=list(manifest.token_ids),
        page_bytes=[artifact.pages[digest] for digest in manifest.page_sha256],
        segment_ends=list(manifest.segment_ends),
        labels={"copy": label},
    )


def test_a_disk_filled_under_a_write_fails_it_cleanly(small_disk, rng, monkeypatch) -> None:
    many_pages = random_artifact(rng, num_layers=8, kv_heads=1, head_dim=8, tokens=512,
                                 page_tokens=4, kv_dtype=pb.KV_DTYPE_FLOAT32)  # fmt: skip
    with closing(Store(small_disk / "s", initial_map_bytes=1 << 20, min_free_bytes=0)) as store:
        store.commit_artifact(many_pages.manifest, page_records_of(many_pages.pages))
        real_check = LmdbEnv._check_free_space
        filler: list[Path] = []

        def another_process_fills_the_disk(self, needed_bytes: int, file_bytes: int) -> None:
            real_check(self, needed_bytes, file_bytes)  # passed: now the disk fills
            filler.append(fill(small_disk, leave=8 << 10))

        monkeypatch.setattr(LmdbEnv, "_check_free_space", another_process_fills_the_disk)
        new_pages = random_artifact(rng, num_layers=2, tokens=64, page_tokens=16)
        with pytest.raises(ResourceExhausted, match="is full; nothing was written"):
            store.commit_artifact(new_pages.manifest, page_records_of(new_pages.pages))
        filler.pop().unlink()
        index_only = _copy(many_pages, "index only")  # its pages are stored: LMDB fails
        with pytest.raises(ResourceExhausted, match="is full; nothing was written"):
            store.commit_artifact(index_only.manifest, {})
        filler.pop().unlink()
        monkeypatch.setattr(LmdbEnv, "_check_free_space", real_check)

        assert store.stats().artifacts == 1  # neither write left anything behind
        for artifact in (new_pages, index_only):
            store.commit_artifact(artifact.manifest, page_records_of(artifact.pages))
        assert store.stats().artifacts == 3
        assert store.read_page(many_pages.manifest.page_sha256[0])[0] == bytes(
            many_pages.pages[many_pages.manifest.page_sha256[0]]
        )


READERS = """
import sys, threading
from kvgraftd.store.artifact_store import Store
store = Store(sys.argv[1], initial_map_bytes=1 << 20, min_free_bytes=0)
open(sys.argv[2], "ab").close()  # opened: the test fills the disk now
input()
readers, entered, leave = 200, threading.Barrier(201), threading.Event()
def read():
    with store._lmdb.read():  # a reader slot each, all held at once
        entered.wait()
        leave.wait()
threads = [threading.Thread(target=read) for _ in range(readers)]
[t.start() for t in threads]
entered.wait()
leave.set()
[t.join() for t in threads]
store.close()
print("read", readers)
"""


def test_readers_never_fault_on_a_full_disk(small_disk) -> None:
    """200 readers at once on a store opened before its disk filled (in a process of its
    own: the fault was SIGBUS, exit -7)."""
    opened = small_disk / "opened"
    process = subprocess.Popen(
        [sys.executable, "-c", READERS, str(small_disk / "s"), str(opened)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        while not opened.exists():
            assert process.poll() is None, process.stderr.read()
            time.sleep(0.05)
        fill(small_disk)
        out, err = process.communicate("\n", timeout=60)
    finally:
        process.kill()
    assert (process.returncode, out.strip()) == (0, "read 200"), err


TINY = ["--model", "tiny:0", "--page-tokens", "16", "--block-tokens", "16"]


def test_a_full_disk_never_fails_a_generate_under_cache_auto(small_disk) -> None:
    daemon = DaemonProcess.start(
        small_disk / "data", [*TINY, "--cache", "auto", "--min-free-bytes", "1MiB"]
    )
    try:
        wait_model_ready(daemon.address)
        prompts = [[(7 * i + j) % 500 + 5 for j in range(40)] for i in range(4)]
        with Client(daemon.address) as client:
            kept = client.generate(token_ids=prompts[0], max_new_tokens=2)
            assert kept.deposited_artifact_id  # room yet: kept
            fill(small_disk)
            for prompt in [*prompts, [*prompts[0], 1, 2]]:  # the last one grafts the first
                got = client.generate(token_ids=prompt, max_new_tokens=2)
                fresh = client.generate(token_ids=prompt, max_new_tokens=2, no_cache=True)
                assert got.receipt.generated_logits_sha256 == fresh.receipt.generated_logits_sha256
                assert not got.deposited_artifact_id
            assert got.reused_tokens == len(prompts[0])  # the context kept first, to the token
            cache = client.info().cache
            assert (cache.auto_deposits, cache.auto_deposits_skipped) == (1, 10)  # fresh ones too
        assert daemon.terminate() == 0  # its last uses cannot be written: said, no traceback
        assert "Traceback" not in daemon.log()
    finally:
        daemon.stop()
