"""kvgraft.artifact: geometry, identity and the validation every component relies on."""

from __future__ import annotations

import hashlib
import random

import pytest

from kvgraft.artifact import (
    Artifact,
    artifact_id,
    canonical_bytes,
    page_sizes,
    parse_manifest,
    validate_manifest,
)
from kvgraft.errors import DataLoss, InvalidArgument
from kvgraft.v1 import kvgraft_pb2 as pb
from tests.support.factory import random_artifact


def test_id_is_sha256_of_canonical_manifest(rng: random.Random) -> None:
    artifact = random_artifact(rng, labels={"b": "2", "a": "1"})
    canonical = canonical_bytes(artifact.manifest)
    assert artifact.id == hashlib.sha256(canonical).hexdigest()
    # map order does not change the canonical bytes
    reordered = pb.Manifest()
    reordered.CopyFrom(artifact.manifest)
    reordered.labels.clear()
    reordered.labels["a"] = "1"
    reordered.labels["b"] = "2"
    assert artifact_id(reordered) == artifact.id


def test_page_sizes_cover_tail_page() -> None:
    layout = pb.KvLayout(num_layers=2, kv_heads=3, head_dim=8, kv_dtype=pb.KV_DTYPE_BFLOAT16)
    pages = [bytes([i]) * (2 * 3 * n * 8 * 2) for n in (4, 4) for i in range(2)]
    pages += [bytes([9 + i]) * (2 * 3 * 1 * 8 * 2) for i in range(2)]
    artifact = Artifact.build(
        model_fingerprint=b"\0" * 32,
        layout=layout,
        profile=pb.ComputeProfile(page_tokens=4),
        token_ids=list(range(9)),
        page_bytes=pages,
    )
    sizes = page_sizes(artifact.manifest)
    # pages 0 and 1 of each layer are equal, so 2 distinct full pages + 2 tail pages
    assert sorted(sizes.values()) == [96, 96, 384, 384]
    assert bytes(artifact.page(2, 1)) == bytes([10]) * 96


def _manifest(**changes) -> pb.Manifest:
    artifact = random_artifact(random.Random(0), num_layers=2, tokens=10, page_tokens=4)
    manifest = pb.Manifest()
    manifest.CopyFrom(artifact.manifest)
    for name, value in changes.items():
        if name == "layout":
            manifest.layout.CopyFrom(value)
        elif isinstance(value, list):
            manifest.ClearField(name)
            getattr(manifest, name).extend(value)
        else:
            setattr(manifest, name, value)
    return manifest


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"format_version": 2}, "format_version"),
        ({"model_fingerprint": b"\1" * 31}, "fingerprint"),
        ({"layout": pb.KvLayout(num_layers=2, kv_heads=0, head_dim=8, kv_dtype=1)}, "kv_heads"),
        ({"layout": pb.KvLayout(num_layers=2, kv_heads=1, head_dim=8, kv_dtype=9)}, "kv_dtype"),
        ({"token_ids": []}, "no token_ids"),
        ({"segment_ends": []}, "segment_ends"),
        ({"segment_ends": [5, 5, 10]}, "increasing"),
        ({"segment_ends": [4, 9]}, "end at 9"),
        ({"page_sha256": [b"\0" * 32] * 5}, "names 5 pages"),
        ({"page_sha256": [b"\0" * 31] * 6}, "32 bytes"),
        ({"page_sha256": [b"\0" * 32] * 6}, "two sizes"),
    ],
)
def test_invalid_manifests_are_refused(changes: dict, needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        validate_manifest(_manifest(**changes))


def test_labels_are_bounded() -> None:
    manifest = _manifest()
    manifest.labels[""] = "x"
    with pytest.raises(InvalidArgument, match="label keys"):
        validate_manifest(manifest)


def test_parse_refuses_unknown_fields_and_garbage() -> None:
    raw = canonical_bytes(_manifest())
    assert parse_manifest(raw) == _manifest()
    with pytest.raises(InvalidArgument, match="does not know"):
        parse_manifest(raw + b"\xf8\x01\x01")  # field 31, varint
    with pytest.raises(InvalidArgument, match="do not parse"):
        parse_manifest(b"\x0a\xff\xff")


def test_verify_detects_a_changed_page(rng: random.Random) -> None:
    artifact = random_artifact(rng)
    artifact.verify()
    digest = artifact.manifest.page_sha256[0]
    flipped = bytearray(artifact.pages[digest])
    flipped[0] ^= 1
    artifact.pages[digest] = bytes(flipped)
    with pytest.raises(DataLoss):
        artifact.verify()
    del artifact.pages[digest]
    with pytest.raises(DataLoss, match="missing"):
        artifact.verify()


def test_build_refuses_wrong_page_size() -> None:
    layout = pb.KvLayout(num_layers=1, kv_heads=1, head_dim=4, kv_dtype=pb.KV_DTYPE_FLOAT32)
    with pytest.raises(InvalidArgument, match="layout needs 32"):
        Artifact.build(
            model_fingerprint=b"\0" * 32,
            layout=layout,
            profile=pb.ComputeProfile(page_tokens=1),
            token_ids=[1],
            page_bytes=[b"\0" * 31],
        )
