"""Opening a store of format 1 (page bytes inside LMDB) moves it to format 2, then 3.

Format 3 adds trust: artifacts stored before have no provenance, so they are
untrusted (never grafted automatically) until verified, and the chain index that
Generate's prefix lookup reads holds none of their pages.

tests/data/store-format-1.tar.gz is a store written by kvgraft at commit
b6e059f (format 1): two artifacts sharing pages, a third one deleted, two
staged pages; expected.json beside it lists what it holds. Pages are checked
by their SHA-256, which names them.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

import lmdb
import pytest

from kvgraft.artifact import page_sizes
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store import migration as store_migration
from kvgraftd.store import segments
from kvgraftd.store.artifact_store import Store

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "store-format-1.tar.gz"


def _unpack(tmp_path: Path) -> tuple[Path, dict]:
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp_path, filter="data")
    return tmp_path / "store", json.loads((tmp_path / "expected.json").read_text())


def _assert_holds_exactly(path: Path, expected: dict) -> None:
    store = Store(path, min_free_bytes=1 << 20)
    try:
        stats = store.stats()
        assert (stats.artifacts, stats.pages, stats.page_bytes, stats.staged_pages) == (
            len(expected["artifacts"]),
            expected["pages"],
            expected["page_bytes"],
            expected["staged_pages"],
        )
        assert stats.last_sequence == expected["last_sequence"]
        for artifact_id, pages in expected["artifacts"].items():
            digests = list(page_sizes(store.get_record(artifact_id).manifest()))
            assert [d.hex() for d in digests] == pages
            with store.verified_pages(digests) as views:
                assert [hashlib.sha256(view).digest() for view in views] == digests
            provenance = store.provenance(artifact_id)
            assert provenance.trust == pb.Provenance.TRUST_UNTRUSTED, provenance
        staged = [bytes.fromhex(d) for d in expected["staged"]]
        assert store.missing_pages(staged) == []  # still staged, still collectable
    finally:
        store.close()
    with lmdb.open(str(path), max_dbs=16, readonly=True, lock=False) as env:
        with env.begin(db=env.open_db(b"meta", create=False)) as txn:
            assert txn.get(b"format_version") == b"4"
        heads = env.open_db(b"untrusted_heads", create=False)  # for Lookup to name them
        with env.begin(db=env.open_db(b"chains", create=False)) as txn:
            assert txn.stat(env.open_db(b"chains", create=False))["entries"] == 0
            assert txn.stat(heads)["entries"] == len(expected["artifacts"])
        with pytest.raises(lmdb.NotFoundError):
            env.open_db(b"pages", create=False)  # dropped


def test_a_format_1_store_is_migrated_when_opened(tmp_path: Path) -> None:
    path, expected = _unpack(tmp_path)
    _assert_holds_exactly(path, expected)
    _assert_holds_exactly(path, expected)  # and opens as format 4 after
    store = Store(path, min_free_bytes=1 << 20)
    try:
        assert store.collect_staged(older_than_s=-1) == len(expected["staged"])
    finally:
        store.close()


def test_a_migration_cut_short_goes_on_at_the_next_open(tmp_path: Path, monkeypatch) -> None:
    path, expected = _unpack(tmp_path)
    monkeypatch.setattr(store_migration, "BATCH_BYTES", 4096)  # a page or two per batch
    commits = 0
    real_commit = segments.SegmentFiles.commit

    def dies_after_two_batches(self) -> None:
        nonlocal commits
        commits += 1
        if commits == 3:
            raise RuntimeError("killed")  # the third batch's transaction has committed
        real_commit(self)

    monkeypatch.setattr(segments.SegmentFiles, "commit", dies_after_two_batches)
    with pytest.raises(RuntimeError, match="killed"):
        Store(path, min_free_bytes=1 << 20)
    with lmdb.open(str(path), max_dbs=16, readonly=True, lock=False) as env, env.begin() as txn:
        moved = txn.stat(env.open_db(b"page_locations", txn=txn, create=False))["entries"]
        left = txn.stat(env.open_db(b"pages", txn=txn, create=False))["entries"]
    assert moved > 0 and left > 0 and moved + left == expected["pages"]
    monkeypatch.setattr(segments.SegmentFiles, "commit", real_commit)
    _assert_holds_exactly(path, expected)
