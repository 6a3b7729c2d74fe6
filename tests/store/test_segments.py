"""Segment files (kvgraftd.store.segments) on their own and under the store: appends,
recovery at open, and giving the space of deleted pages back."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import itertools
import os
import random
import time
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest

from kvgraft.errors import DataLoss, ResourceExhausted
from kvgraft.page_buffers import block_aligned, slot_copies
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store import linux_files, segments
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.direct_io import open_direct, pwritev_all
from kvgraftd.store.page_records import page_records_of
from kvgraftd.store.segment_reads import UnreadPage
from kvgraftd.store.segments import Location, SegmentFiles, Tail
from kvgraftd.store.signing import Signer, TrustPolicy
from kvgraftd.store.trust_index import UNRECORDED
from tests.support.factory import random_artifact
from tests.support.on_disk import segment_files

F32 = pb.KV_DTYPE_FLOAT32


def _allocated(path: Path) -> int:
    """Bytes the filesystem holds for `path` (holes excluded)."""
    return os.stat(path).st_blocks * 512


def _artifact(rng: random.Random, mib: int):
    """`mib` MiB of float32 KV in 64 KiB pages (64 tokens x 4 heads x 64 x 4 bytes)."""
    return random_artifact(
        rng, num_layers=mib * 8, kv_heads=4, head_dim=64, kv_dtype=F32, page_tokens=64, tokens=64
    )


def _commit(store: Store, artifact, provenance=UNRECORDED) -> None:
    store.commit_artifact(artifact.manifest, page_records_of(artifact.pages), provenance)


def _read(store: Store, artifact) -> dict[bytes, bytes]:
    digests = list(artifact.pages)
    with store.verified_pages(digests) as views:
        return {digest: view.tobytes() for digest, view in zip(digests, views, strict=True)}


def _pages(artifact) -> dict[bytes, bytes]:
    return {digest: bytes(data) for digest, data in artifact.pages.items()}


def test_an_append_never_committed_is_cut_off_at_open(tmp_path: Path) -> None:
    rng = random.Random(1)
    kept = [memoryview(rng.randbytes(size)) for size in (10_000, 5, 70_000)]
    lost = [memoryview(rng.randbytes(9_000))]
    segments = SegmentFiles(tmp_path)
    segments.open(Tail(1, 0), [])
    locations = segments.append(kept)
    segments.commit()
    tail = segments.pending
    segments.append(lost)  # the process dies before the index commits
    segments.close()
    assert os.path.getsize(tmp_path / "00000001.seg") > tail.end

    reopened = SegmentFiles(tmp_path)
    reopened.open(tail, locations)
    assert os.path.getsize(tmp_path / "00000001.seg") == tail.end
    assert [reopened.read_bytes(loc) for loc in locations] == [bytes(p) for p in kept]
    again = reopened.append(lost)
    assert again[0].offset == tail.end  # written where the lost one was
    reopened.commit()
    assert reopened.read_bytes(again[0]) == bytes(lost[0])
    reopened.close()


def test_open_removes_segments_past_the_tail_and_segments_nothing_lives_in(
    tmp_path: Path,
) -> None:
    segments = SegmentFiles(tmp_path, segment_bytes=4096)
    segments.open(Tail(1, 0), [])
    placed = []
    for index in range(4):  # one segment each: every append fills its segment
        placed += segments.append([memoryview(bytes([index]) * 5000)])
        segments.commit()
    tail = segments.pending
    segments.append([memoryview(b"x" * 10)])  # begins segment 5, never committed
    segments.close()
    assert [p.name for p in sorted(tmp_path.glob("*.seg"))][-1] == "00000005.seg"

    live = [placed[1], placed[3]]  # the pages of segments 1 and 3 were freed
    reopened = SegmentFiles(tmp_path, segment_bytes=4096)
    reopened.open(tail, live)
    assert sorted(p.name for p in tmp_path.glob("*.seg")) == ["00000002.seg", "00000004.seg"]
    assert [reopened.read_bytes(loc) for loc in live] == [b"\x01" * 5000, b"\x03" * 5000]
    reopened.close()


def test_open_gives_back_the_space_between_live_pages(tmp_path: Path) -> None:
    segments = SegmentFiles(tmp_path)
    segments.open(Tail(1, 0), [])
    pages = [memoryview(bytes([i + 1]) * (1 << 20)) for i in range(4)]
    locations = segments.append(pages)
    segments.commit()
    tail = segments.pending
    segments.close()
    path = tmp_path / "00000001.seg"
    assert _allocated(path) >= 4 << 20

    reopened = SegmentFiles(tmp_path)
    reopened.open(tail, [locations[0], locations[3]])  # pages 1 and 2 freed before a crash
    assert _allocated(path) <= (2 << 20) + 8192
    assert reopened.read_bytes(locations[3]) == bytes(pages[3])
    reopened.close()


def test_a_commit_whose_index_outgrows_the_map_writes_its_bytes_once(tmp_path: Path) -> None:
    # The map starts at 1 MiB; 8,192 pages' records (and, trusted, their chain entries) do
    # not fit, so the write transaction runs again after the map grows, and with it the append.
    with closing(Store(tmp_path / "s", initial_map_bytes=1 << 20, min_free_bytes=1 << 20)) as store:
        artifact = random_artifact(
            random.Random(2), num_layers=8, kv_heads=1, head_dim=1, tokens=1024, page_tokens=2
        )
        _commit(store, artifact, TrustPolicy(Signer.generate()).computed(artifact.id))
        assert store.stats().map_size_bytes > 1 << 20
        [segment] = segment_files(store.path)
        assert segment.stat().st_size == sum(block_aligned(len(p)) for p in artifact.pages.values())
        assert _read(store, artifact) == _pages(artifact)


def test_deleted_artifacts_give_their_disk_space_back(tmp_path: Path) -> None:
    rng = random.Random(3)
    with closing(Store(tmp_path / "s", min_free_bytes=1 << 20, segment_bytes=1 << 20)) as store:
        first, second, third = (_artifact(rng, 2) for _ in range(3))
        for artifact in (first, second, third):
            _commit(store, artifact)  # one segment each: each fills its segment
        one, two, three = segment_files(store.path)
        assert store.stats().segment_disk_bytes == sum(map(_allocated, (one, two, three)))
        store.delete_artifact(first.id)
        assert not one.exists()  # emptied, not the active segment: removed
        store.delete_artifact(third.id)
        assert three.exists() and _allocated(three) < 64 << 10  # active: its holes punched
        assert _read(store, second) == _pages(second)
        assert _allocated(two) >= 2 << 20
        assert store.stats().segment_disk_bytes == _allocated(two) + _allocated(three)
    with closing(Store(tmp_path / "s", min_free_bytes=1 << 20, segment_bytes=1 << 20)) as reopened:
        assert _read(reopened, second) == _pages(second)
        _commit(reopened, first)  # written again, after the others
        assert _read(reopened, first) == _pages(first)


def test_a_read_in_progress_keeps_the_bytes_of_pages_deleted_under_it(tmp_path: Path) -> None:
    rng = random.Random(4)
    with closing(Store(tmp_path / "s", min_free_bytes=1 << 20, segment_bytes=1 << 20)) as store:
        doomed, later = _artifact(rng, 2), _artifact(rng, 2)
        _commit(store, doomed)
        _commit(store, later)  # so that the doomed artifact's segment is not the active one
        [first, _] = segment_files(store.path)
        digests = list(doomed.pages)
        with store._pages.reading_index() as stored:  # a read that looked the pages up
            located = stored.locate(digests)
            store.delete_artifact(doomed.id)
            assert first.exists()  # the read may still read them
            copies = [stored.segments.read_bytes(location) for _, location in located]
            assert [hashlib.sha256(copy).digest() for copy in copies] == digests
        assert not first.exists()  # given back once the read ended
        assert store.missing_pages(digests) == digests
        with pytest.raises(Exception, match="not in the store"):
            store.read_pages_into(digests[:1], [np.empty(len(doomed.pages[digests[0]]), np.uint8)])


def test_a_read_takes_neighbours_at_once_and_names_the_first_page_a_cut_file_lacks(
    tmp_path: Path,
) -> None:
    """Pages read in runs of neighbours (the padding between them dropped), from two
    segments; once the file is cut inside the third page, a read names that page and has
    read the two before it whole, and nothing raised a signal."""
    rng = random.Random(8)
    segments_ = SegmentFiles(tmp_path, segment_bytes=1 << 14)
    segments_.open(Tail(1, 0), [])
    pages = [rng.randbytes(size) for size in (5000, 4096, 9000, 1, 70_000, 12_000)]
    locations = []
    for batch in (pages[:4], pages[4:]):  # the second batch begins segment 2
        locations += segments_.append([memoryview(p) for p in batch])
        segments_.commit()
    assert [loc.segment for loc in locations] == [1, 1, 1, 1, 2, 2]
    copies = [bytearray(len(p)) for p in pages]
    segments_.read(locations, copies)
    assert copies == pages
    os.truncate(tmp_path / "00000001.seg", locations[2].offset + 100)
    copies = [bytearray(len(p)) for p in pages]
    with pytest.raises(UnreadPage, match="cut short") as lost:
        segments_.read(locations, copies)
    assert lost.value.index == 2 and copies[:2] == pages[:2]
    with pytest.raises(DataLoss, match="cut short"):
        segments_.read_bytes(locations[3])
    assert segments_.read_bytes(locations[5]) == pages[5]
    os.unlink(tmp_path / "00000002.seg")  # read before: its descriptor still reads it
    assert segments_.read_bytes(locations[4]) == pages[4]
    segments_.close()


def test_a_read_that_cannot_open_a_segment_for_want_of_descriptors_damages_nothing(
    tmp_path: Path, monkeypatch
) -> None:
    """Regression: every OSError of a read was taken for a damaged segment, so a read that
    met a full descriptor table (EMFILE) quarantined the artifact and dropped its pages'
    records, freeing good bytes. Only errors that say the bytes are gone (EIO, a missing
    file, a file cut short) are DataLoss; the rest fail the read and leave the store."""
    store = Store(tmp_path / "store", min_free_bytes=0)
    try:
        artifact = _artifact(random.Random(3), 1)
        _commit(store, artifact)
        store.close()
        store = Store(tmp_path / "store", min_free_bytes=0)  # no segment opened for reads yet
        real_open = os.open

        def no_descriptors(path, flags, *args, **kwargs):
            if str(path).endswith(".seg") and not flags & os.O_WRONLY and not flags & os.O_RDWR:
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), str(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", no_descriptors)
        digests = list(artifact.pages)
        with pytest.raises(ResourceExhausted, match="descriptors"):
            _read(store, artifact)
        with pytest.raises(ResourceExhausted, match="descriptors"):
            store.read_page(digests[0])
        store.read_quarantine.settled()
        monkeypatch.setattr(os, "open", real_open)
        assert store.quarantined_ids() == [] and store.missing_pages(digests) == []
        assert _read(store, artifact) == _pages(artifact)
    finally:
        store.close()


def test_locations_never_overlap_across_appends(tmp_path: Path) -> None:
    segments = SegmentFiles(tmp_path)
    segments.open(Tail(1, 0), [])
    rng = random.Random(5)
    placed: list[tuple[Location, bytes]] = []
    for _ in range(20):
        batch = [rng.randbytes(rng.choice((1, 4095, 4096, 4097, 100_000))) for _ in range(3)]
        placed += zip(segments.append([memoryview(p) for p in batch]), batch, strict=True)
        segments.commit()
    spans = sorted((loc.offset, loc.offset + loc.length) for loc, _ in placed)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    assert all(segments.read_bytes(loc) == data for loc, data in placed)
    segments.close()


def test_a_delete_succeeds_when_its_space_cannot_be_given_back(tmp_path: Path, monkeypatch) -> None:
    """Giving space back comes after the delete committed: failing there must not
    fail the delete; the next open gives the space back."""
    rng = random.Random(6)
    doomed, kept = _artifact(rng, 2), _artifact(rng, 2)

    def refused(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EIO, "injected")

    with closing(Store(tmp_path / "s", min_free_bytes=1 << 20)) as store:
        _commit(store, doomed)
        _commit(store, kept)
        monkeypatch.setattr(linux_files, "punch_hole", refused)
        assert store.delete_artifact(doomed.id)[0] == len(doomed.pages)
        assert store.missing_pages(list(doomed.pages)) == list(doomed.pages)
    monkeypatch.undo()
    [segment] = segment_files(tmp_path / "s")
    assert _allocated(segment) >= 4 << 20  # nothing given back yet
    with closing(Store(tmp_path / "s", min_free_bytes=1 << 20)) as reopened:
        assert _allocated(segment) < (2 << 20) + (64 << 10)
        assert _read(reopened, kept) == _pages(kept)


def _block_aligned(pages: list[bytes]) -> list[memoryview]:
    """`pages` copied into one block-aligned buffer, each starting on a block (direct I/O)."""
    slots = slot_copies({index.to_bytes(4, "big"): page for index, page in enumerate(pages)})
    return [memoryview(slot) for slot in slots.values()]


def open_direct_probe(directory: Path) -> int | None:
    """Whether files in `directory` can be written with O_DIRECT (None: they cannot)."""
    probe = directory / "direct-probe"
    probe.touch()
    try:
        fd = open_direct(probe)
        if fd is not None:
            os.close(fd)
        return fd
    finally:
        probe.unlink()


def _write_modes(monkeypatch) -> list[bool]:
    """Records, for every write the segments make, whether it went past the page cache."""
    modes: list[bool] = []

    def observed(fd: int, pieces: list[memoryview], offset: int) -> None:
        modes.append(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT))
        pwritev_all(fd, pieces, offset)

    monkeypatch.setattr(segments, "pwritev_all", observed)
    return modes


def test_block_aligned_pages_go_to_the_device_and_land_as_buffered_ones_do(
    tmp_path: Path, monkeypatch
) -> None:
    if open_direct_probe(tmp_path) is None:
        pytest.skip("this filesystem does not do direct I/O")
    rng = random.Random(7)
    sizes = (4096, 5, 70_000, 3 * 4096, 4097, 1, 9 << 20)  # tails, whole blocks, many writes
    pages = [rng.randbytes(size) for size in sizes]
    modes = _write_modes(monkeypatch)
    files = {}
    for name, batch in (("buffered", [memoryview(p) for p in pages]), ("direct", None)):
        batch = batch if batch is not None else _block_aligned(pages)
        segments_ = SegmentFiles(tmp_path / name)
        segments_.open(Tail(1, 0), [])
        modes.clear()
        locations = segments_.append(batch)
        segments_.commit()
        assert set(modes) == {name == "direct"}
        assert [segments_.read_bytes(loc) for loc in locations] == pages
        segments_.close()
        files[name] = (tmp_path / name / "00000001.seg").read_bytes()
    assert files["direct"] == files["buffered"]  # same layout, zero padding included


def test_a_batch_with_one_unaligned_page_is_written_buffered(tmp_path: Path, monkeypatch) -> None:
    pages = [bytes(range(256)) * 64, b"not aligned"]
    batch = [*_block_aligned(pages[:1]), memoryview(pages[1])]
    modes = _write_modes(monkeypatch)
    segments_ = SegmentFiles(tmp_path)
    segments_.open(Tail(1, 0), [])
    locations = segments_.append(batch)
    assert modes and not any(modes)
    assert [segments_.read_bytes(loc) for loc in locations] == pages
    segments_.close()


def test_where_the_filesystem_refuses_direct_io_aligned_pages_go_through_the_cache(
    tmp_path: Path, monkeypatch
) -> None:
    """Older tmpfs and some network filesystems refuse O_DIRECT (EINVAL at open):
    this kernel's tmpfs takes it, so the refusal is played by open_direct."""
    monkeypatch.setattr(segments, "open_direct", lambda path: None)
    modes = _write_modes(monkeypatch)
    artifact = _artifact(random.Random(8), 1)
    pages = _pages(artifact)
    aligned = dict(zip(pages, _block_aligned(list(pages.values())), strict=True))
    with closing(Store(tmp_path / "s", min_free_bytes=1 << 20)) as store:
        store.commit_artifact(artifact.manifest, page_records_of(aligned))
        assert modes and not any(modes)
        assert _read(store, artifact) == pages


@pytest.mark.parametrize("aligned", [False, True])
def test_a_failed_write_leaves_nothing_and_the_next_append_goes_where_it_would_have(
    tmp_path: Path, monkeypatch, aligned: bool
) -> None:
    """A write fails on the writer thread while others are queued: the append
    raises (disk full: ResourceExhausted), every write has ended, the bytes are cut."""
    rng = random.Random(9)
    pages = [rng.randbytes(3 << 20) for _ in range(12)]  # several writes in flight
    batch = _block_aligned(pages) if aligned else [memoryview(p) for p in pages]
    segments_ = SegmentFiles(tmp_path)
    segments_.open(Tail(1, 0), [])
    first = segments_.append(batch[:1])
    segments_.commit()
    calls = []

    def full_on_the_third(fd: int, pieces: list[memoryview], offset: int) -> None:
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "injected")
        if len(calls) > 3:
            time.sleep(0.3)  # still writing when the append would return, if it did not wait
        pwritev_all(fd, pieces, offset)

    monkeypatch.setattr(segments, "pwritev_all", full_on_the_third)
    with pytest.raises(ResourceExhausted, match=r"disk .* is full"):
        segments_.append(batch[1:])
    assert len(calls) > 3  # a write was queued behind the one that failed
    assert segments_.pending.end == block_aligned(first[0].length)
    assert os.path.getsize(tmp_path / "00000001.seg") == segments_.pending.end
    time.sleep(0.5)
    assert os.path.getsize(tmp_path / "00000001.seg") == segments_.pending.end
    monkeypatch.undo()
    again = segments_.append(batch[1:])
    segments_.commit()
    assert again[0].offset == block_aligned(first[0].length)
    assert [segments_.read_bytes(loc) for loc in first + again] == pages
    segments_.close()
