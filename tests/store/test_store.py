"""kvgraftd.store.artifact_store on a real LMDB environment, in-process."""

from __future__ import annotations

import hashlib
import itertools
import random
from pathlib import Path

import lmdb
import numpy as np
import pytest
import xxhash

from kvgraft.artifact import page_sizes
from kvgraft.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.page_records import INDEX_RECORD, PageRecord, page_record, page_records_of
from tests.support.factory import random_artifact
from tests.support.on_disk import flip_stored_page, segment_files


@pytest.fixture
def store(tmp_path: Path):
    s = Store(tmp_path / "store", initial_map_bytes=1 << 20, min_free_bytes=1 << 20)
    yield s
    s.close()


def _records(artifact) -> dict[bytes, PageRecord]:
    return {digest: page_record(data) for digest, data in artifact.pages.items()}


def _read_all(store: Store, manifest: pb.Manifest) -> dict[bytes, bytes]:
    sizes = page_sizes(manifest)
    dests = [np.empty(size, np.uint8) for size in sizes.values()]
    store.read_pages_into(list(sizes), dests)
    return {digest: dest.tobytes() for digest, dest in zip(sizes, dests, strict=True)}


def test_commit_then_read_every_page(store: Store, rng: random.Random) -> None:
    artifact = random_artifact(rng, tokens=200, page_tokens=16)
    result = store.commit_artifact(artifact.manifest, _records(artifact))
    assert (result.artifact_id, result.already_present, result.sequence) == (artifact.id, False, 1)
    assert result.pages_written == len(page_sizes(artifact.manifest))
    read = _read_all(store, artifact.manifest)
    assert {d: hashlib.sha256(b).digest() for d, b in read.items()} == {d: d for d in read}
    assert store.get_record(artifact.id).canonical == artifact.manifest.SerializeToString(
        deterministic=True
    )
    again = store.commit_artifact(artifact.manifest, {})
    assert again.already_present and again.pages_written == 0 and again.sequence == 1


def test_verified_pages_are_the_stored_bytes_read_only(store: Store, rng: random.Random) -> None:
    artifact = random_artifact(rng, tokens=40, page_tokens=16)
    store.commit_artifact(artifact.manifest, _records(artifact))
    digests = list(page_sizes(artifact.manifest))
    with store.verified_pages(digests) as views:
        assert [view.tobytes() for view in views] == [bytes(artifact.pages[d]) for d in digests]
        assert not any(view.flags.writeable for view in views)
    with pytest.raises(NotFound), store.verified_pages([bytes(32)]):
        pytest.fail("a missing page was handed out")


def test_framed_read_frames_pages(store: Store, rng: random.Random) -> None:
    artifact = random_artifact(rng, tokens=40, page_tokens=16)
    store.commit_artifact(artifact.manifest, _records(artifact))
    digests = list(page_sizes(artifact.manifest))
    seen = []

    def frame(index: int, digest: bytes, checksum: bytes, size: int) -> bytes:
        seen.append((index, digest, checksum, size))
        return f"<{index}>".encode()

    joined = store.read_pages_framed(digests, frame)
    assert joined == b"".join(
        f"<{i}>".encode() + bytes(artifact.pages[d]) for i, d in enumerate(digests)
    )
    assert seen == [
        (i, d, xxhash.xxh3_128_digest(artifact.pages[d]), len(artifact.pages[d]))
        for i, d in enumerate(digests)
    ]


def test_shared_pages_are_counted_and_freed(store: Store, rng: random.Random) -> None:
    shared = {(0, 0): rng.randbytes(2 * 2 * 16 * 8 * 4)}
    geometry = dict(
        num_layers=2, kv_heads=2, head_dim=8, kv_dtype=pb.KV_DTYPE_FLOAT32, page_tokens=16
    )
    first = random_artifact(rng, tokens=30, shared_pages=shared, **geometry)
    second = random_artifact(rng, tokens=50, shared_pages=shared, **geometry)
    store.commit_artifact(first.manifest, _records(first))
    result = store.commit_artifact(second.manifest, _records(second))
    distinct = set(page_sizes(first.manifest)) | set(page_sizes(second.manifest))
    assert result.pages_written == len(page_sizes(second.manifest)) - 1
    assert store.stats().pages == len(distinct)
    freed, _ = store.delete_artifact(first.id)
    assert freed == len(page_sizes(first.manifest)) - 1
    assert _read_all(store, second.manifest) == {d: bytes(b) for d, b in second.pages.items()}
    store.delete_artifact(second.id)
    stats = store.stats()
    assert (stats.pages, stats.page_bytes, stats.artifacts) == (0, 0, 0)
    kinds = [r.kind for r in store.changes_since(0)]
    assert kinds == [pb.ChangeRecord.KIND_ADDED] * 2 + [pb.ChangeRecord.KIND_DELETED] * 2


def test_missing_page_refuses_the_whole_commit(store: Store, rng: random.Random) -> None:
    artifact = random_artifact(rng, tokens=40, page_tokens=16)
    records = _records(artifact)
    records.pop(artifact.manifest.page_sha256[-1])
    with pytest.raises(InvalidArgument, match="MissingPages"):
        store.commit_artifact(artifact.manifest, records)
    stats = store.stats()
    assert (stats.artifacts, stats.pages, stats.page_bytes, stats.last_sequence) == (0, 0, 0, 0)


def test_staged_pages_complete_a_later_commit_and_expire(store: Store, rng: random.Random) -> None:
    artifact = random_artifact(rng, tokens=40, page_tokens=16)
    records = _records(artifact)
    assert store.stage_pages(records) == len(records)
    assert store.missing_pages(list(records)) == []
    assert store.stats().staged_pages == len(records)
    store.commit_artifact(artifact.manifest, {})
    assert store.stats().staged_pages == 0
    orphan = random_artifact(rng, tokens=8, page_tokens=16)
    store.stage_pages(_records(orphan))
    assert store.collect_staged(older_than_s=3600) == 0
    assert store.collect_staged(older_than_s=-1) == len(orphan.pages)
    assert store.missing_pages(list(orphan.pages)) == list(orphan.pages)
    assert store.stats().page_bytes == sum(page_sizes(artifact.manifest).values())
    assert _read_all(store, artifact.manifest) == {d: bytes(b) for d, b in artifact.pages.items()}


def test_map_grows_past_its_initial_size(store: Store, rng: random.Random) -> None:
    # The map holds the index (page bytes live in the segments): 1 MiB of it
    # is a few thousand pages' records.
    artifacts = [
        random_artifact(rng, num_layers=8, kv_heads=1, head_dim=1, tokens=512, page_tokens=2)
        for _ in range(3)
    ]  # 8 layers x 256 pages x K,V = 4,096 pages each
    for artifact in artifacts:
        store.commit_artifact(artifact.manifest, _records(artifact))
    stats = store.stats()
    assert stats.map_size_bytes > 1 << 20
    assert stats.pages == sum(len(a.pages) for a in artifacts)
    assert stats.page_bytes == sum(len(b) for a in artifacts for b in a.pages.values())
    for artifact in artifacts:
        assert _read_all(store, artifact.manifest) == {
            d: bytes(b) for d, b in artifact.pages.items()
        }


def test_full_disk_is_refused_before_writing(tmp_path: Path, rng: random.Random) -> None:
    store = Store(tmp_path / "s", min_free_bytes=1 << 62)
    try:
        artifact = random_artifact(rng)
        with pytest.raises(ResourceExhausted, match="min_free_bytes"):
            store.commit_artifact(artifact.manifest, _records(artifact))
        assert store.stats().artifacts == 0
    finally:
        store.close()


def test_flipped_byte_on_disk_is_detected_and_not_served(store: Store, rng: random.Random) -> None:
    artifact = random_artifact(rng, tokens=64, page_tokens=64, num_layers=1, head_dim=64)
    store.commit_artifact(artifact.manifest, _records(artifact))
    digest = artifact.manifest.page_sha256[0]
    page = bytes(artifact.pages[digest])
    _flip_stored_byte(store, page)
    dest = np.empty(len(page), np.uint8)
    with pytest.raises(DataLoss, match="corrupt"):
        store.read_pages_into([digest], [dest])
    assert not dest.any()  # nothing of the corrupt page left in the destination
    with pytest.raises(DataLoss):
        store.read_page(digest)
    with pytest.raises(DataLoss, match="corrupt"), store.verified_pages([digest]):
        pytest.fail("a corrupt page was handed out")


def test_a_corrupt_page_in_a_large_read_is_named_and_nothing_is_served(tmp_path: Path) -> None:
    # 64 pages of 98 KB: past PARALLEL_MIN_BYTES, so the check runs side by side
    store = Store(tmp_path / "s", initial_map_bytes=64 << 20, min_free_bytes=1 << 20)
    try:
        artifact = random_artifact(
            random.Random(7), num_layers=4, kv_heads=3, head_dim=64,
            kv_dtype=pb.KV_DTYPE_FLOAT32, tokens=16 * 64, page_tokens=64,
        )  # fmt: skip
        store.commit_artifact(artifact.manifest, _records(artifact))
        digests = list(artifact.manifest.page_sha256)
        bad = 50
        _flip_stored_byte(store, bytes(artifact.pages[digests[bad]]))
        dests = [np.ones(len(artifact.pages[d]), np.uint8) for d in digests]
        with pytest.raises(DataLoss, match=digests[bad].hex()[:16]):
            store.read_pages_into(digests, dests)
        assert not any(dest.any() for dest in dests)  # no page of the failed read is left
        store.read_quarantine.settled()  # the read quarantined the artifact, dropped the page
        assert store.quarantined_ids() == [artifact.id]
        with pytest.raises(DataLoss, match=digests[bad].hex()[:16]), store.verified_pages(digests):
            pytest.fail("a read with a corrupt page was handed out")
        intact = digests[:bad] + digests[bad + 1 :]
        with store.verified_pages(intact) as views:
            assert [v.tobytes() for v in views] == [bytes(artifact.pages[d]) for d in intact]
    finally:
        store.close()


def test_each_page_is_stored_aligned_and_exactly_with_its_xxh3(tmp_path: Path) -> None:
    """Pages smaller and larger than the staging buffer, in two appends: each
    lies at a 4 KiB-aligned offset of a segment, exactly its bytes, and its
    index record holds its xxh3-128 and that location."""
    rng = random.Random(3)
    batches = [(70_000, 5, (8 << 20) + 5, 300), (1, (5 << 20) + 3, 4096)]
    pages = [[rng.randbytes(size) for size in sizes] for sizes in batches]
    path = tmp_path / "s"
    store = Store(path, initial_map_bytes=32 << 20, min_free_bytes=1 << 20)
    try:
        for batch in pages:
            records = page_records_of({hashlib.sha256(page).digest(): page for page in batch})
            assert [bytes(r.data) for r in records.values()] == batch  # views, not copies
            assert store.stage_pages(records) == len(batch)
    finally:
        store.close()
    with lmdb.open(str(path), max_dbs=16, readonly=True, lock=False) as env:
        db = env.open_db(b"page_locations", create=False)
        with env.begin(db=db) as txn:
            stored = [
                INDEX_RECORD.unpack(txn.get(hashlib.sha256(page).digest()))
                for batch in pages
                for page in batch
            ]
    [segment] = segment_files(path)
    data = segment.read_bytes()
    assert len(data) % 4096 == 0
    ends = []
    for page, (checksum, segment_id, offset, length) in zip(
        [p for batch in pages for p in batch], stored, strict=True
    ):
        assert (segment_id, offset % 4096, length) == (1, 0, len(page))
        assert checksum == xxhash.xxh3_128_digest(page)
        assert data[offset : offset + length] == page
        ends.append((offset, offset + length))
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(ends))


def _flip_stored_byte(store: Store, page: bytes) -> None:
    """Flip one bit of `page` where it lies in the store's segment files."""
    assert flip_stored_page(store.path, page) == 1


def test_ids_resolve_by_unique_prefix(store: Store, rng: random.Random) -> None:
    artifact = random_artifact(rng)
    store.commit_artifact(artifact.manifest, _records(artifact))
    assert store.resolve(artifact.id[:8]) == artifact.id
    assert store.resolve(artifact.id.upper()) == artifact.id
    with pytest.raises(NotFound):
        store.resolve("0" * 64 if not artifact.id.startswith("0") else "f" * 64)
    with pytest.raises(InvalidArgument):
        store.resolve("abc")
    with pytest.raises(InvalidArgument):
        store.delete_artifact(artifact.id[:10])


def test_pinned_artifact_cannot_be_deleted(store: Store, rng: random.Random) -> None:
    artifact = random_artifact(rng)
    store.commit_artifact(artifact.manifest, _records(artifact))
    assert store.set_pinned(artifact.id, True).pinned
    with pytest.raises(FailedPrecondition, match="pinned"):
        store.delete_artifact(artifact.id)
    store.set_pinned(artifact.id, False)
    store.delete_artifact(artifact.id)
    with pytest.raises(NotFound):
        store.delete_artifact(artifact.id)


def test_listing_pages_through_ids_in_order(store: Store, rng: random.Random) -> None:
    ids = []
    for _ in range(7):
        artifact = random_artifact(rng, tokens=3)
        store.commit_artifact(artifact.manifest, _records(artifact))
        ids.append(artifact.id)
    seen, after = [], b""
    while batch := store.list_records(after, 3):
        seen += [aid for aid, _ in batch]
        after = bytes.fromhex(batch[-1][0])
    assert seen == sorted(ids)


def test_reopen_keeps_everything(tmp_path: Path, rng: random.Random) -> None:
    artifact = random_artifact(rng)
    store = Store(tmp_path / "s")
    store.commit_artifact(artifact.manifest, _records(artifact))
    store.close()
    store = Store(tmp_path / "s")
    try:
        assert _read_all(store, artifact.manifest) == {
            d: bytes(b) for d, b in artifact.pages.items()
        }
        assert store.stats().last_sequence == 1
    finally:
        store.close()


def test_other_store_format_is_refused(tmp_path: Path) -> None:
    Store(tmp_path / "s").close()
    env = lmdb.open(str(tmp_path / "s"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"format_version", b"99", db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(FailedPrecondition, match="format 99"):
        Store(tmp_path / "s")
