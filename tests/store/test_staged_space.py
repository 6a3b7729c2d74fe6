"""Staged pages and the store's budget, in-process on a real store: pages staged by uploads
that never send their manifest are outside the budget (they never make the store evict),
a commit claiming them brings them in, an upload in progress keeps its pages past the TTL,
and the segment files hold the budget under racing commits."""

from __future__ import annotations

import os
import random
import threading
from contextlib import suppress
from pathlib import Path

import pytest

from kvgraft import wire
from kvgraft.artifact import page_sizes
from kvgraft.errors import ResourceExhausted
from kvgraft.page_buffers import block_aligned
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store import staging
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.eviction import CacheBudget, CacheKeeper
from kvgraftd.store.intake import PageIntake
from kvgraftd.store.page_records import page_records_of
from kvgraftd.store.upload_limits import UploadBounds
from tests.support.factory import random_artifact

LAYOUT = {"num_layers": 2, "kv_heads": 1, "head_dim": 32, "kv_dtype": pb.KV_DTYPE_FLOAT32}


def _artifact(rng: random.Random, tokens: int = 64):  # 8 pages of 4 KiB
    return random_artifact(rng, tokens=tokens, page_tokens=16, **LAYOUT)


def _disk(artifact) -> int:
    return sum(block_aligned(size) for size in page_sizes(artifact.manifest).values())


def _open(path: Path, **budget) -> Store:
    return Store(path, initial_map_bytes=1 << 22, min_free_bytes=0, budget=CacheBudget(**budget))


def _commit(store: Store, artifact) -> str:
    return store.commit_artifact(artifact.manifest, page_records_of(artifact.pages)).artifact_id


def _held(store: Store) -> set[str]:
    return {aid for aid, _ in store.list_records(bytes(32), 1000)}


def _data_bytes(segments: Path) -> int:
    """The bytes the segment files hold data in: their holes left out, and so is the
    filesystem's own extent metadata, which st_blocks counts besides (a few KiB)."""
    total = 0
    for path in segments.glob("*.seg"):
        with suppress(FileNotFoundError), open(path, "rb") as file:
            fd, at = file.fileno(), 0
            while True:
                try:
                    start = os.lseek(fd, at, os.SEEK_DATA)
                except OSError:  # ENXIO: no data past `at`
                    break
                at = os.lseek(fd, start, os.SEEK_HOLE)
                total += at - start
    return total


def test_staged_pages_never_make_the_store_evict(tmp_path, rng) -> None:
    """Was: pages of an upload that never sent its manifest counted against the budget: twice
    the budget of them evicted every artifact, and every later commit was refused."""
    sample = _artifact(rng)
    budget = 8 * _disk(sample)
    store = _open(tmp_path / "s", bytes=budget)
    kept = {_commit(store, _artifact(rng)) for _ in range(5)}
    orphans = {}
    for _ in range(16):  # 16 artifacts' pages, no manifest: twice the budget
        orphans.update(_artifact(rng).pages)
    assert store.stage_pages(page_records_of(orphans)) == len(orphans)
    assert store.cache_totals() == (5, 5 * _disk(sample))  # what the budget counts
    assert store.evictor.evict_past_high() == 0
    kept.add(_commit(store, _artifact(rng)))
    assert _held(store) == kept and store.evictor.counters.artifacts == 0
    assert store.stats().staged_pages == len(orphans)  # bounded apart, collected by their TTL
    store.close()


def test_a_commit_claiming_staged_pages_counts_them(tmp_path, rng) -> None:
    """Staged pages enter the budget when a manifest claims them: the commit makes room for
    them as for pages it writes."""
    sample = _artifact(rng)
    budget = 7 * _disk(sample) // 2  # room for three and a half
    store = _open(tmp_path / "s", bytes=budget)
    older = [_commit(store, _artifact(rng)) for _ in range(3)]
    uploaded = _artifact(rng)
    store.stage_pages(page_records_of(uploaded.pages))  # sent before its manifest
    assert store.cache_totals()[1] == 3 * _disk(sample)
    store.commit_artifact(uploaded.manifest, {})  # it writes nothing: it claims
    assert store.cache_totals()[1] <= budget
    assert _held(store) == {older[2], uploaded.id}  # down to the low watermark, LRU first
    assert store.stats().staged_pages == 0
    store.close()


def test_an_upload_in_progress_keeps_its_staged_pages_past_the_ttl(tmp_path, rng) -> None:
    """A slow upload's first pages are older than staged_ttl_s before its manifest comes:
    they are collected only once it has ended without claiming them."""
    store = _open(tmp_path / "s")
    slow, abandoned = _artifact(rng), _artifact(rng)
    store.stage_pages(page_records_of(abandoned.pages))
    staged: dict[bytes, int] = {}
    with store.uploading(staged):
        staged.update(dict.fromkeys(slow.pages, 0))
        store.stage_pages(page_records_of(slow.pages))
        assert store.collect_staged(older_than_s=-1) == len(abandoned.pages)
        assert store.missing_pages(list(slow.pages)) == []
    assert store.collect_staged(older_than_s=-1) == len(slow.pages)
    assert store.missing_pages(list(slow.pages)) == list(slow.pages)
    store.close()


def test_an_upload_keeps_its_staged_pages_no_longer_than_a_call_may_run(tmp_path, rng) -> None:
    """Was: a running upload's pages were exempt from collection for ever (a silent
    stream pinned them). The exemption ends `for_s` (the daemon's max_call_s) after the
    upload's start."""
    store = _open(tmp_path / "s")
    upload = _artifact(rng)
    staged = dict.fromkeys(upload.pages, 0)
    with store.uploading(staged, for_s=3600):
        store.stage_pages(page_records_of(upload.pages))
        assert store.collect_staged(older_than_s=-1) == 0
    with store.uploading(staged, for_s=-1):  # ran past max_call_s
        assert store.collect_staged(older_than_s=-1) == len(upload.pages)
    store.close()


def test_collections_scan_only_when_a_page_can_be_due(tmp_path, rng, monkeypatch) -> None:
    """Was: every collection (each minute, each refused upload) scanned all staged pages
    under the lock the budget's readers take. Now it skips the scan while no staged page
    can be past the TTL, and collects in batches (here of 3 pages)."""
    monkeypatch.setattr(staging, "COLLECT_BATCH", 3)
    store = _open(tmp_path / "s")
    orphans = _artifact(rng).pages
    store.stage_pages(page_records_of(orphans))
    assert store.collect_staged(older_than_s=3600) == 0  # after a start: one scan
    assert store.collect_staged(older_than_s=3600) == 0
    assert store._staging.staged_scans == 1
    store.stage_pages(page_records_of(_artifact(rng).pages))  # younger: still none due
    assert store.collect_staged(older_than_s=3600) == 0 and store._staging.staged_scans == 1
    assert store.collect_staged(older_than_s=-1) == 2 * len(orphans)  # 16 in 6 batches
    assert (store._staging.staged_scans, store.stats().staged_pages) == (2, 0)
    assert store.collect_staged(older_than_s=-1) == 0 and store._staging.staged_scans == 2
    store.close()


def test_a_storm_of_refused_uploads_collects_once(tmp_path, rng) -> None:
    """Was: every refused upload collected (a full scan) while a running upload's pages,
    past their TTL but kept, filled staged_max_bytes. Now refusals collect at most once
    per CollectionPace period."""
    store = _open(tmp_path / "s")
    page = 4096
    bounds = UploadBounds.of(spill_bytes=1 << 30, staged_max_bytes=10 * page, staged_ttl_s=0.0,
                             memory_bytes=1 << 30, staged_per_connection=0)  # fmt: skip
    running, others = _artifact(rng), [_artifact(rng) for _ in range(10)]
    with PageIntake(store, bounds, "a") as holder:
        holder.add([wire.Chunk(d, 0, len(p), bytes(p)) for d, p in running.pages.items()])
        assert holder.keep() == ""  # 8 pages staged, due at once, kept while it runs
        before = store._staging.staged_scans
        for other in others:
            with PageIntake(store, bounds, "b") as intake:
                intake.add([wire.Chunk(d, 0, len(p), bytes(p)) for d, p in other.pages.items()])
                assert "staged_max_bytes" in intake.keep()
        assert store._staging.staged_scans - before == 1
    store.close()


def test_a_page_staged_again_keeps_its_charge_and_protection(tmp_path, rng) -> None:
    """Was: staging held records that included a page the upload had staged before
    overwrote its charge with 0 (never credited back), and a refused staging took every
    such page off the collector's protection, not only the ones it had added."""
    store = _open(tmp_path / "s")
    page = 4096
    bounds = UploadBounds.of(spill_bytes=1 << 30, staged_max_bytes=9 * page, staged_ttl_s=3600.0,
                             memory_bytes=1 << 30, staged_per_connection=0)  # fmt: skip
    first, second = _artifact(rng), _artifact(rng)
    with PageIntake(store, bounds, "a") as intake:
        intake.records.update(page_records_of(first.pages))
        intake.stage()
        assert intake.staged == dict.fromkeys(first.pages, page)
        again = dict(list(first.pages.items())[:2])
        intake.records.update(page_records_of(again))  # staged already: charged nothing more
        intake.stage()
        assert intake.staged == dict.fromkeys(first.pages, page)
        new = dict(list(second.pages.items())[:2])
        intake.records.update(page_records_of({**again, **new}))  # 10 pages > 9: refused
        with pytest.raises(ResourceExhausted, match="staged_max_bytes"):
            intake.stage()
        assert intake.staged == dict.fromkeys(first.pages, page)  # only the new ones left
    store.close()


def test_the_disk_holds_the_budget_under_racing_commits(tmp_path, rng) -> None:
    """Was: the space of evicted pages was given back 16 MiB at a time (or by the keeper
    each second), so the segment files reached 37-39 MiB against a 24 MiB budget under
    racing puts. Now, under a byte budget, an eviction gives its space back at once: after
    every commit of four racing writers, the files hold at most the budget."""
    sample = _artifact(rng)
    budget = 12 * _disk(sample)
    store = _open(tmp_path / "s", bytes=budget)
    keeper = CacheKeeper(store, store.evictor).start()
    artifacts = [_artifact(random.Random(seed)) for seed in range(160)]
    held: list[int] = []

    def write(chunk) -> None:
        for artifact in chunk:
            _commit(store, artifact)
            held.append(_data_bytes(store.path / "segments"))

    writers = [threading.Thread(target=write, args=(artifacts[i::4],)) for i in range(4)]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    keeper.stop()
    assert store.evictor.counters.artifacts >= 140  # the budget was filled over and over
    assert len(held) == len(artifacts)
    assert max(held) <= budget
    store.close()
