"""Artifacts survive every trip byte for byte, through real daemons.

* put -> get: 100 artifacts of varied geometry (layers, heads, head dim,
  dtype, page size, page count), a few of them larger than one 4 MiB gRPC
  message and some with pages larger than one message (sent in chunks). The
  SHA-256 of every page fetched equals its name and the bytes sent.
* export -> import into a second, empty daemon -> export again gives the
  identical file, which the `safetensors` library reads back to the pages.
* Dedup: artifacts sharing pages store each page once; deleting one leaves
  the other whole; the store's page counts are exact at every step.
* Corruption: a byte flipped in a stored page on disk is DATA_LOSS on read,
  and no chunk of that page is ever sent; a byte flipped in a bundle fails
  the import with DataLoss and stores nothing.
"""

from __future__ import annotations

import base64
import hashlib
import os
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kvgraft import Artifact, Client, wire
from kvgraft.artifact import canonical_bytes, page_sizes, page_token_count
from kvgraft.bundle import BUNDLE_FORMAT
from kvgraft.errors import DataLoss
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.testing.daemon_process import DaemonProcess
from tests.support.factory import random_artifact
from tests.support.on_disk import flip_stored_page

F32, F16, BF16 = pb.KV_DTYPE_FLOAT32, pb.KV_DTYPE_FLOAT16, pb.KV_DTYPE_BFLOAT16
TORCH_DTYPES = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}

# Page geometry on both sides of the one-message limit: 2 * 1 head * T * 64 * 2
# bytes = 256 T; 16,127 tokens fit one message with its framing, 16,128 do not.
_ONE_MESSAGE_TOKENS = 16_127


def _message_cost(page_bytes: int) -> int:
    return page_bytes + wire.chunk_overhead_bytes(page_bytes)


assert (
    _message_cost(256 * _ONE_MESSAGE_TOKENS)
    <= wire.BLOCK_PAYLOAD_BYTES
    < _message_cost(256 * (_ONE_MESSAGE_TOKENS + 1))
)

# Explicit large geometries (keyword arguments of factory.random_artifact).
LARGE_CASES: dict[int, dict] = {
    # 40 pages of 128 KiB: 5 MiB over two messages at least.
    7: dict(num_layers=4, kv_heads=4, head_dim=64, kv_dtype=F32, page_tokens=64, tokens=640),
    # 8 MiB float32 pages (3 chunks each), then a 0.8 MiB tail page per layer.
    23: dict(num_layers=2, kv_heads=8, head_dim=128, kv_dtype=F32, page_tokens=1024, tokens=1124),
    # 4 MiB bfloat16 pages (two chunks each), then 1-token tail pages.
    41: dict(num_layers=3, kv_heads=4, head_dim=128, kv_dtype=BF16, page_tokens=2048, tokens=2049),
    # A page just under the message payload, and one just over it.
    59: dict(
        num_layers=1,
        kv_heads=1,
        head_dim=64,
        kv_dtype=F16,
        page_tokens=_ONE_MESSAGE_TOKENS,
        tokens=_ONE_MESSAGE_TOKENS,
    ),
    60: dict(
        num_layers=1,
        kv_heads=1,
        head_dim=64,
        kv_dtype=F16,
        page_tokens=_ONE_MESSAGE_TOKENS + 1,
        tokens=2 * (_ONE_MESSAGE_TOKENS + 1) + 5,
    ),
    # Many small pages, one token each, float16.
    83: dict(num_layers=8, kv_heads=2, head_dim=8, kv_dtype=F16, page_tokens=1, tokens=300),
}


def _geometry(index: int) -> dict:
    """Geometry of roundtrip artifact `index`: explicit for large cases, else random."""
    if index in LARGE_CASES:
        return LARGE_CASES[index]
    rng = random.Random(f"geometry-{index}")
    page_tokens = rng.choice((1, 3, 4, 7, 16, 64, 128))
    return dict(
        num_layers=rng.randint(1, 8),
        kv_heads=rng.randint(1, 8),
        head_dim=rng.choice((1, 3, 8, 16, 32, 64, 128)),
        kv_dtype=rng.choice((F32, F16, BF16)),
        page_tokens=page_tokens,
        tokens=rng.randint(1, 6 * page_tokens),
    )


def _sha(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def _file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def daemon_pair(tmp_path_factory) -> Iterator[tuple[Client, Client]]:
    """A source daemon and a second one with an empty store, shared by the module."""
    source = DaemonProcess.start(tmp_path_factory.mktemp("source"))
    replica = DaemonProcess.start(tmp_path_factory.mktemp("replica"))
    try:
        with Client(source.address) as a, Client(replica.address) as b:
            yield a, b
    finally:
        source.stop()
        replica.stop()


def _check_bundle_pages(path: Path, artifact: Artifact) -> None:
    """The `safetensors` library reads the bundle, and its tensors are the pages."""
    manifest, layout = artifact.manifest, artifact.manifest.layout
    tensors = load_file(str(path))
    assert set(tensors) == {"kv." + digest.hex() for digest in page_sizes(manifest)}
    for position, digest in enumerate(manifest.page_sha256):
        tensor = tensors["kv." + digest.hex()]
        tokens = page_token_count(manifest, position // layout.num_layers)
        assert tensor.dtype == TORCH_DTYPES[layout.kv_dtype]
        assert tuple(tensor.shape) == (2, layout.kv_heads, tokens, layout.head_dim)
        raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        assert raw == bytes(artifact.pages[digest])
    with safe_open(str(path), framework="pt") as bundle:
        metadata = bundle.metadata()
    assert metadata["format"] == BUNDLE_FORMAT
    assert metadata["artifact_id"] == artifact.id
    assert base64.b64decode(metadata["manifest"]) == canonical_bytes(manifest)


@pytest.mark.parametrize("index", range(100))
def test_roundtrip(index: int, daemon_pair, tmp_path: Path) -> None:
    source, replica = daemon_pair
    geometry = _geometry(index)
    artifact = random_artifact(random.Random(f"artifact-{index}"), **geometry)
    sizes = page_sizes(artifact.manifest)

    put = source.put_artifact(artifact)
    assert put.artifact_id == artifact.id
    assert not put.already_present
    assert put.pages_written == len(sizes)
    assert put.bytes_written == sum(sizes.values())

    fetched = source.get_artifact(artifact.id)
    assert canonical_bytes(fetched.manifest) == canonical_bytes(artifact.manifest)
    layers = artifact.manifest.layout.num_layers
    for position, digest in enumerate(artifact.manifest.page_sha256):
        page, layer = divmod(position, layers)
        got = fetched.page(page, layer)
        assert _sha(got) == digest == _sha(artifact.page(page, layer))
        assert bytes(got) == bytes(artifact.page(page, layer))
    assert set(fetched.pages) == set(sizes)

    first = tmp_path / "first.safetensors"
    second = tmp_path / "second.safetensors"
    assert source.export_bundle(artifact.id, first) == artifact.id
    imported = replica.import_bundle(first)
    assert imported.artifact_id == artifact.id
    assert imported.pages_written == len(sizes)
    assert imported.bytes_written == sum(sizes.values())
    assert replica.export_bundle(artifact.id[:12], second) == artifact.id
    assert _file_sha(first) == _file_sha(second)
    _check_bundle_pages(second, artifact)


def test_large_cases_cross_message_boundaries() -> None:
    """The explicit large cases really exercise multi-message artifacts and pages."""
    payload = wire.BLOCK_PAYLOAD_BYTES
    largest_pages, totals = [], []
    for index in LARGE_CASES:
        artifact = random_artifact(random.Random(f"artifact-{index}"), **LARGE_CASES[index])
        sizes = page_sizes(artifact.manifest)
        largest_pages.append(max(sizes.values()))
        totals.append(sum(sizes.values()))
    assert max(totals) > wire.MAX_MESSAGE_BYTES
    assert sum(_message_cost(size) > payload for size in largest_pages) == 3
    assert any(payload - 1024 < _message_cost(size) <= payload for size in largest_pages)


# ----------------------------------------------------------------------
# dedup


def test_shared_pages_are_stored_once(client: Client, rng: random.Random) -> None:
    geometry = dict(num_layers=2, kv_heads=2, head_dim=16, kv_dtype=F32, page_tokens=16, tokens=64)
    page_bytes = 2 * 2 * 16 * 16 * 4
    first = random_artifact(rng, **geometry)
    repeated = first.page(0, 0)
    # The second artifact shares three of the first's pages and repeats one
    # page at two positions of its own.
    own = rng.randbytes(page_bytes)
    shared = {(0, 0): repeated, (0, 1): first.page(0, 1), (1, 0): first.page(1, 0)}
    second = random_artifact(rng, **geometry, shared_pages={**shared, (2, 0): own, (3, 1): own})
    first_pages, second_pages = set(page_sizes(first.manifest)), set(page_sizes(second.manifest))
    assert len(first_pages) == 8 and len(second_pages) == 7
    assert len(first_pages & second_pages) == 3

    client.put_artifact(first)
    stats = client.stats()
    assert (stats.artifacts, stats.pages, stats.page_bytes) == (1, 8, 8 * page_bytes)

    missing = client.missing_pages(second.manifest.page_sha256)
    assert set(missing) == second_pages - first_pages
    assert len(missing) == 5  # a repeated hash is reported at each position it is asked
    put = client.put_artifact(second)
    assert (put.pages_written, put.bytes_written) == (4, 4 * page_bytes)
    stats = client.stats()
    assert (stats.artifacts, stats.pages, stats.page_bytes) == (2, 12, 12 * page_bytes)
    assert stats.staged_pages == 0
    info = client.stat(second.id).info
    assert (info.num_pages, info.page_bytes) == (8, 8 * page_bytes)

    again = client.put_artifact(second)
    assert again.already_present and again.pages_written == 0
    assert client.stats().pages == 12

    deleted = client.delete(first.id)
    assert (deleted.pages_freed, deleted.bytes_freed) == (5, 5 * page_bytes)
    stats = client.stats()
    assert (stats.artifacts, stats.pages, stats.page_bytes) == (1, 7, 7 * page_bytes)
    fetched = client.get_artifact(second.id)  # verifies every page's SHA-256
    assert {d: bytes(v) for d, v in fetched.pages.items()} == {
        d: bytes(v) for d, v in second.pages.items()
    }
    assert set(client.missing_pages(list(first_pages))) == first_pages - second_pages

    deleted = client.delete(second.id)
    assert (deleted.pages_freed, deleted.bytes_freed) == (7, 7 * page_bytes)
    stats = client.stats()
    assert (stats.artifacts, stats.pages, stats.page_bytes, stats.staged_pages) == (0, 0, 0, 0)
    everything = sorted(first_pages | second_pages)
    assert client.missing_pages(everything) == everything


# ----------------------------------------------------------------------
# corruption


def _raw_get(address: str, artifact_id: str) -> tuple[list[bytes], grpc.RpcError | None]:
    """Digests of every page chunk a GetArtifact stream delivers, and how it ended."""
    delivered: list[bytes] = []
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(
            "/kvgraft.v1.Kvgraft/GetArtifact",
            request_serializer=pb.GetArtifactRequest.SerializeToString,
            response_deserializer=None,
        )
        try:
            for raw in call(pb.GetArtifactRequest(artifact_id=artifact_id), timeout=60):
                chunks, manifest = wire.decode_envelope(raw, wire.GET_PAGES, wire.GET_MANIFEST)
                assert manifest is None or not delivered
                delivered += [chunk.sha256 for chunk in chunks]
        except grpc.RpcError as exc:
            return delivered, exc
    return delivered, None


CORRUPTION_CASES = {
    # three 2 MiB pages, one per message: the second is corrupted
    "whole-page messages": (
        dict(num_layers=1, kv_heads=4, head_dim=64, kv_dtype=F32, page_tokens=1024, tokens=3072),
        1,
    ),
    # 16 small pages sharing one message: the tenth is corrupted
    "batched pages": (
        dict(num_layers=4, kv_heads=2, head_dim=32, kv_dtype=F16, page_tokens=16, tokens=64),
        9,
    ),
    # 8 MiB pages sent in three chunks each: the second is corrupted
    "multi-chunk pages": (
        dict(num_layers=2, kv_heads=8, head_dim=128, kv_dtype=F32, page_tokens=1024, tokens=1024),
        1,
    ),
}


@pytest.mark.parametrize("case", CORRUPTION_CASES)
def test_flipped_byte_on_disk_is_data_loss(case: str, start_daemon, rng: random.Random) -> None:
    geometry, victim_position = CORRUPTION_CASES[case]
    daemon = start_daemon(extra_args=["--map-initial-bytes", "8MiB"])
    victim = random_artifact(rng, **geometry)
    bystander = random_artifact(rng, num_layers=2, kv_heads=2, head_dim=64, page_tokens=64)
    victim_digest = victim.manifest.page_sha256[victim_position]
    with Client(daemon.address) as client:
        client.put_artifact(victim)
        client.put_artifact(bystander)
        before = client.stats()
        assert flip_stored_page(daemon.data_dir / "store", victim.pages[victim_digest])

        delivered, error = _raw_get(daemon.address, victim.id)
        assert error is not None and error.code() == grpc.StatusCode.DATA_LOSS
        assert "corrupt" in error.details() and victim_digest.hex()[:16] in error.details()
        assert victim_digest not in delivered
        # Pages before the corrupt one (in earlier messages) were whole and verified.
        order = list(page_sizes(victim.manifest))
        assert set(delivered) <= set(order[: order.index(victim_digest)])
        # The read quarantined the artifact and dropped the page: refused from now on.
        with pytest.raises(DataLoss, match="quarantined"):
            client.get_artifact(victim.id)

        # The rest of the store is untouched and still served.
        fetched = client.get_artifact(bystander.id)
        assert {d: bytes(v) for d, v in fetched.pages.items()} == {
            d: bytes(v) for d, v in bystander.pages.items()
        }
        assert client.stat(victim.id).info.artifact_id == victim.id
        after = client.stats()
        assert (after.artifacts, after.pages, after.page_bytes) == (
            before.artifacts,
            before.pages - 1,
            before.page_bytes - len(victim.pages[victim_digest]),
        )
        assert after.rpc_calls["GetArtifact:DATA_LOSS"] == 2


def test_flipped_byte_in_bundle_fails_import(start_daemon, rng, tmp_path: Path) -> None:
    source, target = start_daemon(), start_daemon()
    artifact = random_artifact(rng, num_layers=3, kv_heads=2, head_dim=32, page_tokens=16)
    path = tmp_path / "bundle.safetensors"
    with Client(source.address) as a, Client(target.address) as b:
        a.put_artifact(artifact)
        a.export_bundle(artifact.id, path)
        header_bytes = int.from_bytes(path.read_bytes()[:8], "little")
        body_start = 8 + header_bytes
        last = artifact.manifest.page_sha256[-1]
        with open(path, "r+b") as f:
            f.seek(path.stat().st_size - 3)  # inside the last page written
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x80]))
        assert path.stat().st_size - 3 > body_start

        with pytest.raises(DataLoss, match="corrupt"):
            b.import_bundle(path)
        stats = b.stats()
        assert (stats.artifacts, stats.pages, stats.page_bytes, stats.staged_pages) == (0, 0, 0, 0)
        assert "PutArtifact:OK" not in stats.rpc_calls
        assert b.missing_pages([last]) == [last]
