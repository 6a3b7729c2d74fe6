"""What uploads may hold together: memory across streams, staged disk per connection and in
total, on real stores (PageIntake in-process) and a real daemon (the probes that found the
denials of service: an upload without its manifest that wiped a budgeted cache, eight
uploads of unfinished pages that grew the daemon by gigabytes and kept most of it)."""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext

import grpc
import pytest

from kvgraft import Client, wire
from kvgraft.artifact import MAX_PAGE_BYTES
from kvgraft.errors import ResourceExhausted
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.config import ConfigError, DaemonConfig
from kvgraftd.server.limits import peer_host
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.intake import PageIntake
from kvgraftd.store.upload_limits import TRIM_AFTER_BYTES, UploadBounds, UploadMemory
from tests.support.factory import random_artifact

PUT = "/kvgraft.v1.Kvgraft/PutArtifact"
CODE = grpc.StatusCode
PAGE = 4096


def _bounds(**settings) -> UploadBounds:
    values = dict(
        spill_bytes=64 << 20,
        staged_max_bytes=0,
        staged_ttl_s=3600.0,
        memory_bytes=1 << 30,
        staged_per_connection=0,
    )
    return UploadBounds.of(**{**values, **settings})


def _chunks(tag: bytes, count: int, size: int = PAGE) -> list[wire.Chunk]:
    """`count` whole pages of `size` bytes."""
    pages = [hashlib.sha256(tag + b"%d" % i).digest() * (size // 32) for i in range(count)]
    return [wire.Chunk(hashlib.sha256(page).digest(), 0, size, page) for page in pages]


def _kept(store: Store, bounds: UploadBounds, connection: str, tag: bytes, pages: int) -> str:
    """An upload of `pages` 4 KiB pages ending without its manifest: why its pages were not
    kept, or ''."""
    with PageIntake(store, bounds, connection) as intake:
        intake.add(_chunks(tag, pages))
        return intake.keep()


def test_verified_pages_past_the_uploads_memory_are_staged_early(tmp_path) -> None:
    """Each upload holds up to spill_bytes in memory; together they hold at most the
    daemon's upload memory: the one that passes it stages its pages at once."""
    store = Store(tmp_path / "s", initial_map_bytes=1 << 22, min_free_bytes=0)
    bounds = _bounds(memory_bytes=64 * (PAGE + 512))
    with PageIntake(store, bounds) as first, PageIntake(store, bounds) as second:
        first.add(_chunks(b"a", 40))
        assert (len(first.records), bounds.memory.held) == (40, 40 * (PAGE + 512))
        second.add(_chunks(b"b", 40))  # 80 pages would pass 64: staged
        assert (len(second.records), len(second.staged)) == (0, 40)
        assert bounds.memory.held == 40 * (PAGE + 512)
        first.add(_chunks(b"c", 30))
        assert (len(first.records), len(first.staged), bounds.memory.held) == (0, 70, 0)
    assert store.stats().staged_pages == 110
    store.close()


def test_pieces_of_pages_past_the_uploads_memory_are_refused(tmp_path) -> None:
    """Bytes of a page still arriving cannot be staged: past the uploads' memory, after the
    upload has staged what it could, the upload is refused."""
    store = Store(tmp_path / "s", initial_map_bytes=1 << 22, min_free_bytes=0)
    bounds = _bounds(memory_bytes=1 << 20)
    digest = hashlib.sha256(b"unfinished").digest()
    with PageIntake(store, bounds) as first:
        first.add([wire.Chunk(digest, 0, 2 << 20, bytes(768 << 10))])
        with PageIntake(store, bounds) as second:
            second.add(_chunks(b"b", 8))
            with pytest.raises(ResourceExhausted, match="upload_memory_bytes = 1048576"):
                second.add([wire.Chunk(bytes(32), 0, 2 << 20, bytes(512 << 10))])
            assert len(second.staged) == 8  # what it could give back, it gave
    assert bounds.memory.held == 0
    store.close()


def test_a_client_host_stages_at_most_its_share_and_all_together_the_total(tmp_path) -> None:
    store = Store(tmp_path / "s", initial_map_bytes=1 << 22, min_free_bytes=0)
    bounds = _bounds(staged_per_connection=16 * PAGE, staged_max_bytes=28 * PAGE)
    assert _kept(store, bounds, "ipv4:10.0.0.1", b"a", 12) == ""
    refused = _kept(store, bounds, "ipv4:10.0.0.1", b"b", 6)  # 18 > 16
    assert "the uploads from this client's host hold 49152 bytes" in refused
    assert "staged_max_bytes_per_connection" in refused
    assert _kept(store, bounds, "ipv4:10.0.0.2", b"c", 12) == ""
    refused = _kept(store, bounds, "ipv4:10.0.0.3", b"d", 6)  # 30 > 28 in all
    assert "staged_max_bytes = 114688" in refused
    assert store.stats().staged_pages == 24
    # A manifest claiming staged pages gives its connection its share back.
    artifact = random_artifact(random.Random(0), num_layers=1, kv_heads=1, head_dim=32,
                               kv_dtype=pb.KV_DTYPE_FLOAT32, tokens=32, page_tokens=16)  # fmt: skip
    with PageIntake(store, bounds, "ipv4:10.0.0.1") as intake:
        intake.add([wire.Chunk(d, 0, len(p), bytes(p)) for d, p in artifact.pages.items()])
        assert intake.keep() == ""  # 12 + 1: staged before its manifest
        store.commit_artifact(artifact.manifest, {})
        intake.committed(artifact.manifest)
    assert bounds.staged.held("ipv4:10.0.0.1") == 12 * PAGE
    store.close()


def test_a_store_budget_caps_what_a_connection_stages(tmp_path) -> None:
    """With a budget, no upload stages more than it: such an artifact could never be stored."""
    store = Store(tmp_path / "s", initial_map_bytes=1 << 22, min_free_bytes=0)
    bounds = _bounds(staged_per_connection=1 << 30, budget_bytes=8 * PAGE)
    refused = _kept(store, bounds, "ipv4:10.0.0.1", b"a", 9)
    assert "its limit of 32768 (store_budget_bytes)" in refused
    assert store.stats().staged_pages == 0
    store.close()


def test_a_full_staging_area_collects_what_outlived_its_ttl(tmp_path) -> None:
    """Staged pages past their TTL are collected when they stand in an upload's way, not
    only at the next housekeeping round."""
    store = Store(tmp_path / "s", initial_map_bytes=1 << 22, min_free_bytes=0)
    young = _bounds(staged_max_bytes=16 * PAGE)
    assert _kept(store, young, "a", b"a", 12) == ""
    assert "staged_max_bytes" in _kept(store, young, "b", b"b", 12)
    expired = _bounds(staged_max_bytes=16 * PAGE, staged_ttl_s=0.0)
    assert _kept(store, expired, "b", b"b", 12) == ""
    stats = store.stats()
    assert (stats.staged_pages, stats.pages) == (12, 12)  # the first upload's, collected
    store.close()


# ----------------------------------------------------------------------------------------
# the probes, on a daemon


def _connection(address: str) -> grpc.Channel:
    """A channel on a connection of its own (a local subchannel pool)."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def _put(address: str, messages: Iterator[bytes], channel: grpc.Channel | None = None):
    """A PutArtifact of raw messages (over a new connection unless `channel`): its status
    code and details."""
    with _connection(address) if channel is None else nullcontext(channel) as connection:
        put = connection.stream_unary(PUT, request_serializer=None)
        try:
            put(messages, timeout=120)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return CODE.OK, ""


def _whole_pages(mib: int, tag: bytes) -> Iterator[bytes]:
    """`mib` messages of one whole 1 MiB page each, and no manifest."""
    for chunk in _chunks(tag, mib, 1 << 20):
        yield wire.encode_page_block(wire.PUT_PAGES, [chunk])


def _unfinished_pages(mib: int, tag: bytes) -> Iterator[bytes]:
    """`mib` messages each starting a 2 MiB page with 1 MiB, never finished."""
    for index in range(mib):
        digest = hashlib.sha256(tag + b"%d" % index).digest()
        yield wire.encode_page_block(
            wire.PUT_PAGES, [wire.Chunk(digest, 0, 2 << 20, bytes(1 << 20))]
        )


def _three_mib(seed: int):
    return random_artifact(random.Random(seed), num_layers=3, kv_heads=4, head_dim=64,
                           kv_dtype=pb.KV_DTYPE_FLOAT32, tokens=512, page_tokens=32)  # fmt: skip


def test_an_upload_without_its_manifest_never_wipes_the_cache(start_daemon) -> None:
    """Was: one 40 MiB upload with no manifest evicted all five artifacts of a 24 MiB
    budget, and every later write was refused ("held by pinned artifacts") for 24 h.
    Now staged pages are outside the budget, bounded per connection (here by the budget:
    a larger artifact could not be stored) and in total."""
    budget = ["--store-budget-bytes", "24MiB", "--staged-max-bytes", "32MiB"]
    daemon = start_daemon(extra_args=budget)
    with Client(daemon.address) as client, _connection(daemon.address) as attacker:
        kept = {client.put_artifact(_three_mib(seed)).artifact_id for seed in range(5)}
        code, details = _put(daemon.address, _whole_pages(40, b"attack"), attacker)
        assert code == CODE.INVALID_ARGUMENT and "were not kept" in details, details
        assert "its limit of 25165824 (store_budget_bytes)" in details
        stats = client.stats()
        assert (stats.artifacts, stats.staged_pages) == (5, 0)

        details = _put(daemon.address, _whole_pages(20, b"cut"), attacker)[1]
        assert "kept for a retry" in details, details
        details = _put(daemon.address, _whole_pages(6, b"more"), attacker)[1]
        assert "this client's host hold 20971520 bytes" in details, details
        # Was: each new connection (a new port) had a quota of its own. One host has one.
        details = _put(daemon.address, _whole_pages(6, b"other"))[1]  # another connection
        assert "this client's host hold 20971520 bytes" in details, details

        kept.add(client.put_artifact(_three_mib(5)).artifact_id)  # writes go on
        assert {info.artifact_id for info in client.list_artifacts()} == kept
        assert (client.stats().staged_pages, client.info().cache.evicted_artifacts) == (20, 0)


def _rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("RssAnon"))


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll until the daemon reaches a state (not a timing assertion: a generous bound)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"the daemon never reached: {what}"
        time.sleep(0.01)


def test_uploads_together_hold_at_most_upload_memory_bytes(start_daemon) -> None:
    """Was: eight concurrent uploads of unfinished pages grew the daemon by 3.1 GiB, each
    within its own bound. Now the uploads' memory is one bound: with 40 MiB of one upload's
    unfinished pages held, another's are refused at the 64 MiB of upload_memory_bytes."""
    limits = ["--upload-memory-bytes", "64MiB", "--spill-bytes", "1MiB"]
    daemon = start_daemon(extra_args=limits)
    marker = _chunks(b"marker", 1, 1 << 20)[0]
    other_done = threading.Event()

    def holding() -> Iterator[bytes]:
        yield from _unfinished_pages(40, b"held")
        yield wire.encode_page_block(wire.PUT_PAGES, [marker])  # staged at once (spill)
        other_done.wait(60)

    held: list[tuple[grpc.StatusCode, str]] = []
    first = threading.Thread(target=lambda: held.append(_put(daemon.address, holding())))
    first.start()
    with Client(daemon.address) as client:
        _wait_for(lambda: not client.missing_pages([marker.sha256]), "the first upload held")
        code, details = _put(daemon.address, _unfinished_pages(40, b"refused"))
        other_done.set()
        first.join()
    assert code == CODE.RESOURCE_EXHAUSTED, details
    assert "upload_memory_bytes = 67108864" in details
    assert held[0][0] == CODE.INVALID_ARGUMENT  # ended without its manifest, not refused


def test_the_memory_of_a_burst_of_uploads_is_given_back(start_daemon) -> None:
    """Was: after eight uploads of unfinished pages, 1.9 GiB stayed resident (freed by
    Python, kept by the C allocator). Now the last upload to end hands it back (with
    malloc_top_pad_bytes = 0: each allocator heap keeps that much besides)."""
    daemon = start_daemon(extra_args=["--malloc-top-pad-bytes", "0"])
    before = _rss_anon(daemon.proc.pid)
    codes: list[tuple[grpc.StatusCode, str]] = []
    uploads = [
        threading.Thread(
            target=lambda n=n: codes.append(_put(daemon.address, _unfinished_pages(60, b"%d" % n)))
        )
        for n in range(4)
    ]
    for upload in uploads:
        upload.start()
    for upload in uploads:
        upload.join()
    # of the 240 MiB received, 0-3 MiB stayed here; 40-70 MiB without the allocator's
    # trim, 260 MiB before this fix. Allocator-dependent: shown, not asserted (the trim
    # itself is: test_the_last_upload_to_end_trims_the_allocator).
    print(f"resident after the burst: {(_rss_anon(daemon.proc.pid) - before) / 2**20:+.1f} MiB")
    assert [code for code, _ in codes] == [CODE.INVALID_ARGUMENT] * 4  # none refused


def test_the_last_upload_to_end_trims_the_allocator() -> None:
    """After a burst past TRIM_AFTER_BYTES, the upload that gives the count back to 0 asks
    the C allocator to hand its free memory back; a small burst does not."""
    memory = UploadMemory(1 << 30)
    if memory._trim is None:
        pytest.skip("this C library has no malloc_trim")
    memory.hold(1 << 20)
    memory.release(1 << 20)
    assert (memory.held, memory.trims) == (0, 0)
    memory.hold(TRIM_AFTER_BYTES)
    assert memory.try_hold(1)
    memory.release(TRIM_AFTER_BYTES)
    assert memory.trims == 0  # one upload still holds a byte
    memory.release(1)
    assert (memory.held, memory.trims) == (0, 1)


def test_upload_memory_holds_at_least_the_largest_page() -> None:
    """Was: upload_memory_bytes took 1 MiB, where one page arriving in pieces may be 64 MiB."""
    with pytest.raises(
        ConfigError, match="upload_memory_bytes = 33554432: use a value in 67108864"
    ):
        DaemonConfig(upload_memory_bytes=32 << 20)
    assert DaemonConfig(upload_memory_bytes=MAX_PAGE_BYTES).upload_memory_bytes == MAX_PAGE_BYTES


def test_a_client_host_is_its_address_without_the_port() -> None:
    """Was: the key was gRPC's peer, ip:port, so every new connection had a fresh quota."""
    assert peer_host("ipv4:10.0.0.1:5000") == peer_host("ipv4:10.0.0.1:5001") == "ipv4:10.0.0.1"
    assert peer_host("ipv6:[::1]:5000") == "ipv6:[::1]"
    assert peer_host("unix:/run/kvgraft.sock") == peer_host("unix:") == "unix"


def test_a_silent_upload_ends_and_gives_its_memory_back(start_daemon) -> None:
    """Was: a PutArtifact that stopped sending held its memory and staged pages for ever
    (max_call_s was checked only when a next message came); 4-5 of them held all of
    upload_memory_bytes. Now put_idle_s without a message ends it (DEADLINE_EXCEEDED)."""
    limits = ["--upload-memory-bytes", "64MiB", "--spill-bytes", "1MiB", "--put-idle-s", "2"]
    daemon = start_daemon(extra_args=limits)
    done = threading.Event()

    def silent() -> Iterator[bytes]:
        yield from _unfinished_pages(40, b"silent")  # 40 MiB held, then nothing
        done.wait(30)

    try:
        code, details = _put(daemon.address, silent())
    finally:
        done.set()
    assert code == CODE.DEADLINE_EXCEEDED, details
    assert "sent no message for 2 s, the daemon's limit (put_idle_s)" in details, details
    # its 40 MiB are given back: another 40 MiB upload fits in the 64 MiB
    code, details = _put(daemon.address, _unfinished_pages(40, b"next"))
    assert code == CODE.INVALID_ARGUMENT and "ended without a manifest" in details, details
