"""kvgraft.wire: the hand encoding is byte-identical to protobuf's, and its parser is safe."""

from __future__ import annotations

import os
import random

import pytest

from kvgraft import wire
from kvgraft.errors import InvalidArgument
from kvgraft.v1 import kvgraft_pb2 as pb


def _chunks(rng: random.Random, count: int) -> list[wire.Chunk]:
    out = []
    for _ in range(count):
        size = rng.randint(1, 5000)
        offset = rng.choice((0, 0, rng.randint(1, 10**9)))
        xxh3 = rng.choice((b"", rng.randbytes(16)))
        out.append(wire.Chunk(rng.randbytes(32), offset, size + offset, rng.randbytes(size), xxh3))
    return out


def _as_pb(chunk: wire.Chunk) -> pb.PageChunk:
    return pb.PageChunk(
        sha256=chunk.sha256,
        offset=chunk.offset,
        page_bytes=chunk.page_bytes,
        xxh3=chunk.xxh3,
        data=bytes(chunk.data),
    )


@pytest.mark.parametrize("count", [0, 1, 7])
def test_page_block_encoding_is_protobufs(count: int) -> None:
    chunks = _chunks(random.Random(count), count)
    block = pb.PageBlock(chunks=[_as_pb(c) for c in chunks])
    put = pb.PutArtifactRequest(pages=block).SerializeToString()
    get = pb.GetArtifactResponse(pages=block).SerializeToString()
    assert wire.encode_page_block(wire.PUT_PAGES, chunks) == put
    assert wire.encode_page_block(wire.GET_PAGES, chunks) == get


def test_submessage_encoding_is_protobufs() -> None:
    manifest = pb.Manifest(format_version=1, token_ids=[1, 2, 3], model_fingerprint=os.urandom(32))
    raw = manifest.SerializeToString(deterministic=True)
    assert wire.encode_submessage(wire.PUT_MANIFEST, raw) == pb.PutArtifactRequest(
        manifest=manifest
    ).SerializeToString(deterministic=True)
    assert wire.encode_submessage(wire.GET_MANIFEST, raw) == pb.GetArtifactResponse(
        manifest=manifest
    ).SerializeToString(deterministic=True)


def test_put_parts_round_trip_as_protobuf_reads_them() -> None:
    """encode_put is PutArtifactRequest's encoding; decode_put reads it (and protobuf's) back."""
    chunks = _chunks(random.Random(2), 5)
    manifest = pb.Manifest(format_version=1, token_ids=[4, 5]).SerializeToString()
    expected_id = os.urandom(32).hex()
    pages = wire.PutPart(chunks)
    last = wire.PutPart([], manifest, expected_id)
    assert (
        wire.encode_put(pages)
        == pb.PutArtifactRequest(
            pages=pb.PageBlock(chunks=[_as_pb(c) for c in chunks])
        ).SerializeToString()
    )
    request = pb.PutArtifactRequest.FromString(wire.encode_put(last))
    assert request.manifest.SerializeToString() == manifest
    assert request.expected_artifact_id == expected_id
    decoded = wire.decode_put(wire.encode_put(pages))
    assert decoded.manifest is None and decoded.expected_artifact_id == ""
    assert [(c.sha256, c.offset, c.page_bytes, bytes(c.data), c.xxh3) for c in decoded.chunks] == [
        (c.sha256, c.offset, c.page_bytes, c.data, c.xxh3) for c in chunks
    ]
    # protobuf's own encoding puts expected_artifact_id after the manifest; any order is read
    reordered = wire.encode_submessage(wire.PUT_EXPECTED_ID, expected_id.encode()) + (
        wire.encode_submessage(wire.PUT_MANIFEST, manifest)
    )
    for raw in (request.SerializeToString(), reordered):
        assert wire.decode_put(raw) == wire.PutPart([], manifest, expected_id)
    assert wire.decode_put(wire.encode_put(wire.PutPart([], manifest))).expected_artifact_id == ""


@pytest.mark.parametrize("bad", ["ab" * 31, "AB" * 32, "zz" * 32, "\u00e9" * 32])
def test_decode_put_refuses_a_malformed_expected_id(bad: str) -> None:
    raw = wire.encode_submessage(wire.PUT_MANIFEST, b"") + wire.encode_submessage(
        wire.PUT_EXPECTED_ID, bad.encode()
    )
    with pytest.raises(InvalidArgument, match="64 lowercase hex"):
        wire.decode_put(raw)


def test_decode_reads_protobuf_encodings() -> None:
    chunks = _chunks(random.Random(1), 40)  # whole pages with an xxh3 take the fast path
    raw = pb.PutArtifactRequest(
        pages=pb.PageBlock(chunks=[_as_pb(c) for c in chunks])
    ).SerializeToString()
    decoded, other = wire.decode_envelope(raw, wire.PUT_PAGES, wire.PUT_MANIFEST)
    assert other is None
    assert [(c.sha256, c.offset, c.page_bytes, c.xxh3, bytes(c.data)) for c in decoded] == [
        (c.sha256, c.offset, c.page_bytes, c.xxh3, bytes(c.data)) for c in chunks
    ]


@pytest.mark.parametrize(
    "extra",
    [
        b"\x78\x01",  # an unknown varint field after the data
        b"\x0a\x20" + b"\x07" * 32,  # sha256 again: the last one wins
        b"\x18\x05",  # page_bytes again
        b"\x2a\x02zz",  # data again
    ],
)
def test_a_whole_page_encoded_otherwise_decodes_as_protobuf_does(extra: bytes) -> None:
    chunk = pb.PageChunk(sha256=b"\x01" * 32, page_bytes=4, xxh3=b"\x02" * 16, data=b"abcd")
    raw = chunk.SerializeToString() + extra
    parsed = pb.PageChunk.FromString(raw)
    message = wire.envelope_prefix(wire.GET_PAGES, len(raw) + 2) + b"\x0a" + bytes([len(raw)]) + raw
    (decoded,), _ = wire.decode_envelope(message, wire.GET_PAGES, wire.GET_MANIFEST)
    got = (decoded.sha256, decoded.offset, decoded.page_bytes, decoded.xxh3, bytes(decoded.data))
    assert got == (parsed.sha256, parsed.offset, parsed.page_bytes, parsed.xxh3, parsed.data)


def test_decode_skips_unknown_fields_and_accepts_any_order() -> None:
    xxh3 = b"\x02" * 16
    chunk = pb.PageChunk(sha256=b"\x01" * 32, offset=5, page_bytes=9, xxh3=xxh3, data=b"abcd")
    # fields 5, 4, 3, 2, 1, then an unknown varint field 15 and an unknown fixed64 field 14
    raw = (
        b"\x2a\x04abcd"
        + b"\x22\x10"
        + xxh3
        + b"\x18\x09"
        + b"\x10\x05"
        + b"\x0a\x20"
        + b"\x01" * 32
        + b"\x78\x01"
        + b"\x71"
        + b"\x00" * 8
    )
    parsed = pb.PageChunk.FromString(raw)
    parsed.DiscardUnknownFields()
    assert parsed == chunk
    message = wire.envelope_prefix(wire.GET_PAGES, len(raw) + 2) + b"\x0a" + bytes([len(raw)]) + raw
    decoded, _ = wire.decode_envelope(message, wire.GET_PAGES, wire.GET_MANIFEST)
    assert [(c.sha256, c.offset, c.page_bytes, c.xxh3, bytes(c.data)) for c in decoded] == [
        (b"\x01" * 32, 5, 9, xxh3, b"abcd")
    ]


def test_decode_refuses_both_or_neither() -> None:
    both = wire.encode_page_block(wire.PUT_PAGES, []) + wire.encode_submessage(
        wire.PUT_MANIFEST, b""
    )
    with pytest.raises(InvalidArgument):
        wire.decode_envelope(both, wire.PUT_PAGES, wire.PUT_MANIFEST)
    with pytest.raises(InvalidArgument):
        wire.decode_envelope(b"", wire.PUT_PAGES, wire.PUT_MANIFEST)


def test_garbage_raises_invalid_argument_only() -> None:
    rng = random.Random(7)
    valid = wire.encode_page_block(wire.PUT_PAGES, _chunks(rng, 3))
    for trial in range(3000):
        if trial % 2:
            raw = rng.randbytes(rng.randint(0, 200))
        else:  # a valid message with a few bytes changed or cut short
            mutated = bytearray(valid[: rng.randint(0, len(valid))])
            for _ in range(rng.randint(1, 3)):
                if mutated:
                    mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            raw = bytes(mutated)
        try:
            chunks, _ = wire.decode_envelope(raw, wire.PUT_PAGES, wire.PUT_MANIFEST)
        except InvalidArgument as exc:
            assert str(exc)
            continue
        for chunk in chunks:  # whatever parsed must be in bounds
            assert len(chunk.data) <= len(raw)


def test_split_pages_fits_messages_and_reassembles() -> None:
    rng = random.Random(3)
    payload = 10_000
    pages = [
        (rng.randbytes(32), rng.randbytes(rng.choice((10, 3000, 9000, 25_000)))) for _ in range(40)
    ]
    seen: dict[bytes, bytearray] = {}
    for batch in wire.split_pages(pages, payload_bytes=payload):
        message = wire.encode_page_block(wire.PUT_PAGES, batch)
        assert len(message) <= payload + 16
        for chunk in wire.decode_envelope(message, wire.PUT_PAGES, wire.PUT_MANIFEST)[0]:
            buffer = seen.setdefault(chunk.sha256, bytearray())
            assert chunk.offset == len(buffer)
            buffer += chunk.data
            assert chunk.page_bytes == len(dict(pages)[chunk.sha256])
    assert {d: bytes(b) for d, b in seen.items()} == dict(pages)
