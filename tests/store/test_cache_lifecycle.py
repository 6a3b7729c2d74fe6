"""The store as a cache, in-process on a real store: budgets and eviction, readers never cut,
last uses across a restart, pins that expire (a clock the test moves)."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import numpy as np
import pytest

from kvgraft.artifact import page_sizes
from kvgraft.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvgraft.page_buffers import block_aligned
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.remote.push_queue import PushesUnderWay
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.eviction import CacheBudget, CacheKeeper, eviction_order
from kvgraftd.store.page_records import page_records_of
from tests.support.factory import Clock, random_artifact

COMPUTED = pb.Provenance(trust=pb.Provenance.TRUST_COMPUTED, origin="computed")
LAYOUT = {"num_layers": 2, "kv_heads": 1, "head_dim": 32, "kv_dtype": pb.KV_DTYPE_FLOAT32}


def _artifact(rng: random.Random, tokens: int = 64):
    return random_artifact(rng, tokens=tokens, page_tokens=16, **LAYOUT)


def _commit(store: Store, artifact) -> str:
    return store.commit_artifact(artifact.manifest, page_records_of(artifact.pages)).artifact_id


def _disk_bytes(artifact) -> int:
    return sum(block_aligned(size) for size in page_sizes(artifact.manifest).values())


def _open(path: Path, clock: Clock, **budget) -> Store:
    return Store(path, initial_map_bytes=1 << 22, min_free_bytes=0, clock=clock,
                 budget=CacheBudget(**budget))  # fmt: skip


def test_concurrent_deposits_and_reads_stay_within_the_budget(tmp_path, rng) -> None:
    """Four writers fill the store ten times over while readers lease and read what they
    find: the disk never exceeds the budget plus one artifact, no read fails, pins stay."""
    clock = Clock()
    sample = _artifact(rng)
    budget = 12 * _disk_bytes(sample)
    store = _open(tmp_path / "s", clock, bytes=budget)
    keeper = CacheKeeper(store, store.evictor).start()
    pinned = [_commit(store, _artifact(rng)) for _ in range(2)]
    for aid in pinned:
        store.set_pinned(aid, True)
    artifacts = [_artifact(random.Random(seed)) for seed in range(120)]
    peaks, failures, stop = [], [], threading.Event()

    def write(chunk) -> None:
        for artifact in chunk:
            _commit(store, artifact)
            peaks.append(store.cache_totals()[1])

    def read() -> None:
        reads = 0
        while not stop.is_set() or reads < 20:
            after = bytes(32)
            for aid, record in store.list_records(after, 1000):
                lease = store.reading(aid)
                try:
                    lease.__enter__()
                except NotFound:
                    continue  # evicted before the lease: the caller computes it
                try:  # anything raised under the lease is a read cut: a failure
                    digests = list(page_sizes(record.manifest()))
                    with store.verified_pages(digests) as views:
                        assert all(len(v) for v in views)
                    reads += 1
                except Exception as exc:
                    failures.append(exc)
                finally:
                    lease.__exit__(None, None, None)

    writers = [threading.Thread(target=write, args=(artifacts[i::4],)) for i in range(4)]
    readers = [threading.Thread(target=read) for _ in range(2)]
    for thread in writers + readers:
        thread.start()
    for thread in writers:
        thread.join()
    stop.set()
    for thread in readers:
        thread.join()
    keeper.stop()
    assert not failures
    assert max(peaks) <= budget + _disk_bytes(sample)
    assert store.evictor.counters.artifacts >= 100
    assert {aid for aid in pinned if store.usage(aid) is not None} == set(pinned)
    store.close()


def test_lru_evicts_the_least_recently_used_and_the_order_survives_a_restart(tmp_path, rng) -> None:
    clock = Clock()
    path = tmp_path / "s"
    store = _open(path, clock, artifacts=100)
    ids = []
    for _ in range(6):
        ids.append(_commit(store, _artifact(rng)))
    used_order = [ids[3], ids[0], ids[5], ids[1], ids[4], ids[2]]
    for aid in used_order:
        clock.now += 1000
        with store.reading(aid):
            pass
    assert eviction_order(store.evictable(), "lru") == [bytes.fromhex(a) for a in used_order]
    store.close()  # writes the last uses
    store = _open(path, clock, artifacts=4)
    assert eviction_order(store.evictable(), "lru") == [bytes.fromhex(a) for a in used_order]
    store.evictor.evict_past_high()  # 6 past the high watermark (3 of 4): down to 3
    left = {bytes.fromhex(aid) for aid, _ in store.list_records(bytes(32), 100)}
    assert left == {bytes.fromhex(a) for a in used_order[3:]}
    changes = store.changes_since(1, 100)
    evicted = [c for c in changes if c.kind == pb.ChangeRecord.KIND_DELETED]
    assert {c.reason for c in evicted} == {pb.ChangeRecord.REASON_EVICTED}
    assert [c.artifact_id for c in evicted] == used_order[:3]
    store.close()


def test_cost_aware_keeps_what_was_reused(tmp_path, rng) -> None:
    clock = Clock()
    store = _open(tmp_path / "s", clock, artifacts=4, policy="cost-aware")
    reused = _commit(store, _artifact(rng))
    with store.reading(reused, reused_tokens=64):
        pass
    others = [_commit(store, _artifact(rng)) for _ in range(2)]
    clock.now += 1000
    for aid in others:  # used more recently than the reused one, but nothing reused from them
        with store.reading(aid):
            pass
    _commit(store, _artifact(rng))  # past the high watermark (3 of 4, in whole artifacts)
    assert store.evictor.evict_past_high() == 1  # down to the low one (3)
    assert store.usage(reused) is not None
    assert sum(store.usage(aid) is None for aid in others) == 1


def test_a_leased_artifact_is_never_evicted_nor_deleted_under_its_reader(tmp_path, rng) -> None:
    clock = Clock()
    store = _open(tmp_path / "s", clock, artifacts=1)
    first = _artifact(rng)
    aid = _commit(store, first)
    with store.reading(aid):
        with pytest.raises(ResourceExhausted, match="pinned artifacts and ones being read"):
            _commit(store, _artifact(rng))  # the only candidate is being read
        with pytest.raises(FailedPrecondition, match="being read"):
            store.delete_artifact(aid, wait_s=0.05)
        digests = list(page_sizes(first.manifest))
        dests = [np.empty(size, np.uint8) for size in page_sizes(first.manifest).values()]
        store.read_pages_into(digests, dests)  # every byte still there
    second = _commit(store, _artifact(rng))  # now it makes room
    assert store.usage(aid) is None and store.usage(second) is not None
    with pytest.raises(NotFound), store.reading(aid):
        pass


def test_a_reader_never_sees_an_artifact_a_removal_keeps_as_gone(tmp_path, rng) -> None:
    """Regression (a flake of test_concurrency): a delete claimed a pinned artifact before it
    found the pin, and a reader meanwhile got NOT_FOUND for an artifact that stayed. A
    pinned artifact is refused without a claim, and a reader waits a claim's outcome."""
    store = _open(tmp_path / "s", Clock())
    try:
        aid = _commit(store, _artifact(rng))
        store.set_pinned(aid, True)
        with pytest.raises(FailedPrecondition, match="pinned"):
            store.delete_artifact(aid)
        usage = store._usage
        assert usage.claim([bytes.fromhex(aid)]) == [bytes.fromhex(aid)]  # a removal begins
        leased = threading.Event()

        def read() -> None:
            with store.reading(aid):
                leased.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert not leased.wait(0.2)  # it waits for the removal's outcome...
        usage.unclaim([bytes.fromhex(aid)])  # ...which kept the artifact
        reader.join(30)
        assert leased.is_set()
    finally:
        store.close()


def test_pins_with_a_ttl_expire_on_time_and_the_feed_says_so(tmp_path, rng) -> None:
    clock = Clock()
    path = tmp_path / "s"
    store = _open(path, clock)
    aid = _commit(store, _artifact(rng))
    hard = _commit(store, _artifact(rng))
    store.set_pinned(aid, True, ttl_s=7200)
    store.set_pinned(hard, True)
    assert store.pin_expiry(aid) == clock.now + 7_200_000
    with pytest.raises(FailedPrecondition, match="pinned"):
        store.delete_artifact(aid)
    clock.now += 7_199_000
    assert store.expire_due() == 0
    store.close()  # the expiry is durable, not kept in memory
    store = _open(path, clock)
    clock.now += 1000
    assert store.expire_due() == 1
    assert store.usage(aid) is None and store.usage(hard) is not None
    last = store.changes_since(1, 100)[-1]
    assert (last.kind, last.reason, last.artifact_id) == (
        pb.ChangeRecord.KIND_DELETED,
        pb.ChangeRecord.REASON_EXPIRED,
        aid,
    )
    clock.now += 10**12
    assert store.expire_due() == 0  # a pin without a TTL never expires
    store.close()


def test_a_page_evicted_after_missing_pages_refuses_the_commit(tmp_path, rng) -> None:
    """Eviction between MissingPages and the commit: the commit is refused (asked again,
    the pages are missing), never stored with a page missing."""
    clock = Clock()
    store = _open(tmp_path / "s", clock, artifacts=1)
    first = _artifact(rng)
    _commit(store, first)
    shared = {(0, layer): first.page(0, layer) for layer in range(2)}
    second = random_artifact(rng, tokens=64, page_tokens=16, shared_pages=shared, **LAYOUT)
    missing = store.missing_pages(list(page_sizes(second.manifest)))
    records = page_records_of({d: second.pages[d] for d in missing})
    with pytest.raises(InvalidArgument, match="neither stored nor sent"):
        store.commit_artifact(second.manifest, records)  # making room evicted the shared pages
    assert store.commit_artifact(second.manifest, page_records_of(second.pages)).pages_written


def test_a_pin_changed_after_its_expiry_was_found_is_kept(tmp_path, rng) -> None:
    """Regression: an expiry found due, then a pin without a TTL (or a later one) before the
    keeper removed it, still deleted the artifact."""
    clock = Clock()
    store = _open(tmp_path / "s", clock)
    aid = _commit(store, _artifact(rng))
    store.set_pinned(aid, True, ttl_s=60)
    clock.now += 61_000
    due = store.due_expiries()
    assert due == [bytes.fromhex(aid)]
    store.set_pinned(aid, True)  # held for good now
    assert store.remove(due, pb.ChangeRecord.REASON_EXPIRED) == (0, 0)
    store.set_pinned(aid, True, ttl_s=60)  # a new TTL: due a minute from now
    assert store.remove(due, pb.ChangeRecord.REASON_EXPIRED) == (0, 0)
    assert store.usage(aid) is not None and store.pin_expiry(aid) == clock.now + 60_000
    store.close()


def test_a_write_the_budget_cannot_take_evicts_nothing(tmp_path, rng) -> None:
    """An artifact larger than the budget, or one only pinned artifacts stand in the way
    of, is refused before anything is evicted."""
    clock = Clock()
    sample = _artifact(rng)
    store = _open(tmp_path / "s", clock, bytes=3 * _disk_bytes(sample))
    kept = [_commit(store, _artifact(rng)) for _ in range(2)]
    huge = random_artifact(rng, tokens=320, page_tokens=16, **LAYOUT)
    with pytest.raises(ResourceExhausted, match="exceed store_budget_bytes"):
        _commit(store, huge)
    store.set_pinned(kept[0], True)
    store.set_pinned(kept[1], True)
    bigger = random_artifact(rng, tokens=128, page_tokens=16, **LAYOUT)
    with pytest.raises(ResourceExhausted, match="held by pinned artifacts"):
        _commit(store, bigger)
    assert all(store.usage(aid) is not None for aid in kept)
    assert store.evictor.counters.artifacts == 0
    store.close()


def test_a_ghost_never_stalls_eviction(tmp_path, rng) -> None:
    """Regression: an artifact deleted while a commit added it to the usage book stayed
    there, counted and unevictable; now the book follows the catalogue in one lock."""
    clock = Clock()
    store = _open(tmp_path / "s", clock, artifacts=2)
    ids = [_commit(store, _artifact(rng)) for _ in range(2)]
    errors = []

    def delete_all() -> None:
        for aid in ids:
            try:
                store.delete_artifact(aid)
            except NotFound:
                pass  # evicted first, to make room for the commits below
            except Exception as exc:
                errors.append(exc)

    thread = threading.Thread(target=delete_all)
    thread.start()
    more = [_commit(store, _artifact(rng)) for _ in range(6)]
    thread.join()
    assert not errors
    assert store.cache_totals()[0] == len(store.list_records(bytes(32), 100)) <= 2
    assert store.usage(more[-1]) is not None
    store.close()


def test_a_hold_begun_after_the_victims_were_picked_is_kept(tmp_path, rng, monkeypatch) -> None:
    """Regression (issue 32's review): the evictor's `keep` was asked only when it picked
    its candidates, so a write-through re-put of one, held from then on, was evicted under
    its upload and its client told OK. The hook starts the hold between the pick and the
    removal's transaction: the held one stays, the next candidate goes instead."""
    clock = Clock()
    store = _open(tmp_path / "s", clock, artifacts=2)
    pushes = PushesUnderWay()  # write-through's holds, wired as RemoteService.open does
    store.evictor.keep = pushes.holds
    oldest = _commit(store, _artifact(rng))
    clock.now += 1000
    newer = _commit(store, _artifact(rng))
    remove = store.remove

    def remove_once_a_re_put_holds_the_oldest(aids, reason):
        with pushes.committing(oldest, lambda: True):
            return remove(aids, reason)

    monkeypatch.setattr(store, "remove", remove_once_a_re_put_holds_the_oldest)
    assert store.evictor.evict_past_high() == 1  # 2 past the high watermark: down to 1
    assert store.usage(oldest) is not None  # was: evicted while held
    assert store.usage(newer) is None
    store.close()
