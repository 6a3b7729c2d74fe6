"""Every RPC of a real daemon, fed malformed and extreme requests by Hypothesis.

One daemon (the tiny model, so the engine RPCs compute for real, with a small
max_context_tokens so that no request computes for long) holds a few artifacts
put before the fuzzing starts. Each RPC then gets requests built from its own
message descriptor: every field absent or set to an extreme (huge and negative
integers, NaN and infinities, long and odd text, random bytes, unknown enum
values, real artifact ids and prefixes of them), nested messages and repeated
fields included; undecodable bytes; and, for PutArtifact, streams of random
and half-valid messages. After each request:

* the status is never INTERNAL or UNKNOWN, and no message holds a traceback;
* Info answers within 5 s;

and at the end every artifact acknowledged before the run is served whole, byte for
byte (the fuzzed Delete aims at a spare one only), the deposited one still verifies,
and the daemon's log holds no traceback.

Bounded: a fixed number of examples per RPC, derandomized (CI sees the same
cases each run), a deadline on every call; the whole module runs in about a
minute here.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import given
from hypothesis import strategies as st

from kvgraft import Client, wire
from kvgraft.v1 import kvgraft_pb2 as pb
from tests.support.factory import random_artifact
from tests.support.fuzz_settings import fuzz_settings
from tests.support.store_audit import assert_served_whole

SERVICE = pb.DESCRIPTOR.services_by_name["Kvgraft"]
BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
CALL_TIMEOUT_S = 10.0
EXAMPLES = 60
FUZZ = fuzz_settings(EXAMPLES)
# Artifacts put before the run, so fuzzed ids point at real ones too: KEPT must be served
# whole at the end; Delete is aimed at SPARE only (deleting is what it is for).
KEPT_IDS: list[str] = []
SPARE_IDS: list[str] = []

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    edges = [
        v for v in (low, high, 0, 1, 2, 3, 15, 16, 17, 64, 65, 4096, 2**31) if low <= v <= high
    ]
    return st.one_of(st.sampled_from(edges), st.integers(low, high), st.integers(0, 300))


def _texts(known: list[str]) -> st.SearchStrategy[str]:
    ids = st.sampled_from(known) if known else st.just("0" * 64)
    return st.one_of(
        st.text(max_size=40),
        st.text(alphabet="0123456789abcdef", min_size=1, max_size=64),
        ids,
        ids.map(lambda aid: aid[:10]),
        st.sampled_from(["", " ", "*", "127.0.0.1:1", "host:99999", "\x00", "é" * 3000, "a=b"]),
    )


def _scalar(field: FieldDescriptor, known: list[str]) -> st.SearchStrategy:
    kind = field.type
    if kind in _INT_RANGES:
        return _integers(*_INT_RANGES[kind])
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        width = 32 if kind == FieldDescriptor.TYPE_FLOAT else 64
        return st.one_of(
            st.floats(width=width, allow_nan=True, allow_infinity=True),
            st.sampled_from([0.0, 1e-38, 1e-30, 1e38, -1.0]),
        )
    if kind == FieldDescriptor.TYPE_STRING:
        return _texts(known)
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.binary(min_size=32, max_size=32))
    if kind == FieldDescriptor.TYPE_ENUM:
        return st.integers(0, len(field.enum_type.values) + 2)
    raise AssertionError(f"no strategy for {field.full_name}")


# Fields whose plausible values reach deep code (a prompt the tiny model accepts, a short
# generation, a temperature at the edges) half of the time; anything the other half.
PLAUSIBLE = {
    "ids": st.lists(st.integers(0, 600), min_size=1, max_size=40),
    "token_ids": st.lists(st.integers(0, 600), min_size=1, max_size=40),
    "max_new_tokens": st.integers(0, 8),
    "temperature": st.sampled_from([1e-38, 1e-30, 1e-5, 0.5, 1e30, float("inf"), float("nan")]),
}


@st.composite
def requests(draw, descriptor: Descriptor, known: list[str], depth: int = 0):
    """A message of `descriptor` with any of its fields set to anything (ids: `known`)."""
    message = message_factory.GetMessageClass(descriptor)()
    for field in descriptor.fields:
        if not draw(st.booleans()):
            continue
        if field.name in PLAUSIBLE and draw(st.booleans()):
            value = draw(PLAUSIBLE[field.name])
            if field.is_repeated:
                getattr(message, field.name).extend(value)
            else:
                setattr(message, field.name, value)
            continue
        is_map = field.message_type is not None and field.message_type.GetOptions().map_entry
        if is_map:
            entries = draw(st.dictionaries(_texts(known), _texts(known), max_size=4))
            for key, value in entries.items():
                getattr(message, field.name)[key] = value
        elif field.message_type is not None:
            if depth >= 3:
                continue
            count = draw(st.integers(0, 3)) if field.is_repeated else 1
            for _ in range(count):
                value = draw(requests(field.message_type, known, depth + 1))
                target = getattr(message, field.name)
                (target.add() if field.is_repeated else target).CopyFrom(value)
        elif field.is_repeated:
            values = draw(st.lists(_scalar(field, known), max_size=6))
            getattr(message, field.name).extend(values)
        else:
            setattr(message, field.name, draw(_scalar(field, known)))
    return message


# ----------------------------------------------------------------------
# the daemon


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    from kvgraftd.testing.daemon_process import DaemonProcess, wait_model_ready

    daemon = DaemonProcess.start(
        tmp_path_factory.mktemp("fuzz") / "data",
        [
            *("--model", "tiny:0", "--page-tokens", "16", "--block-tokens", "64"),
            *("--max-context-tokens", "256", "--max-call-s", "20"),
        ],
    )
    wait_model_ready(daemon.address)
    rng = random.Random(7)
    artifacts = [random_artifact(rng) for _ in range(3)]
    spare = random_artifact(rng)
    with Client(daemon.address, timeout_s=30, transfer_timeout_s=60) as client:
        for artifact in [*artifacts, spare]:
            client.put_artifact(artifact)
        deposited = client.deposit(token_ids=list(range(3, 40))).artifact_id
    KEPT_IDS[:] = [a.id for a in artifacts] + [deposited]
    SPARE_IDS[:] = [spare.id]
    channel = grpc.insecure_channel(daemon.address)
    yield daemon, channel, artifacts
    channel.close()
    with Client(daemon.address, timeout_s=30, transfer_timeout_s=60) as client:
        for artifact in artifacts:  # every acknowledged artifact intact
            assert_served_whole(client.get_artifact(artifact.id), artifact)
        assert client.verify(deposited).ok
    daemon.stop()
    assert "Traceback" not in daemon.log(), daemon.log()


def _call(channel: grpc.Channel, method: str, payload, streaming_out: bool) -> None:
    """Send one request (a message or raw bytes); fail on INTERNAL, UNKNOWN or a traceback."""
    path = f"/{SERVICE.full_name}/{method}"
    raw = payload if isinstance(payload, bytes) else payload.SerializeToString()
    try:
        if streaming_out:
            call = channel.unary_stream(path, request_serializer=None)
            for _ in zip(range(50), call(raw, timeout=CALL_TIMEOUT_S), strict=False):
                pass
        else:
            channel.unary_unary(path, request_serializer=None)(raw, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as exc:
        details = exc.details() or ""
        assert exc.code() not in BAD_CODES, f"{method}: {exc.code()}: {details}"
        assert "Traceback" not in details, details
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            assert len(details) > 10, f"{method}: {exc.code()} says nothing: {details!r}"


def _still_answers(channel: grpc.Channel) -> None:
    info = channel.unary_unary(
        f"/{SERVICE.full_name}/Info",
        request_serializer=pb.InfoRequest.SerializeToString,
        response_deserializer=pb.InfoResponse.FromString,
    )
    assert info(pb.InfoRequest(), timeout=5).version


UNARY_IN = [m for m in SERVICE.methods if not m.client_streaming]


@pytest.mark.parametrize("method", UNARY_IN, ids=lambda m: m.name)
def test_fuzzed_requests_get_a_clear_answer(fuzzed, method) -> None:
    _, channel, _ = fuzzed

    # Delete deletes, and a pin with a TTL deletes when it expires: aimed at SPARE only.
    known = SPARE_IDS if method.name in ("Delete", "Pin") else KEPT_IDS

    @FUZZ
    @given(payload=st.one_of(requests(method.input_type, known), st.binary(max_size=64)))
    def run(payload) -> None:
        if method.name == "Watch" and isinstance(payload, pb.WatchRequest):
            payload.follow = False  # a follow stream waits for changes: bounded elsewhere
        _call(channel, method.name, payload, method.server_streaming)
        _still_answers(channel)

    run()


@st.composite
def put_streams(draw) -> list[bytes]:
    """A PutArtifact stream: random bytes, page blocks of random chunks, manifests."""
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["bytes", "pages", "manifest", "request"]))
        if kind == "bytes":
            parts.append(draw(st.binary(max_size=200)))
        elif kind == "pages":
            data = draw(st.binary(min_size=1, max_size=64))
            digest = draw(st.sampled_from([hashlib.sha256(data).digest(), bytes(32), b"x"]))
            size = draw(st.sampled_from([len(data), len(data) + 1, 0, 2**40]))
            offset = draw(st.sampled_from([0, 1, 2**62]))
            chunk = wire.Chunk(digest, offset, size, data)
            parts.append(wire.encode_page_block(wire.PUT_PAGES, [chunk]))
        elif kind == "manifest":
            manifest = draw(requests(pb.Manifest.DESCRIPTOR, KEPT_IDS))
            parts.append(wire.encode_put_manifest(manifest.SerializeToString()))
        else:
            request = draw(requests(pb.PutArtifactRequest.DESCRIPTOR, KEPT_IDS))
            parts.append(request.SerializeToString())
    return parts


def test_fuzzed_uploads_get_a_clear_answer(fuzzed) -> None:
    _, channel, _ = fuzzed
    put = channel.stream_unary(f"/{SERVICE.full_name}/PutArtifact", request_serializer=None)

    @FUZZ
    @given(stream=put_streams())
    def run(stream: list[bytes]) -> None:
        def messages() -> Iterator[bytes]:
            yield from stream

        try:
            put(messages(), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as exc:
            assert exc.code() not in BAD_CODES, f"PutArtifact: {exc.code()}: {exc.details()}"
            assert "Traceback" not in (exc.details() or "")
        _still_answers(channel)

    run()


def test_every_rpc_is_fuzzed() -> None:
    fuzzed_methods = {m.name for m in UNARY_IN} | {"PutArtifact"}
    assert fuzzed_methods == {m.name for m in SERVICE.methods}
