"""A property over every RPC: no response names, counts or returns another tenant's data.

One daemon (the tiny model, as tests/server/test_fuzz.py runs it) with tenants alice and
bob. Alice stores private things first: a deposit, a random artifact put whole, and one
deposit she publishes. Hypothesis then sends bob's requests to
every RPC (built from each RPC's message descriptor by test_fuzz's `requests`, with
alice's ids and prefixes among the strings it draws and her private prompt among the
token ids; the tiny model has no tokenizer, so the library's own isolation is
tests/server/test_tenants_engine.py's), and for each:

* an answer that is OK holds none of alice's private ids (hex or bytes), no prefix of
  16 of their characters, and none of her page digests, except MissingPages, whose
  answer must list every one of her pages asked about as missing;
* a request naming one of alice's private ids (or a prefix) is answered exactly as the
  same request naming an id nobody stored, in the same characters' places: the same
  status code and, the ids swapped back, the same message (no existence oracle);
* Lookup of alice's private prompt matches nothing and names no artifact; the RPCs
  that act on the whole store answer PERMISSION_DENIED.

At the end alice's artifacts are all there and served whole, and bob's Stats counts
his own artifacts only.
"""

from __future__ import annotations

import random
from typing import ClassVar

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgraft import Client, wire
from kvgraft.tenancy import TENANT_LABEL, owner_of
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.testing.daemon_process import DaemonProcess
from tests.server.test_fuzz import SERVICE, requests
from tests.support.factory import random_artifact
from tests.support.store_audit import assert_served_whole
from tests.support.tenant_config import wait_until_ready, write_tenants

CALL_TIMEOUT_S = 20.0
PROPERTY = settings(
    max_examples=12,  # per RPC
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
OPERATORS = {"Watch", "Replicate", "Scrub", "RemoteStatus", "RemoteSync"}
PRIVATE_PROMPT = list(range(5, 45))  # alice's deposit: 40 tokens, 2 pages of 16


class Secrets:
    """What alice holds privately: ids, page digests, the prompt; and the put artifact."""

    ids: ClassVar[list[str]] = []
    digests: ClassVar[list[bytes]] = []
    artifact: ClassVar[object] = None


@pytest.fixture(scope="module")
def isolated(tmp_path_factory):
    root = tmp_path_factory.mktemp("isolation")
    config, tokens = write_tenants(root / "etc", {"alice": {}, "bob": {}})
    daemon = DaemonProcess.start(
        root / "data",
        [
            "--config", str(config),
            *("--model", "tiny:0", "--page-tokens", "16", "--block-tokens", "64"),
            *("--max-context-tokens", "256", "--max-call-s", "20"),
        ],
    )  # fmt: skip
    alice = Client(daemon.address, token_file=tokens["alice"], transfer_timeout_s=60)
    wait_until_ready(alice)
    artifact = random_artifact(random.Random(12), labels={TENANT_LABEL: "alice"})
    alice.put_artifact(artifact)
    deposited = alice.deposit(token_ids=PRIVATE_PROMPT).artifact_id
    public = alice.deposit(token_ids=list(range(100, 140))).artifact_id
    alice.publish(public)
    Secrets.ids = [artifact.id, deposited, public]
    Secrets.artifact = artifact
    Secrets.digests = list(artifact.pages) + [
        d
        for aid in (deposited, public)
        for d in alice.stat(aid, include_manifest=True).manifest.page_sha256
    ]
    bob_token = "Bearer " + tokens["bob"].read_text().strip()
    channel = grpc.insecure_channel(daemon.address)
    yield channel, [("authorization", bob_token)], tokens
    channel.close()
    for aid in Secrets.ids:  # all there still; the one put whole served byte for byte
        assert alice.stat(aid).info.artifact_id == aid
    assert_served_whole(alice.get_artifact(artifact.id), artifact)
    with Client(daemon.address, token_file=tokens["bob"]) as bob:
        own = [i for i in bob.list_artifacts() if owner_of(i.labels) == "bob"]
        assert bob.stats().artifacts == len(own)
    alice.close()
    daemon.stop()
    assert "Traceback" not in daemon.log(), daemon.log()


def _known() -> list[str]:
    ids = Secrets.ids
    return [*ids, *(aid[:16] for aid in ids), *(aid[:8] for aid in ids)]


def _swapped(raw: bytes, rng: random.Random) -> tuple[bytes, dict[str, str]]:
    """`raw` with every private id (and prefix) of alice's replaced by random hex of the
    same length (so the message's lengths hold), and the swaps made."""
    swaps: dict[str, str] = {}
    for aid in Secrets.ids:
        for length in (64, 16, 8):
            mine = aid[:length]
            if mine.encode() in raw:
                other = swaps.setdefault(mine, f"{rng.getrandbits(256):064x}"[:length])
                raw = raw.replace(mine.encode(), other.encode())
    return raw, swaps


def _answer(channel, metadata, method, raw: bytes) -> tuple[grpc.StatusCode, str, list[bytes]]:
    """(code, details, response messages' bytes) of one call."""
    path = f"/{SERVICE.full_name}/{method.name}"
    try:
        if method.client_streaming:
            call = channel.stream_unary(path, request_serializer=None, response_deserializer=None)
            return grpc.StatusCode.OK, "", [call(iter([raw]), timeout=CALL_TIMEOUT_S,
                                                 metadata=metadata)]  # fmt: skip
        if method.server_streaming:
            call = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
            stream = call(raw, timeout=CALL_TIMEOUT_S, metadata=metadata)
            return grpc.StatusCode.OK, "", [m for _, m in zip(range(50), stream, strict=False)]
        call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
        return grpc.StatusCode.OK, "", [call(raw, timeout=CALL_TIMEOUT_S, metadata=metadata)]
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", []


def _leaks(data: bytes) -> list[str]:
    found = [aid[:16] for aid in Secrets.ids if aid[:16].encode() in data]
    found += [aid[:16] for aid in Secrets.ids if bytes.fromhex(aid) in data]
    return found


def _check_ok(method, request_raw: bytes, messages: list[bytes]) -> None:
    data = b"".join(messages)
    assert not _leaks(data), f"{method.name} answered with alice's ids {_leaks(data)}"
    if method.name == "MissingPages":
        asked = set(pb.MissingPagesRequest.FromString(request_raw).sha256)
        missing = set(pb.MissingPagesResponse.FromString(messages[0]).missing)
        assert asked & set(Secrets.digests) <= missing, "bob was told alice's pages are stored"
        return
    if method.name == "Lookup" and messages:
        request = pb.LookupRequest.FromString(request_raw)
        answer = pb.LookupResponse.FromString(messages[0])
        if list(request.token_ids) == PRIVATE_PROMPT:
            assert (answer.matched_tokens, answer.untrusted_artifact_id) == (0, "")
    leaked = [d.hex()[:16] for d in Secrets.digests if d in data]
    assert not leaked, f"{method.name} answered with alice's page digests {leaked}"


@st.composite
def bobs_requests(draw, method):
    if method.client_streaming:  # PutArtifact: a manifest naming alice's pages, none sent
        manifest = pb.Manifest.FromString(Secrets.artifact.manifest.SerializeToString())
        manifest.labels["copy"] = draw(st.text(max_size=8))
        return method, wire.encode_put_manifest(manifest.SerializeToString())
    request = draw(requests(method.input_type, _known()))
    if method.name == "Watch":
        request.follow = False
    if method.name == "Lookup" and draw(st.booleans()):
        del request.token_ids[:]
        request.token_ids.extend(PRIVATE_PROMPT)
        request.ClearField("prompt")
    return method, request.SerializeToString()


@pytest.mark.parametrize("method", SERVICE.methods, ids=lambda m: m.name)
def test_no_answer_to_bob_names_counts_or_returns_alices_data(isolated, method) -> None:
    channel, metadata, _ = isolated
    rng = random.Random(3)

    @PROPERTY
    @given(drawn=bobs_requests(method))
    def run(drawn) -> None:
        method, raw = drawn
        code, details, messages = _answer(channel, metadata, method, raw)
        assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), details
        if method.name in OPERATORS:
            assert code == grpc.StatusCode.PERMISSION_DENIED, (method.name, code, details)
            return
        if code == grpc.StatusCode.OK:
            _check_ok(method, raw, messages)
        other, swaps = _swapped(raw, rng)
        if not swaps or method.client_streaming:
            return
        code2, details2, _ = _answer(channel, metadata, method, other)
        for mine, theirs in swaps.items():
            details2 = details2.replace(theirs, mine)
        assert (code, details) == (code2, details2), (method.name, swaps)

    run()
