"""Bad input: every malformed request gets a clear status, stores nothing, and the daemon serves on.

The daemon is a trust boundary (docs/architecture.md): PutArtifact streams are parsed by
hand (kvgraft.wire), every page's SHA-256 is recomputed on arrival, and the
manifest is validated before anything commits. Each test here sends one kind
of bad input, with raw gRPC calls where the client library would refuse to
send it, and asserts:

* the exact status code (DATA_LOSS for bytes that do not match their hash,
  INVALID_ARGUMENT for malformed requests, NOT_FOUND for unknown artifacts,
  RESOURCE_EXHAUSTED for a message over gRPC's 4 MiB limit), with a message
  that names the problem;
* that no artifact was added: the listing, Stats.artifacts, the change feed
  and the referenced pages are unchanged;
* the staged-page semantics: pages of a stream that ends without a manifest
  or is cut by the client are kept as *staged* pages (Stats.staged_pages),
  visible to MissingPages (so a retry need not resend them) but to no reader
  of artifacts, claimed by the next put that names them, collected at start
  once older than --staged-ttl-s; a stream refused for bad content stages
  nothing;
* that the daemon still serves: a valid put and get work afterwards.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
import psutil
import pytest

from kvgraft import Client, wire
from kvgraft.artifact import Artifact, page_sizes
from kvgraft.errors import InvalidArgument, NotFound
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraft.v1 import kvgraft_pb2_grpc as pb_grpc
from kvgraftd.store.intake import SHA256_PARALLEL_MIN_BYTES
from kvgraftd.testing.daemon_process import DaemonProcess
from tests.support.factory import random_artifact
from tests.support.store_audit import assert_served_whole

PUT_METHOD = "/kvgraft.v1.Kvgraft/PutArtifact"
CODE = grpc.StatusCode


# ---------------------------------------------------------------------------
# fixtures: one daemon for the module (every test checks deltas, not totals)


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory) -> Iterable[DaemonProcess]:
    daemon = DaemonProcess.start(tmp_path_factory.mktemp("bad-input"))
    yield daemon
    daemon.stop()
    # Every refusal was a decision, not an accident: no traceback in the log.
    assert "Traceback" not in daemon.log(), daemon.log()


@pytest.fixture
def kv(shared_daemon: DaemonProcess) -> Iterable[Client]:
    with Client(shared_daemon.address, timeout_s=30) as client:
        yield client


@pytest.fixture
def channel(shared_daemon: DaemonProcess) -> Iterable[grpc.Channel]:
    with grpc.insecure_channel(shared_daemon.address) as chan:
        yield chan


# ---------------------------------------------------------------------------
# helpers


@dataclass(frozen=True)
class Snapshot:
    ids: frozenset[str]
    artifacts: int
    pages: int
    staged_pages: int
    page_bytes: int
    last_sequence: int

    @property
    def referenced_pages(self) -> int:
        return self.pages - self.staged_pages


def snapshot(client: Client) -> Snapshot:
    stats = client.stats()
    return Snapshot(
        frozenset(info.artifact_id for info in client.list_artifacts()),
        stats.artifacts,
        stats.pages,
        stats.staged_pages,
        stats.page_bytes,
        stats.last_sequence,
    )


def assert_nothing_stored(
    client: Client, before: Snapshot, *, staged_pages: int = 0, staged_bytes: int = 0
) -> None:
    """No artifact, reference or change record added; exactly this much staged."""
    after = snapshot(client)
    assert after.ids == before.ids
    assert after.artifacts == before.artifacts == len(before.ids)
    assert after.last_sequence == before.last_sequence
    assert after.referenced_pages == before.referenced_pages
    assert after.staged_pages == before.staged_pages + staged_pages
    assert after.page_bytes == before.page_bytes + staged_bytes


def assert_still_serves(client: Client, rng: random.Random) -> None:
    """A valid put and get work, and no call so far hit the internal-error path."""
    calls = dict(client.stats().rpc_calls)
    assert not [key for key in calls if key.endswith(":INTERNAL")], calls
    artifact = random_artifact(rng)
    response = client.put_artifact(artifact)
    assert response.artifact_id == artifact.id and not response.already_present
    assert_served_whole(client.get_artifact(artifact.id), artifact)


def raw_put(channel: grpc.Channel, messages: Iterable[bytes]) -> grpc.RpcError:
    """Send hand-made PutArtifact messages; return the error the daemon answered."""
    put = channel.stream_unary(
        PUT_METHOD,
        request_serializer=None,
        response_deserializer=pb.PutArtifactResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as caught:
        put(iter(messages), timeout=30)
    return caught.value


def assert_status(error: grpc.RpcError, code: grpc.StatusCode, *phrases: str) -> None:
    details = error.details() or ""
    assert error.code() == code, f"{error.code()}: {details}"
    assert len(details) > 20, details
    for phrase in phrases:
        assert phrase in details, f"{phrase!r} not in {details!r}"


def pages_message(*chunks: wire.Chunk) -> bytes:
    return wire.encode_page_block(wire.PUT_PAGES, chunks)


def manifest_message(manifest: pb.Manifest | bytes) -> bytes:
    raw = (
        manifest if isinstance(manifest, bytes) else manifest.SerializeToString(deterministic=True)
    )
    return wire.encode_submessage(wire.PUT_MANIFEST, raw)


def whole(data: bytes, sha256: bytes | None = None) -> wire.Chunk:
    return wire.Chunk(sha256 or hashlib.sha256(data).digest(), 0, len(data), data)


def page_messages(artifact: Artifact, digests: Iterable[bytes] | None = None) -> list[bytes]:
    chosen = list(page_sizes(artifact.manifest)) if digests is None else list(digests)
    pairs = [(d, artifact.pages[d]) for d in chosen]
    return [wire.encode_page_block(wire.PUT_PAGES, c) for c in wire.split_pages(pairs)]


def small_artifact(rng: random.Random) -> Artifact:
    """2 layers x 3 pages (the last one short) of float32, a few KiB."""
    return random_artifact(
        rng,
        num_layers=2,
        kv_heads=2,
        head_dim=8,
        kv_dtype=pb.KV_DTYPE_FLOAT32,
        tokens=20,
        page_tokens=8,
    )


def refused_put(
    kv: Client,
    channel: grpc.Channel,
    rng: random.Random,
    messages: Iterable[bytes],
    code: grpc.StatusCode,
    *phrases: str,
) -> None:
    """The stream is refused with `code`, stores and stages nothing, and the daemon serves on."""
    before = snapshot(kv)
    assert_status(raw_put(channel, messages), code, *phrases)
    assert_nothing_stored(kv, before)
    assert_still_serves(kv, rng)


# ---------------------------------------------------------------------------
# page content: hashes and sizes


def test_page_whose_bytes_miss_their_hash_is_data_loss(kv, channel, rng) -> None:
    artifact = small_artifact(rng)
    digests = list(page_sizes(artifact.manifest))
    bad = bytearray(artifact.pages[digests[-1]])
    bad[len(bad) // 2] ^= 0x01  # one bit
    messages = [
        *page_messages(artifact, digests[:-1]),  # valid pages first: they must not stay
        pages_message(whole(bytes(bad), digests[-1])),
        manifest_message(artifact.manifest),
    ]
    refused_put(kv, channel, rng, messages, CODE.DATA_LOSS, digests[-1].hex()[:16], "corrupt")
    assert kv.missing_pages(digests) == digests  # not even the valid pages were kept


def test_corrupt_page_in_a_large_message_is_named(kv, channel, rng) -> None:
    """A message of 3 MB: its pages are hashed side by side; the bad one is still named."""
    artifact = random_artifact(
        rng, num_layers=4, kv_heads=3, head_dim=64, kv_dtype=pb.KV_DTYPE_FLOAT32,
        tokens=8 * 64, page_tokens=64,
    )  # fmt: skip
    digests = list(artifact.manifest.page_sha256)  # 32 pages of 98 KB
    assert len(digests) * len(artifact.pages[digests[0]]) > 2 * SHA256_PARALLEL_MIN_BYTES
    chunks = [whole(bytes(artifact.pages[d])) for d in digests]
    bad = bytearray(chunks[25].data)
    bad[100] ^= 0x04
    chunks[25] = whole(bytes(bad), digests[25])
    messages = [pages_message(*chunks), manifest_message(artifact.manifest)]
    refused_put(kv, channel, rng, messages, CODE.DATA_LOSS, digests[25].hex()[:16], "corrupt")
    assert kv.missing_pages(digests) == digests


def test_chunked_page_whose_bytes_miss_their_hash_is_data_loss(kv, channel, rng) -> None:
    artifact = small_artifact(rng)
    digest = artifact.manifest.page_sha256[0]
    data = bytes(artifact.pages[digest])
    half = len(data) // 2
    tail = bytes([data[half] ^ 0x80]) + data[half + 1 :]
    messages = [
        pages_message(wire.Chunk(digest, 0, len(data), data[:half])),
        pages_message(wire.Chunk(digest, half, len(data), tail)),
        manifest_message(artifact.manifest),
    ]
    refused_put(kv, channel, rng, messages, CODE.DATA_LOSS, "arrived corrupt", "resend")


def test_page_of_the_wrong_size_for_the_manifest(kv, channel, rng) -> None:
    artifact = small_artifact(rng)
    short = rng.randbytes(page_sizes(artifact.manifest)[artifact.manifest.page_sha256[0]] - 4)
    manifest = pb.Manifest()
    manifest.CopyFrom(artifact.manifest)
    manifest.page_sha256[0] = hashlib.sha256(short).digest()  # hash right, size wrong
    messages = [
        *page_messages(artifact, manifest.page_sha256[1:]),
        pages_message(whole(short)),
        manifest_message(manifest),
    ]
    refused_put(kv, channel, rng, messages, CODE.INVALID_ARGUMENT, "bytes; the manifest's layout")


def test_manifest_naming_a_stored_page_at_another_size(kv, channel, rng) -> None:
    """Regression: the daemon committed such a manifest, an artifact nobody could read."""
    stored = random_artifact(
        rng,
        num_layers=1,
        kv_heads=1,
        head_dim=8,
        kv_dtype=pb.KV_DTYPE_FLOAT32,
        tokens=4,
        page_tokens=4,
    )
    kv.put_artifact(stored)
    liar = pb.Manifest()
    liar.CopyFrom(stored.manifest)
    liar.profile.page_tokens = 8  # the same page hash, now at 8 tokens' size
    liar.token_ids[:] = range(8)
    liar.segment_ends[:] = [8]
    refused_put(
        kv,
        channel,
        rng,
        [manifest_message(liar)],
        CODE.INVALID_ARGUMENT,
        "is stored with 256 bytes; the manifest's layout needs 512",
    )
    assert_served_whole(kv.get_artifact(stored.id), stored)


def test_manifest_naming_pages_never_sent(kv, channel, rng) -> None:
    artifact = small_artifact(rng)
    digests = list(page_sizes(artifact.manifest))
    messages = [*page_messages(artifact, digests[:2]), manifest_message(artifact.manifest)]
    refused_put(
        kv, channel, rng, messages, CODE.INVALID_ARGUMENT, "neither stored nor sent", "MissingPages"
    )
    assert kv.missing_pages(digests) == digests


def test_pages_the_manifest_does_not_name(kv, channel, rng) -> None:
    artifact, other = small_artifact(rng), small_artifact(rng)
    stray = other.manifest.page_sha256[0]
    messages = [
        *page_messages(artifact),
        *page_messages(other, [stray]),
        manifest_message(artifact.manifest),
    ]
    refused_put(
        kv, channel, rng, messages, CODE.INVALID_ARGUMENT, stray.hex()[:16], "does not name it"
    )


# ---------------------------------------------------------------------------
# streams that end early: staged pages


def test_stream_without_manifest_stages_its_whole_pages(kv, channel, rng) -> None:
    artifact = small_artifact(rng)
    sizes = page_sizes(artifact.manifest)
    digests = list(sizes)
    held = random_artifact(rng)  # a page already referenced is not staged again
    kv.put_artifact(held)
    held_digest = held.manifest.page_sha256[0]
    partial = digests[-1]
    data = bytes(artifact.pages[partial])
    messages = [
        *page_messages(artifact, digests[:-1]),
        *page_messages(held, [held_digest]),
        pages_message(wire.Chunk(partial, 0, len(data), data[:5])),  # a page cut short
    ]
    before = snapshot(kv)
    error = raw_put(channel, messages)
    assert_status(error, CODE.INVALID_ARGUMENT, "without a manifest", "kept for a retry")
    staged = digests[:-1]
    assert_nothing_stored(
        kv, before, staged_pages=len(staged), staged_bytes=sum(sizes[d] for d in staged)
    )
    # Staged pages count as held for MissingPages; the cut page does not.
    assert kv.missing_pages([*digests, held_digest]) == [partial]
    with pytest.raises(NotFound):
        kv.stat(artifact.id)

    # A retry sends only the missing page and claims the staged ones.
    response = kv.put_artifact(artifact)
    assert (response.pages_written, response.bytes_written) == (1, sizes[partial])
    after = snapshot(kv)
    assert after.staged_pages == before.staged_pages
    assert after.referenced_pages == before.referenced_pages + len(digests)
    assert_served_whole(kv.get_artifact(artifact.id), artifact)


def test_empty_stream_is_refused(kv, channel, rng) -> None:
    refused_put(kv, channel, rng, [], CODE.INVALID_ARGUMENT, "ended without a manifest")


def test_staged_pages_survive_restart_and_are_collected_after_their_ttl(start_daemon, rng) -> None:
    daemon = start_daemon()
    artifact = small_artifact(rng)
    sizes = page_sizes(artifact.manifest)
    with grpc.insecure_channel(daemon.address) as chan:
        assert_status(raw_put(chan, page_messages(artifact)), CODE.INVALID_ARGUMENT, "manifest")
    with Client(daemon.address) as client:
        stats = client.stats()
        assert (stats.staged_pages, stats.pages, stats.artifacts) == (len(sizes), len(sizes), 0)
        assert stats.page_bytes == sum(sizes.values())

    daemon.kill()  # no clean shutdown: staged pages are already committed
    daemon.launch()
    with Client(daemon.address) as client:
        stats = client.stats()
        assert (stats.staged_pages, stats.pages, stats.artifacts) == (len(sizes), len(sizes), 0)
        assert client.missing_pages(sizes) == []

    daemon.terminate()
    daemon.extra_args = ["--staged-ttl-s", "0"]  # collected at start
    daemon.launch()
    with Client(daemon.address) as client:
        stats = client.stats()
        assert (stats.staged_pages, stats.pages, stats.page_bytes) == (0, 0, 0)
        assert client.missing_pages(sizes) == list(sizes)
        assert_still_serves(client, rng)
    assert any("collected 6 staged pages" in line for line in daemon.log_lines), daemon.log()


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll until the daemon reaches a state (not a timing assertion: a generous bound)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"the daemon never reached: {what}"
        time.sleep(0.01)


def test_stream_cut_by_the_client_leaves_no_artifact(start_daemon, rng) -> None:
    """Cancel mid-stream: pages the daemon verified stay staged; nothing is visible."""
    daemon = start_daemon(extra_args=["--spill-bytes", "1MiB"])
    # 3 pages of 512 KiB: the first two pass the spill threshold and are staged
    # while the stream is open, which is how the test knows the daemon has them.
    artifact = random_artifact(
        rng,
        num_layers=1,
        kv_heads=4,
        head_dim=64,
        kv_dtype=pb.KV_DTYPE_FLOAT32,
        tokens=768,
        page_tokens=256,
    )
    first, second, third = artifact.manifest.page_sha256
    size = len(artifact.pages[first])
    release = threading.Event()

    def requests():
        yield pages_message(
            whole(bytes(artifact.pages[first])), whole(bytes(artifact.pages[second]))
        )
        data = bytes(artifact.pages[third])
        yield pages_message(wire.Chunk(third, 0, size, data[: size // 2]))
        release.wait(60)  # the client hangs here until cancelled

    with Client(daemon.address) as client, grpc.insecure_channel(daemon.address) as chan:
        before = snapshot(client)
        put = chan.stream_unary(
            PUT_METHOD,
            request_serializer=None,
            response_deserializer=pb.PutArtifactResponse.FromString,
        )
        future = put.future(requests(), timeout=60)
        _wait_for(lambda: not client.missing_pages([first, second]), "first two pages staged")
        assert future.cancel()
        release.set()
        with pytest.raises(grpc.FutureCancelledError):
            future.result()
        # gRPC ends a cancelled upload either by raising in the daemon's request
        # iterator (CANCELLED) or as an early end of stream (INVALID_ARGUMENT: no
        # manifest); both stage the verified pages and store no artifact.
        _wait_for(
            lambda: (
                sum(
                    client.stats().rpc_calls.get(f"PutArtifact:{code}", 0)
                    for code in ("CANCELLED", "INVALID_ARGUMENT")
                )
                == 1
            ),
            "the daemon saw the cancellation",
        )
        assert_nothing_stored(client, before, staged_pages=2, staged_bytes=2 * size)
        assert client.missing_pages([first, second, third]) == [third]
        with pytest.raises(NotFound):
            client.get_artifact(artifact.id)

        response = client.put_artifact(artifact)  # the retry sends the third page only
        assert (response.pages_written, response.bytes_written) == (1, size)
        stats = client.stats()
        assert (stats.staged_pages, stats.pages, stats.artifacts) == (0, 3, 1)
        assert_served_whole(client.get_artifact(artifact.id), artifact)


def test_chunks_announcing_huge_pages_cost_only_their_bytes(start_daemon, rng) -> None:
    """Regression: a page's first chunk allocated all of its page_bytes up front.

    So a message of a few hundred bytes announcing 64 MiB pages made the
    daemon allocate (and zero) gigabytes: an easy way to get it killed. Here
    40 one-byte chunks announce 2.5 GiB; the daemon's memory must not follow.
    """
    daemon = start_daemon(extra_args=["--spill-bytes", "1MiB"])
    claims = [wire.Chunk(bytes([i]) * 32, 0, 64 << 20, b"x") for i in range(40)]
    # A 1 MiB page after the claims is staged (spilled) on arrival: once
    # MissingPages sees it, the daemon has read every claim before it.
    marker = rng.randbytes(1 << 20)
    marker_digest = hashlib.sha256(marker).digest()
    release = threading.Event()

    def requests():
        yield pages_message(*claims, whole(marker))
        release.wait(60)

    process = psutil.Process(daemon.proc.pid)
    with Client(daemon.address) as client, grpc.insecure_channel(daemon.address) as chan:
        before = snapshot(client)
        rss_before = process.memory_info().rss
        put = chan.stream_unary(
            PUT_METHOD,
            request_serializer=None,
            response_deserializer=pb.PutArtifactResponse.FromString,
        )
        future = put.future(requests(), timeout=60)
        _wait_for(lambda: not client.missing_pages([marker_digest]), "the marker page staged")
        grown_bytes = process.memory_info().rss - rss_before
        release.set()
        error = future.exception()
        assert_status(error, CODE.INVALID_ARGUMENT, "without a manifest")
        assert grown_bytes < 256 << 20, f"{grown_bytes >> 20} MiB for 2.5 GiB announced"
        assert_nothing_stored(client, before, staged_pages=1, staged_bytes=len(marker))
        assert_still_serves(client, rng)


# ---------------------------------------------------------------------------
# chunk framing


def _chunk_cases() -> list[tuple[str, Callable[[bytes, bytes], list[wire.Chunk]], str]]:
    """(name, chunks of page (digest, data), phrase of the refusal)."""
    order = "chunks must arrive in order"
    return [
        ("first chunk not at 0", lambda d, b: [wire.Chunk(d, 8, len(b), b[8:])], "offset 0"),
        (
            "gap",
            lambda d, b: [wire.Chunk(d, 0, len(b), b[:8]), wire.Chunk(d, 16, len(b), b[16:])],
            order,
        ),
        (
            "overlap",
            lambda d, b: [wire.Chunk(d, 0, len(b), b[:16]), wire.Chunk(d, 8, len(b), b[8:])],
            order,
        ),
        (
            "out of order",
            lambda d, b: [
                wire.Chunk(d, 0, len(b), b[:8]),
                wire.Chunk(d, 16, len(b), b[16:]),
                wire.Chunk(d, 8, len(b), b[8:16]),
            ],
            order,
        ),
        (
            "past page_bytes",
            lambda d, b: [wire.Chunk(d, 0, len(b), b[:8]), wire.Chunk(d, 8, len(b), b[8:] + b"x")],
            "cover the page exactly",
        ),
        (
            "longer than page_bytes",
            lambda d, b: [wire.Chunk(d, 0, len(b), b + b"xy")],
            "cover the page exactly",
        ),
        (
            "page_bytes changes",
            lambda d, b: [wire.Chunk(d, 0, len(b), b[:8]), wire.Chunk(d, 8, len(b) + 1, b[8:])],
            "one page_bytes",
        ),
        ("page_bytes 0", lambda d, b: [wire.Chunk(d, 0, 0, b"x")], "outside 1.."),
        ("no bytes", lambda d, b: [wire.Chunk(d, 0, len(b), b"")], "carries no bytes"),
        (
            "page_bytes over 64 MiB",
            lambda d, b: [wire.Chunk(d, 0, (64 << 20) + 1, b)],
            "outside 1..",
        ),
        ("31-byte sha256", lambda d, b: [wire.Chunk(d[:31], 0, len(b), b)], "32-byte sha256"),
        ("no sha256", lambda d, b: [wire.Chunk(b"", 0, len(b), b)], "32-byte sha256"),
        (
            "incomplete at the manifest",
            lambda d, b: [wire.Chunk(d, 0, len(b), b[:8])],
            "is incomplete",
        ),
    ]


@pytest.mark.parametrize(
    ("name", "make", "phrase"), _chunk_cases(), ids=[c[0] for c in _chunk_cases()]
)
def test_bad_chunk_framing_is_invalid_argument(kv, channel, rng, name, make, phrase) -> None:
    artifact = small_artifact(rng)
    digests = list(page_sizes(artifact.manifest))
    target = digests[0]
    chunks = make(target, bytes(artifact.pages[target]))
    messages = [
        *page_messages(artifact, digests[1:]),
        *(pages_message(chunk) for chunk in chunks),  # one chunk per message
        manifest_message(artifact.manifest),
    ]
    refused_put(kv, channel, rng, messages, CODE.INVALID_ARGUMENT, phrase)


def test_message_over_the_grpc_limit_is_refused(kv, channel, rng) -> None:
    data = rng.randbytes(wire.MAX_MESSAGE_BYTES)  # plus framing: over 4 MiB
    message = pages_message(whole(data))
    assert len(message) > wire.MAX_MESSAGE_BYTES
    refused_put(kv, channel, rng, [message], CODE.RESOURCE_EXHAUSTED, "larger than max")
    assert kv.missing_pages([hashlib.sha256(data).digest()]) == [hashlib.sha256(data).digest()]


# ---------------------------------------------------------------------------
# garbage and misplaced messages


def _garbage_cases() -> list[tuple[str, Callable[[Artifact], list[bytes]], str]]:
    def manifest(a: Artifact) -> bytes:
        return manifest_message(a.manifest)

    return [
        ("empty message", lambda a: [b""], "either pages or a manifest"),
        ("eleven 0xff bytes", lambda a: [b"\xff" * 11], "varint is longer than 10 bytes"),
        ("key without value", lambda a: [b"\x08"], "varint runs past the end"),
        ("length past the end", lambda a: [b"\x0a\x05ab"], "longer than what remains"),
        ("field number 0", lambda a: [b"\x02\x00"], "field number 0"),
        ("group wire type", lambda a: [b"\x0b"], "unsupported wire type 3"),
        ("text", lambda a: [b"hello, kvgraft!"], "unsupported wire type"),
        ("garbage inside a PageBlock", lambda a: [b"\x0a\x02\xff\xff"], "truncated message"),
        ("garbage inside a PageChunk", lambda a: [b"\x0a\x04\x0a\x02\x0a\x05"], "truncated"),
        ("unknown fields only", lambda a: [b"\x18\x01\x22\x00"], "either pages or a manifest"),
        (
            "pages and manifest in one message",
            lambda a: [page_messages(a)[0] + manifest(a)],
            "either pages or a manifest",
        ),
        ("manifest then pages", lambda a: [manifest(a), page_messages(a)[0]], "last message"),
        ("two manifests", lambda a: [*page_messages(a), manifest(a), manifest(a)], "last message"),
    ]


@pytest.mark.parametrize(
    ("name", "make", "phrase"), _garbage_cases(), ids=[c[0] for c in _garbage_cases()]
)
def test_garbage_messages_are_invalid_argument(kv, channel, rng, name, make, phrase) -> None:
    artifact = small_artifact(rng)
    refused_put(kv, channel, rng, make(artifact), CODE.INVALID_ARGUMENT, phrase)


# ---------------------------------------------------------------------------
# malformed manifests


def _set(path: str, value) -> Callable[[pb.Manifest], None]:
    def mutate(m: pb.Manifest) -> None:
        *parents, name = path.split(".")
        target = m
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, name, value)

    return mutate


def _manifest_cases() -> list[tuple[str, Callable[[pb.Manifest], None], str]]:
    def two_sizes(m: pb.Manifest) -> None:
        m.page_sha256[-1] = m.page_sha256[0]  # the short tail page named like a full one

    def too_many_labels(m: pb.Manifest) -> None:
        m.labels.update({f"k{i}": "v" for i in range(65)})

    return [
        ("fingerprint of 31 bytes", _set("model_fingerprint", bytes(31)), "32-byte SHA-256"),
        ("format version 2", _set("format_version", 2), "format_version 2"),
        ("one page too few", lambda m: m.page_sha256.pop(), "manifest names 5 pages"),
        ("one page too many", lambda m: m.page_sha256.append(bytes(32)), "manifest names 7 pages"),
        (
            "segments not increasing",
            lambda m: m.segment_ends.__setitem__(slice(None), [9, 9, 20]),
            "strictly increasing",
        ),
        (
            "segments decreasing",
            lambda m: m.segment_ends.__setitem__(slice(None), [12, 4, 20]),
            "strictly increasing",
        ),
        (
            "segments short of the tokens",
            lambda m: m.segment_ends.__setitem__(slice(None), [19]),
            "end at 19",
        ),
        ("no segments", lambda m: m.ClearField("segment_ends"), "no segment_ends"),
        ("no tokens", lambda m: m.ClearField("token_ids"), "no token_ids"),
        ("unknown dtype", _set("layout.kv_dtype", 7), "kv_dtype 7"),
        ("unspecified dtype", _set("layout.kv_dtype", 0), "kv_dtype 0"),
        ("zero layers", _set("layout.num_layers", 0), "num_layers"),
        ("zero page tokens", _set("profile.page_tokens", 0), "page_tokens must be >= 1"),
        ("31-byte page hash", lambda m: m.page_sha256.__setitem__(0, bytes(31)), "32 bytes"),
        ("one hash at two sizes", two_sizes, "named at two sizes"),
        ("pages over 64 MiB", _set("layout.head_dim", 1 << 20), "exceed 64 MiB"),
        ("65 labels", too_many_labels, "at most 64 labels"),
        ("empty label key", lambda m: m.labels.__setitem__("", "x"), "label keys"),
    ]


@pytest.mark.parametrize(
    ("name", "mutate", "phrase"), _manifest_cases(), ids=[c[0] for c in _manifest_cases()]
)
def test_malformed_manifest_is_invalid_argument(kv, channel, rng, name, mutate, phrase) -> None:
    artifact = small_artifact(rng)  # 20 tokens, pages of 8, 2 layers: 6 pages
    manifest = pb.Manifest()
    manifest.CopyFrom(artifact.manifest)
    mutate(manifest)
    messages = [*page_messages(artifact), manifest_message(manifest)]
    refused_put(kv, channel, rng, messages, CODE.INVALID_ARGUMENT, phrase)


@pytest.mark.parametrize(
    ("name", "raw", "phrase"),
    [
        ("unparsable", b"\x0a\xff\xff\xff", "do not parse"),
        ("unknown field", b"\xfa\x06\x01x", "fields this kvgraft version does not know"),
    ],
)
def test_undecodable_manifest_is_invalid_argument(kv, channel, rng, name, raw, phrase) -> None:
    artifact = small_artifact(rng)
    canonical = artifact.manifest.SerializeToString(deterministic=True)
    body = raw if name == "unparsable" else canonical + raw
    messages = [*page_messages(artifact), manifest_message(body)]
    refused_put(kv, channel, rng, messages, CODE.INVALID_ARGUMENT, phrase)


# ---------------------------------------------------------------------------
# unknown and malformed ids, hashes and tokens


UNKNOWN_ID = "0123456789abcdef" * 4
MALFORMED_IDS = ["", "abc", "0123456", "z" * 64, "0" * 65, "g" * 8, "0123 4567"]
ID_CALLS: dict[str, Callable[[Client, str], object]] = {
    "stat": lambda c, aid: c.stat(aid),
    "get": lambda c, aid: c.get_artifact(aid),
    "delete": lambda c, aid: c.delete(aid),
    "pin": lambda c, aid: c.pin(aid),
}


@pytest.mark.parametrize("call", sorted(ID_CALLS))
def test_unknown_and_malformed_artifact_ids(kv, rng, call) -> None:
    present = random_artifact(rng)
    kv.put_artifact(present)
    before = snapshot(kv)
    invoke = ID_CALLS[call]
    with pytest.raises(NotFound, match="kvgraft ls"):
        invoke(kv, UNKNOWN_ID)
    with pytest.raises(NotFound if call != "delete" else InvalidArgument) as caught:
        invoke(kv, UNKNOWN_ID[:8])  # a prefix nobody has; deletes refuse prefixes at all
    assert len(str(caught.value)) > 20
    for bad in MALFORMED_IDS:
        with pytest.raises(InvalidArgument, match="hex characters") as caught:
            invoke(kv, bad)
    assert_nothing_stored(kv, before)
    assert_served_whole(kv.get_artifact(present.id), present)
    assert not kv.stat(present.id).info.pinned
    assert_still_serves(kv, rng)


def test_delete_refuses_a_prefix_of_a_stored_artifact(kv, rng) -> None:
    artifact = random_artifact(rng)
    kv.put_artifact(artifact)
    before = snapshot(kv)
    with pytest.raises(InvalidArgument, match="not a full artifact id"):
        kv.delete(artifact.id[:16])
    assert_nothing_stored(kv, before)
    assert_served_whole(kv.get_artifact(artifact.id[:16]), artifact)  # reads take prefixes


def test_get_of_pages_outside_the_artifact(kv, rng) -> None:
    artifact, other = random_artifact(rng), random_artifact(rng)
    kv.put_artifact(artifact)
    for stranger in (other.manifest.page_sha256[0], b"\x01" * 31):
        with pytest.raises(InvalidArgument, match="is not part of artifact"):
            kv.get_artifact(artifact.id, only_pages=[stranger])


@pytest.mark.parametrize(
    "hashes",
    [[bytes(31)], [bytes(33)], [b""], [bytes(32), b"\x00" * 16]],
    ids=["31 bytes", "33 bytes", "empty", "one bad among good"],
)
def test_missing_pages_refuses_non_digests(kv, channel, hashes) -> None:
    stub = pb_grpc.KvgraftStub(channel)
    with pytest.raises(grpc.RpcError) as caught:
        stub.MissingPages(pb.MissingPagesRequest(sha256=hashes), timeout=30)
    assert_status(caught.value, CODE.INVALID_ARGUMENT, "32-byte SHA-256")
    with pytest.raises(InvalidArgument, match="32-byte"):
        kv.missing_pages(hashes)


def test_missing_pages_refuses_oversized_queries(channel) -> None:
    stub = pb_grpc.KvgraftStub(channel)
    request = pb.MissingPagesRequest(sha256=[i.to_bytes(32, "big") for i in range(100_001)])
    with pytest.raises(grpc.RpcError) as caught:
        stub.MissingPages(request, timeout=30)
    assert_status(caught.value, CODE.INVALID_ARGUMENT, "at most 100000 hashes", "split")


@pytest.mark.parametrize(
    ("request_fields", "phrase"),
    [
        ({"page_token": "zz"}, "page_token"),
        ({"page_token": "ab" * 16}, "page_token"),
        ({"page_token": "ab" * 33}, "page_token"),
        ({"page_size": 1001}, "page_size is at most 1000"),
    ],
    ids=["not hex", "16 bytes", "33 bytes", "page too large"],
)
def test_list_refuses_bad_tokens_and_sizes(channel, request_fields, phrase) -> None:
    stub = pb_grpc.KvgraftStub(channel)
    with pytest.raises(grpc.RpcError) as caught:
        stub.List(pb.ListRequest(**request_fields), timeout=30)
    assert_status(caught.value, CODE.INVALID_ARGUMENT, phrase)


@pytest.mark.parametrize("method", ["Stat", "Delete", "Pin", "List", "MissingPages", "GetArtifact"])
def test_undecodable_requests_are_invalid_argument(kv, channel, rng, method) -> None:
    """Regression: gRPC's own deserializer answered INTERNAL and logged a traceback."""
    before = snapshot(kv)
    path = f"/kvgraft.v1.Kvgraft/{method}"
    garbage = b"\x0a\xff\xff\xff\xff"  # field 1, a length past the end
    if method == "GetArtifact":
        call = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as caught:
            list(call(garbage, timeout=30))
    else:
        call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as caught:
            call(garbage, timeout=30)
    assert_status(caught.value, CODE.INVALID_ARGUMENT, "does not parse as a kvgraft.v1.")
    assert_nothing_stored(kv, before)
    assert_still_serves(kv, rng)
