"""A property over tokens, tenants and every RPC: no answer names, counts or returns
another tenant's artifacts or bytes (issue 34).

One daemon (the tiny model, as tests/server/test_fuzz.py runs it) with tenants alice,
bob, carol and dave. Alice stores first, privately: an artifact put whole (which she
pins), a twin artifact whose bytes the others are given too, a deposit of a prompt the
others are given and an untrusted upload of the same context, a deposit and a kept
context of prompts they never see, one whose TTL pin expires, and a deposit grafting
another of hers that she publishes. Bob stores a deposit and an artifact of his own.
The operator's catalogue (its List and Stat) says who owns what throughout: what a
caller may be told is judged from there, never from the answers under test.

Then, for every RPC of the Kvgraft service (a new one is covered as it is added), each
tenant asks after each of alice's ids (whole and by 8 characters), her prompts, pages
and labels, and Hypothesis draws more: a caller (bob or carol by their tokens; a
stranger with no token, a wrong one, a malformed one, alice's altered) and a request
(built from the RPC's message descriptor as test_fuzz builds them, or field by field as
its names say, alice's ids, prefixes, digests, label values and prompts among what it
draws; PutArtifact: her manifest without its pages, or with garbage under her digests,
or her twin's with some or all of its pages, each labelled as hers, the caller's,
published or nobody's). For each answer:

* a stranger is refused UNAUTHENTICATED, a tenant calling one of the operator's RPCs
  PERMISSION_DENIED, and no refusal holds a secret of alice's the request did not;
* an answer holds none of alice's private ids (hex, a 16-character prefix or the bytes),
  the digests of pages only she holds, or her private label values, unless the request
  sent it (the caller's own artifacts' labels aside: he may copy anything there); every
  artifact it names (listings, receipts, lookups, deposits) is the caller's or a
  published one, and carries no change-feed sequence (which counts everyone's changes);
* a request naming alice's ids, digests or label values is answered as the same request
  naming ones nobody stored (the same status, the same message once they are swapped
  back): no existence oracle;
* MissingPages lists every page only alice holds as missing; Lookup, Generate and
  Deposit match and reuse no more tokens than the caller's own and the published
  artifacts share with the prompt; an upload of the twin is refused unless it brings
  every page its sender lacks, and then reports all those written;
* Stats counts the caller's own artifacts and page bytes and nothing of the whole store;
  Info names the caller, lists no tenants, tiers or scrub, and counts as automatic
  deposits the caller's own keeps.

Before the property, bob and carol are shown to match and reuse nothing of alice's
prompt (her fresh receipt, byte for byte) and the published one's pages. After it,
alice's artifacts are all there, pinned as she left them, served byte for byte; each
tenant's Stats, Info and List hold its own and the published artifacts only (dave, who
never called, nothing of his own); and the daemon logged no traceback.

Bounded: a fixed number of derandomized examples per RPC and a deadline on every call;
the module runs in about a minute on two cores.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import Message
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvgraft import Client, wire
from kvgraft.artifact import Artifact, artifact_id, page_sizes
from kvgraft.errors import NotFound
from kvgraft.page_buffers import block_aligned
from kvgraft.tenancy import (
    SHARED_LABEL,
    TENANT_LABEL,
    is_shared,
    owned_labels,
    owner_of,
    visible_to,
)
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.testing.daemon_process import DaemonProcess, wait_model_ready
from kvgraftd.testing.tenants import write_tenants
from tests.server.test_fuzz import SERVICE, requests
from tests.support.factory import random_artifact
from tests.support.store_audit import assert_served_whole

CALL_TIMEOUT_S = 20.0
STREAM_MESSAGES = 2000  # more than any answer of a 256-token context holds
PROPERTY = settings(
    max_examples=50,  # per RPC
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# The RPCs that act on the whole store: the operator's only, once tenants are configured.
OPERATOR_ONLY = {"Watch", "Replicate", "Scrub", "RemoteStatus", "RemoteSync"}
VOCAB = 512  # the tiny model's

_rng = random.Random(34)


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(VOCAB) for _ in range(n)]


SHOWN_PROMPT = _tokens(40)  # alice's deposit; the others send it
HIDDEN_PROMPT = _tokens(40)  # alice's generate with deposit; nobody else ever sends it
KEPT_PROMPT = _tokens(24)  # alice's generate with keep; nobody else ever sends it
PUBLIC_PROMPT = _tokens(40)  # alice deposits its first 32 tokens, then all of it: published
BOB_PROMPT = _tokens(40)
# Label values of alice's artifacts: NOTES[4] is the published one's, the rest private.
NOTES = [f"{_rng.getrandbits(96):024x}" for _ in range(8)]
PUBLIC_NOTE = NOTES[4]

TENANTS = ("bob", "carol")  # the callers drawn; dave never calls (his figures stay zero)
# Callers without a tenant's token, each refused UNAUTHENTICATED.
STRANGERS = ("no token", "a wrong token", "not a bearer token", "alice's token altered")
CALLERS = (*TENANTS * 6, *STRANGERS)  # three calls of four by a tenant


# ----------------------------------------------------------------------
# what the daemon holds, as its operator sees it


def _common_prefix(a: Iterable[int], b: Iterable[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Catalogue:
    """Every artifact the daemon held since the fixture began, as the operator lists them:
    its labels (who owns it, whether it is published) and, for the served model's, its
    tokens. An artifact deleted since stays known: that is the caller's own doing."""

    def __init__(self, operator: Client, fingerprint: bytes) -> None:
        self._operator = operator
        self._fingerprint = fingerprint
        self.labels: dict[str, dict[str, str]] = {}
        self.tokens: dict[str, list[int]] = {}

    def refresh(self) -> list[pb.ArtifactInfo]:
        """The artifacts held now (and every one learnt about)."""
        now = list(self._operator.list_artifacts())
        for info in now:
            if info.artifact_id in self.labels:
                continue
            self.labels[info.artifact_id] = dict(info.labels)
            if info.model_fingerprint == self._fingerprint:
                try:
                    stat = self._operator.stat(info.artifact_id, include_manifest=True)
                except NotFound:  # deleted just now: it was never anyone's to match
                    continue
                self.tokens[info.artifact_id] = list(stat.manifest.token_ids)
        return now

    def visible(self, caller: str, aid: str) -> bool:
        labels = self.labels.get(aid)
        return labels is not None and visible_to(caller, labels)

    def reuse_bound(self, caller: str, tokens: list[int]) -> int:
        """The most leading tokens of `tokens` that the caller's own and the published
        artifacts of the served model hold: all a lookup may match, a run may reuse."""
        return max(
            (
                _common_prefix(tokens, held)
                for aid, held in self.tokens.items()
                if self.visible(caller, aid)
            ),
            default=0,
        )


@dataclass
class Alice:
    """What alice holds, and what must never reach another tenant."""

    put: Artifact  # put whole and pinned: served byte for byte at the end
    twin: Artifact  # its bytes are given to the others too
    private_ids: list[str]  # her unpublished artifacts (the expired one included)
    present_ids: list[str]  # those still there (all but the expired one)
    published_id: str
    only_digests: set[bytes]  # pages nobody else holds or can compute
    public_digests: set[bytes]  # the published artifact's


@dataclass
class World:
    """The daemon as the tests reach it, what alice holds, and what the callers did."""

    channel: grpc.Channel
    metadata: dict[str, tuple[tuple[str, str], ...]]  # per caller
    operator: Client
    alice_client: Client
    tokens: dict[str, Path]
    address: str
    alice: Alice
    catalogue: Catalogue
    bob_ids: list[str]
    stand_in: dict[str, str] = field(default_factory=dict)  # alice's strings -> nobody's
    stand_in_digest: dict[bytes, bytes] = field(default_factory=dict)
    keeps: Counter = field(default_factory=Counter)  # Generate or Graft with keep, per caller

    def others_ids(self, method) -> list[str]:
        """The ids of others' artifacts that requests to `method` name besides alice's
        private ones: the published one, and bob's, except to Delete (so that the RPCs
        after it find them)."""
        return [self.alice.published_id, *(self.bob_ids if method.name != "Delete" else [])]

    def known(self, method) -> list[str]:
        """The strings drawn into requests to `method`: alice's ids and prefixes, others',
        label values and names."""
        ids = [*self.alice.private_ids, *self.others_ids(method)]
        return [
            *ids,
            *(aid[:16] for aid in ids),
            *(aid[:8] for aid in ids),
            *NOTES,
            "alice",
            "note",
            TENANT_LABEL,
            SHARED_LABEL,
            "true",
        ]


def _store_alices(alice: Client, rng: random.Random) -> Alice:
    """Alice's artifacts, as the module docstring lists them."""
    put, twin, expiring = (
        random_artifact(rng, labels={TENANT_LABEL: "alice", "note": NOTES[i]}) for i in range(3)
    )
    alice.put_artifact(put)
    alice.pin(put.id)
    alice.put_artifact(twin)
    shown = alice.deposit(token_ids=SHOWN_PROMPT, labels={"note": NOTES[3]}).artifact_id
    computed = alice.get_artifact(shown)  # uploaded relabelled: her untrusted copy
    labels = {TENANT_LABEL: "alice", "note": NOTES[7]}
    uploaded = Artifact(_with_labels(computed.manifest, labels), computed.pages)
    alice.put_artifact(uploaded)
    base = alice.deposit(token_ids=PUBLIC_PROMPT[:32], labels={"note": NOTES[5]}).artifact_id
    source = alice.deposit(token_ids=PUBLIC_PROMPT, labels={"note": PUBLIC_NOTE}).artifact_id
    published = alice.publish(source).artifact_id
    hidden = alice.generate(
        token_ids=HIDDEN_PROMPT, max_new_tokens=3, deposit=True, labels={"note": NOTES[6]}
    ).deposited_artifact_id
    kept = alice.generate(token_ids=KEPT_PROMPT, max_new_tokens=2, keep=True)
    alice.put_artifact(expiring)
    alice.pin(expiring.id, ttl_s=1)
    _wait_gone(alice, expiring.id)
    present = [put.id, twin.id, shown, uploaded.id, base, source, hidden]
    present.append(kept.deposited_artifact_id)
    assert {i.artifact_id for i in alice.list_artifacts() if not is_shared(i.labels)} == set(
        present
    ), "alice's setup did not store what this test expects"

    def digests(aid: str) -> set[bytes]:
        return set(alice.stat(aid, include_manifest=True).manifest.page_sha256)

    return Alice(
        put=put,
        twin=twin,
        private_ids=[*present, expiring.id],
        present_ids=present,
        published_id=published,
        only_digests=set(put.pages)
        | set(expiring.pages)
        | digests(hidden)
        | digests(kept.deposited_artifact_id),
        public_digests=digests(published),
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("isolation")
    config, tokens = write_tenants(root / "etc", {name: {} for name in ("alice", *TENANTS, "dave")})
    daemon = DaemonProcess.start(
        root / "data",
        [
            "--config", str(config),
            *("--model", "tiny:0", "--page-tokens", "16", "--block-tokens", "64"),
            *("--max-context-tokens", "256", "--max-call-s", "20"),
        ],
    )  # fmt: skip
    alice = Client(daemon.address, token_file=tokens["alice"], transfer_timeout_s=60)
    operator = Client(daemon.address, token_file=tokens["operator"], transfer_timeout_s=60)
    wait_model_ready(daemon.address, token_file=tokens["alice"])
    rng = random.Random(12)
    secrets = _store_alices(alice, rng)
    with Client(daemon.address, token_file=tokens["bob"]) as bob:
        bob_ids = [
            bob.deposit(token_ids=BOB_PROMPT).artifact_id,
            bob.put_artifact(random_artifact(rng, labels={"note": "bob's"})).artifact_id,
        ]
    catalogue = Catalogue(operator, alice.info().model_fingerprint)
    catalogue.refresh()
    channel = grpc.insecure_channel(daemon.address)
    alice_token = tokens["alice"].read_text().strip()
    metadata = {name: _bearer(tokens[name].read_text().strip()) for name in TENANTS} | {
        "no token": (),
        "a wrong token": _bearer(f"{rng.getrandbits(128):032x}"),
        "not a bearer token": (("authorization", f"Basic {alice_token}"),),
        "alice's token altered": _bearer(alice_token[:-1] + "01"[alice_token[-1] == "0"]),
    }
    world = World(
        channel, metadata, operator, alice, tokens, daemon.address, secrets, catalogue, bob_ids
    )
    for aid in secrets.private_ids:  # nobody's: random hex of the same length
        other = f"{rng.getrandbits(256):064x}"
        world.stand_in |= {aid[:n]: other[:n] for n in (64, 16, 8)}
    world.stand_in |= {note: f"{rng.getrandbits(96):024x}" for note in NOTES if note != PUBLIC_NOTE}
    world.stand_in_digest = {d: rng.randbytes(32) for d in secrets.only_digests}
    yield world
    channel.close()
    alice.close()
    operator.close()
    daemon.stop()
    assert "Traceback" not in daemon.log(), daemon.log()


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _wait_gone(client: Client, aid: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            client.stat(aid)
        except NotFound:
            return
        time.sleep(0.2)
    raise AssertionError(f"artifact {aid[:16]} outlived its 1 s pin")


# ----------------------------------------------------------------------
# one call, as any gRPC client makes it


@dataclass
class Answer:
    code: grpc.StatusCode
    details: str
    messages: list[bytes]


def _answer(world: World, caller: str, method, messages: list[bytes]) -> Answer:
    path = f"/{SERVICE.full_name}/{method.name}"
    metadata = world.metadata[caller]
    plain = {"request_serializer": None, "response_deserializer": None}
    try:
        if method.client_streaming:
            call = world.channel.stream_unary(path, **plain)
            reply = call(iter(messages), timeout=CALL_TIMEOUT_S, metadata=metadata)
            return Answer(grpc.StatusCode.OK, "", [reply])
        if method.server_streaming:
            call = world.channel.unary_stream(path, **plain)
            stream = call(messages[0], timeout=CALL_TIMEOUT_S, metadata=metadata)
            received = [m for _, m in zip(range(STREAM_MESSAGES), stream, strict=False)]
            return Answer(grpc.StatusCode.OK, "", received)
        call = world.channel.unary_unary(path, **plain)
        return Answer(grpc.StatusCode.OK, "", [call(messages[0], timeout=CALL_TIMEOUT_S,
                                                    metadata=metadata)])  # fmt: skip
    except grpc.RpcError as exc:
        return Answer(exc.code(), exc.details() or "", [])


# ----------------------------------------------------------------------
# the requests drawn


@dataclass
class Drawn:
    """One call: who makes it, its messages, and the same call naming nobody's ids,
    digests and label values where alice's stood (None: it names none of hers, or the
    comparison means nothing, as for an upload of pages the caller holds)."""

    caller: str
    messages: list[bytes]
    stand_in: list[bytes] | None
    back: dict[str, str]  # stand-in strings -> alice's, for the stand-in's message
    prompt: list[int] | None = None  # the token ids a Lookup, Generate or Deposit sends
    twin_sent: set[bytes] | None = None  # an upload of the twin: the pages it sent
    missing_before: set[bytes] = field(default_factory=set)  # and those its sender lacked
    computed: list[str] = field(default_factory=list)  # ids of the manifests it sent

    @property
    def sent(self) -> bytes:
        """What the caller knows: its messages, and the ids of the manifests among them
        (an answer may name those: the daemon computed them from the caller's bytes)."""
        return b"".join(self.messages) + " ".join(self.computed).encode()


def _prompts() -> st.SearchStrategy[list[int]]:
    tails = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
    cut = st.sampled_from([1, 15, 16, 17, 32, 39])
    return st.one_of(
        st.sampled_from([SHOWN_PROMPT, PUBLIC_PROMPT, BOB_PROMPT]),
        st.builds(lambda p, n: p[:n], st.sampled_from([SHOWN_PROMPT, PUBLIC_PROMPT]), cut),
        st.builds(lambda p, t: p + t, st.sampled_from([SHOWN_PROMPT, PUBLIC_PROMPT]), tails),
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
    )


def _digest_lists(world: World) -> st.SearchStrategy[list[bytes]]:
    pool = sorted(
        world.alice.only_digests | world.alice.public_digests | set(world.alice.twin.pages)
    )
    return st.lists(
        st.one_of(st.sampled_from(pool), st.binary(min_size=32, max_size=32)), max_size=12
    )


def _selectors() -> st.SearchStrategy[dict[str, str]]:
    return st.sampled_from(
        [{"note": note} for note in NOTES]
        + [
            {TENANT_LABEL: "alice"},
            {TENANT_LABEL: "alice", SHARED_LABEL: "true"},
            {TENANT_LABEL: "bob"},
            {SHARED_LABEL: "true"},
        ]
    )


def _ids(world: World, method) -> st.SearchStrategy[str]:
    """Artifact ids as a request names them, whole or by a 16- or 8-character prefix:
    alice's private ones, others' (World.others_ids), and ones nobody stored."""
    pools = [
        world.alice.private_ids,
        world.others_ids(method),
        [f"{random.Random(n).getrandbits(256):064x}" for n in range(4)],
    ]
    return st.builds(
        lambda ids, length: ids[:length],
        st.sampled_from(pools).flatmap(st.sampled_from),
        st.sampled_from([64, 16, 8]),
    )


@st.composite
def plausible_requests(draw, method, world: World) -> Message:
    """A request the daemon would serve for someone: each field set by what its name
    says it holds, from alice's ids, prompts, digests and labels as often as not."""
    request = getattr(pb, method.input_type.name)()
    names = request.DESCRIPTOR.fields_by_name
    small = pb.TokenIds(ids=draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4)))
    for name, descriptor in names.items():
        if name == "artifact_id":
            request.artifact_id = draw(_ids(world, method))
        elif name == "token_ids":
            request.token_ids.extend(draw(_prompts()))
        elif name == "prompt" and "token_ids" not in names:
            request.prompt.tokens.ids.extend(draw(_prompts()))
        elif name == "continuation":
            request.continuation.tokens.CopyFrom(small)
        elif name == "options":
            request.options.max_new_tokens = draw(st.integers(0, 3))
            request.options.deposit = draw(st.booleans())
            request.options.keep = draw(st.booleans())
            request.options.labels.update(
                draw(st.sampled_from([{}, *({"note": n} for n in NOTES)]))
            )
        elif name in ("labels", "label_selector"):
            getattr(request, name).update(draw(_selectors()))
        elif name in ("sha256", "only_pages") and draw(st.booleans()):
            getattr(request, name).extend(draw(_digest_lists(world)))
        elif descriptor.type == descriptor.TYPE_BOOL:
            setattr(request, name, draw(st.booleans()))
    return request


def _prompt_of(method: str, request: Message) -> list[int] | None:
    """The token ids a Lookup, Generate or Deposit asks about (None: another RPC, or a
    prompt of text, which the tiny model refuses)."""
    if method == "Lookup" and request.token_ids:
        return list(request.token_ids)
    if method not in ("Lookup", "Generate", "Deposit"):
        return None
    prompt = request.prompt
    return list(prompt.tokens.ids) if prompt.WhichOneof("input") == "tokens" else None


def _swapped(world: World, raw: bytes) -> tuple[bytes, dict[str, str]]:
    """`raw` with alice's ids, prefixes, label values and page digests replaced by nobody's
    of the same length; and the strings to swap back in an answer's message."""
    back: dict[str, str] = {}
    for mine, theirs in sorted(world.stand_in.items(), key=lambda kv: -len(kv[0])):
        if mine.encode() in raw:
            raw = raw.replace(mine.encode(), theirs.encode())
            back[theirs] = mine
    for mine, theirs in world.stand_in_digest.items():
        if mine in raw:
            raw = raw.replace(mine, theirs)
            back[theirs.hex()] = mine.hex()
            back[theirs.hex()[:16]] = mine.hex()[:16]
    return raw, back


def _drawn(world: World, caller: str, method, request: Message) -> Drawn:
    if method.name == "Watch":
        request.follow = False  # a follow stream waits for changes
    raw = request.SerializeToString()
    other, back = _swapped(world, raw)
    return Drawn(caller, [raw], [other] if back else None, back, _prompt_of(method.name, request))


@st.composite
def unary_calls(draw, method, world: World) -> Drawn:
    caller = draw(st.sampled_from(CALLERS))
    fuzzed = requests(method.input_type, world.known(method))
    return _drawn(world, caller, method, draw(st.one_of(fuzzed, plausible_requests(method, world))))


def explicit_calls(method, world: World) -> list[Drawn]:
    """What each tenant asks of alice's data every run, whatever Hypothesis draws: each of
    her ids (whole and by 8 characters), the published one's and its own; her prompts;
    her pages; her labels."""
    fields = method.input_type.fields_by_name
    prompts = [SHOWN_PROMPT, [*SHOWN_PROMPT, 1], PUBLIC_PROMPT, PUBLIC_PROMPT[:33]]
    tokens = pb.Prompt(tokens=pb.TokenIds(ids=[1, 2]))
    one_token = pb.GenerateOptions(max_new_tokens=1)
    asked = []
    if "artifact_id" in fields:
        ids = [*world.alice.private_ids, *(aid[:8] for aid in world.alice.private_ids)]
        ids += world.others_ids(method)
        extra = {"continuation": tokens, "options": one_token} if "continuation" in fields else {}
        extra |= {"pinned": True} if "pinned" in fields else {}
        asked = [dict(artifact_id=aid, **extra) for aid in ids]
    elif "token_ids" in fields:
        asked = [dict(token_ids=ids) for ids in prompts]
    elif "prompt" in fields:
        options = {"options": one_token} if "options" in fields else {}
        asked = [dict(prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids)), **options) for ids in prompts]
    elif "sha256" in fields:
        asked = [dict(sha256=sorted(world.alice.only_digests | set(world.alice.twin.pages)))]
    elif "label_selector" in fields:
        selectors = [{"note": n} for n in NOTES] + [{TENANT_LABEL: "alice"}]
        asked = [dict(label_selector=selector) for selector in selectors]
    request_class = getattr(pb, method.input_type.name)
    return [
        _drawn(world, caller, method, request_class(**values))
        for caller in TENANTS
        for values in asked
    ]


LABELLED = ("hers", "the caller's", "hers, published", "nobody's")  # how an upload labels


def _labels_as_sent(labels: dict[str, str], caller: str, labelled: str, copy: str) -> dict:
    """Alice's labels as an upload carries them (LABELLED), and a label "copy" if given."""
    out = {k: v for k, v in labels.items() if k not in (TENANT_LABEL, SHARED_LABEL)}
    if labelled in ("hers", "hers, published"):
        out[TENANT_LABEL] = "alice"
    if labelled == "the caller's":
        out[TENANT_LABEL] = caller
    if labelled == "hers, published":
        out[SHARED_LABEL] = "true"
    return out | ({"copy": copy} if copy else {})


def _with_labels(manifest: pb.Manifest, labels: dict[str, str]) -> pb.Manifest:
    copy = pb.Manifest.FromString(manifest.SerializeToString())
    copy.labels.clear()
    copy.labels.update(labels)
    return copy


def _upload(manifest: pb.Manifest, pages: list[tuple[bytes, bytes]], expected: str) -> list[bytes]:
    messages = [
        wire.encode_page_block(wire.PUT_PAGES, chunks) for chunks in wire.split_pages(pages)
    ]
    canonical = manifest.SerializeToString(deterministic=True)
    return [*messages, wire.encode_put_manifest(canonical, expected)]


def _ids_as_stored(manifest: pb.Manifest, caller: str) -> list[str]:
    """The manifest's id as sent and as the caller's view relabels it."""
    labels = manifest.labels
    shared = is_shared(labels) and owner_of(labels) == caller
    return [
        artifact_id(manifest),
        artifact_id(_with_labels(manifest, owned_labels(labels, caller, shared))),
    ]


def _twin_upload(
    world: World, caller: str, labelled: str, copy: str, sent: set[bytes], expect_own: bool
) -> Drawn:
    """The twin's manifest (labelled so) and the pages `sent`, whose bytes the caller has."""
    twin = world.alice.twin
    labels = _labels_as_sent(dict(twin.manifest.labels), caller, labelled, copy)
    manifest = _with_labels(twin.manifest, labels)
    pages = [(d, bytes(twin.pages[d])) for d in sorted(page_sizes(manifest)) if d in sent]
    messages = _upload(manifest, pages, artifact_id(manifest) if expect_own else "")
    return Drawn(caller, messages, None, {}, twin_sent=sent, computed=[artifact_id(manifest)])


def _hers_upload(
    world: World, caller: str, labelled: str, copy: str, garbage: set[bytes], expected: str
) -> Drawn:
    """Alice's put artifact's manifest (labelled so) with none of its pages, bytes of
    garbage sent under the digests `garbage`, and the `expected` id ("own": the
    manifest's); and the same upload naming nobody's digests where hers stood."""
    labels = _labels_as_sent(dict(world.alice.put.manifest.labels), caller, labelled, copy)
    mine = _with_labels(world.alice.put.manifest, labels)
    theirs = pb.Manifest.FromString(mine.SerializeToString())
    theirs.page_sha256[:] = [world.stand_in_digest[d] for d in mine.page_sha256]
    sizes = page_sizes(mine)

    def stream(manifest: pb.Manifest, digest_of) -> list[bytes]:
        pages = [(digest_of(d), bytes(sizes[d])) for d in sorted(garbage)]
        return _upload(manifest, pages, artifact_id(manifest) if expected == "own" else expected)

    back: dict[str, str] = {}
    for d in sizes:
        stand_in = world.stand_in_digest[d]
        back |= {stand_in.hex(): d.hex(), stand_in.hex()[:16]: d.hex()[:16]}
    for ours, other in zip(
        _ids_as_stored(mine, caller), _ids_as_stored(theirs, caller), strict=True
    ):
        back |= {other: ours, other[:16]: ours[:16]}
    return Drawn(
        caller,
        stream(mine, lambda d: d),
        stream(theirs, lambda d: world.stand_in_digest[d]),
        back,
        computed=[artifact_id(mine)],
    )


@st.composite
def uploads(draw, world: World) -> Drawn:
    """PutArtifact: alice's manifest with none of its pages, or with garbage under her
    digests; or the twin's (whose bytes the caller has) with some or all of its pages."""
    caller = draw(st.sampled_from(CALLERS))
    labelled = draw(st.sampled_from(LABELLED))
    copy = draw(st.text(alphabet="abcdefgh0123456789", max_size=8))
    if draw(st.booleans()):
        digests = sorted(world.alice.twin.pages)
        sent = draw(st.sampled_from([set(digests), set()]) | st.sets(st.sampled_from(digests)))
        return _twin_upload(world, caller, labelled, copy, sent, draw(st.booleans()))
    digests = sorted(world.alice.put.pages)
    garbage = draw(st.sets(st.sampled_from(digests), max_size=3))
    expected = draw(st.sampled_from(["", "own", f"{draw(st.integers(0, 255)):064x}"]))
    return _hers_upload(world, caller, labelled, copy, garbage, expected)


def explicit_uploads(method, world: World) -> list[Drawn]:
    """Each tenant's uploads of alice's manifest and of the twin, every labelling."""
    twin, put = sorted(world.alice.twin.pages), sorted(world.alice.put.pages)
    out = []
    for caller in TENANTS:
        for labelled in LABELLED:
            for sent in (set(twin), set(), set(twin[::2])):
                out.append(_twin_upload(world, caller, labelled, "", sent, bool(sent)))
            for garbage, expected in [(set(), ""), (set(), "own"), (set(put[:2]), "7" * 64)]:
                out.append(_hers_upload(world, caller, labelled, "", garbage, expected))
    return out


# ----------------------------------------------------------------------
# what an answer may hold


def _walk(message: Message) -> Iterator[Message]:
    yield message
    for descriptor, value in message.ListFields():
        if descriptor.message_type is None or descriptor.message_type.GetOptions().map_entry:
            continue
        for item in value if descriptor.is_repeated else [value]:
            yield from _walk(item)


def _secrets_in(world: World, data: bytes, sent: bytes) -> list[str]:
    """Alice's secrets in `data` (an answer's bytes, or its message) that `sent` (the
    request's bytes) did not hold."""
    found = []
    for aid in world.alice.private_ids:
        for text in (aid[:16].encode(), bytes.fromhex(aid)):
            if text in data and text not in sent:
                found.append(f"id {aid[:16]}")
    for digest in world.alice.only_digests:
        for text in (digest, digest.hex()[:16].encode()):
            if text in data and digest not in sent and text not in sent:
                found.append(f"page {digest.hex()[:16]}")
    for note in NOTES:
        if note != PUBLIC_NOTE and note.encode() in data and note.encode() not in sent:
            found.append(f"label value {note}")
    return sorted(set(found))


def _named_ids(message: Message) -> Iterator[str]:
    """Every artifact an answer names: the values of its fields named *artifact_id or
    entry_id, in messages nested at any depth (a field added later is covered too)."""
    for part in _walk(message):
        for descriptor, value in part.ListFields():
            if descriptor.name.endswith("artifact_id") or descriptor.name == "entry_id":
                yield from value if descriptor.is_repeated else [value]


def _without_own_labels(message: Message, caller: str) -> bytes:
    """The answer's bytes, the labels of the caller's own artifacts left out (he may have
    copied anything of alice's there himself)."""
    for part in _walk(message):
        if isinstance(part, pb.ArtifactInfo | pb.Manifest) and owner_of(part.labels) == caller:
            part.labels.clear()
    return message.SerializeToString()


def _check_answer(world: World, method, drawn: Drawn, answer: Answer, bound: int | None) -> None:
    """An OK answer to a tenant: nothing of alice's, only what the caller may see."""
    caller, catalogue = drawn.caller, world.catalogue
    output = getattr(pb, method.output_type.name)
    parsed = [output.FromString(raw) for raw in answer.messages]
    for message in parsed:
        for aid in _named_ids(message):
            assert catalogue.visible(caller, aid), (
                f"{method.name} named to {caller} artifact {aid[:16]}, which is "
                f"{owner_of(catalogue.labels.get(aid, {})) or 'nobody'}'s and not published"
            )
        for part in _walk(message):  # the store-wide feed's numbers count others' changes
            if isinstance(part, pb.ArtifactInfo):
                assert part.sequence == 0, f"{method.name} numbered {caller} a feed sequence"
        leaked = _secrets_in(world, _without_own_labels(message, caller), drawn.sent)
        assert not leaked, f"{method.name} answered {caller} with alice's {leaked}"
    if method.name == "MissingPages":
        asked = set(pb.MissingPagesRequest.FromString(drawn.messages[0]).sha256)
        hers = asked & world.alice.only_digests
        assert hers <= set(parsed[0].missing), f"{caller} was told alice's pages are stored"
    if method.name == "Lookup" and bound is not None:
        lookup = parsed[0]
        assert lookup.matched_tokens <= bound, f"{caller}'s Lookup matched alice's tokens"
        assert lookup.untrusted_tokens <= bound, f"{caller}'s Lookup saw alice's tokens"
    if method.name in ("Generate", "Deposit") and bound is not None:
        for message in parsed:
            for part in _walk(message):
                if isinstance(part, pb.Receipt):
                    assert part.reused_tokens <= bound, f"{caller}'s {method.name} reused alice's"
    if drawn.twin_sent is not None:
        (response,) = parsed
        if not response.already_present:
            assert response.pages_written == len(drawn.missing_before), (
                f"{caller}'s upload of pages alice holds reported {response.pages_written} "
                f"written, not the {len(drawn.missing_before)} it brought"
            )


def _count_keeps(world: World, method, caller: str, messages: list[bytes], answer: Answer) -> None:
    """A Generate or Graft served with keep (and no deposit) is one of the caller's
    automatic deposits (or skipped ones) in its Info."""
    if method.name in ("Generate", "Graft") and answer.code == grpc.StatusCode.OK:
        request_cls = pb.GenerateRequest if method.name == "Generate" else pb.GraftRequest
        options = request_cls.FromString(messages[0]).options
        world.keeps[caller] += options.keep and not options.deposit


def _check_figures(world: World, method, caller: str, answer: Answer, before, after) -> None:
    """Stats and Info: the caller's own figures, nothing of the whole store."""
    if method.name == "Stats":
        stats = pb.StatsResponse.FromString(answer.messages[0])
        own = [[i for i in infos if owner_of(i.labels) == caller] for infos in (before, after)]
        counts = sorted(len(o) for o in own)
        sizes = sorted(sum(i.page_bytes for i in o) for o in own)
        assert counts[0] <= stats.artifacts <= counts[1], (
            f"Stats counts {stats.artifacts} artifacts for {caller}, who owns {counts[1]}"
        )
        assert sizes[0] <= stats.page_bytes <= sizes[1], (
            f"Stats counts {stats.page_bytes} page bytes for {caller}, who owns {sizes[1]}"
        )
        own_only = pb.StatsResponse(  # its pages and their disk: checked exactly below
            artifacts=stats.artifacts,
            pages=stats.pages,
            page_bytes=stats.page_bytes,
            segment_disk_bytes=stats.segment_disk_bytes,
        )
        assert stats == own_only, f"Stats told {caller} of the whole store: {stats}"
    if method.name == "Info":
        info = pb.InfoResponse.FromString(answer.messages[0])
        assert (info.tenant, list(info.tenants), list(info.tiers)) == (caller, [], [])
        assert not info.HasField("scrub"), info.scrub
        cache = info.cache  # no budget of its own, nothing evicted or corrupt
        assert cache.budget_bytes == cache.evicted_artifacts == cache.quarantined_artifacts == 0
        kept = cache.auto_deposits + cache.auto_deposits_skipped
        assert kept == world.keeps[caller], f"Info counts {kept} keeps for {caller}"


# ----------------------------------------------------------------------
# the tests


def test_alices_prompt_matches_and_reuses_nothing_for_the_others(world) -> None:
    fresh = world.alice_client.generate(token_ids=SHOWN_PROMPT, max_new_tokens=2, no_cache=True)
    for name in TENANTS:
        with Client(world.address, token_file=world.tokens[name]) as other:
            lookup = other.lookup(token_ids=SHOWN_PROMPT)
            assert (lookup.matched_tokens, lookup.untrusted_tokens) == (0, 0), lookup
            assert lookup.untrusted_artifact_id == "", lookup
            result = other.generate(token_ids=SHOWN_PROMPT, max_new_tokens=2)
            receipt = result.receipt.raw
            assert (receipt.reused_tokens, receipt.computed_tokens) == (
                0,
                fresh.receipt.raw.computed_tokens,
            )
            assert receipt.prompt_logits_sha256 == fresh.receipt.raw.prompt_logits_sha256
            assert receipt.generated_logits_sha256 == fresh.receipt.raw.generated_logits_sha256
            shared = other.lookup(token_ids=PUBLIC_PROMPT)  # the published one is for all
            assert shared.matched_tokens > 0, shared


def _missing_of_twin(world: World, caller: str) -> set[bytes]:
    """The twin's pages the caller is told it lacks."""
    request = pb.MissingPagesRequest(sha256=sorted(page_sizes(world.alice.twin.manifest)))
    method = SERVICE.methods_by_name["MissingPages"]
    answer = _answer(world, caller, method, [request.SerializeToString()])
    return set(pb.MissingPagesResponse.FromString(answer.messages[0]).missing)


@pytest.mark.parametrize("method", list(SERVICE.methods), ids=lambda m: m.name)
def test_no_answer_names_counts_or_returns_another_tenants_data(world, method) -> None:
    strategy = uploads(world) if method.client_streaming else unary_calls(method, world)
    explicit = (explicit_uploads if method.client_streaming else explicit_calls)(method, world)

    def run(drawn: Drawn) -> None:
        caller, catalogue = drawn.caller, world.catalogue
        before = catalogue.refresh()
        bound = None if drawn.prompt is None else catalogue.reuse_bound(caller, drawn.prompt)
        if drawn.twin_sent is not None and caller in TENANTS:
            drawn.missing_before = _missing_of_twin(world, caller)
        answer = _answer(world, caller, method, drawn.messages)
        after = catalogue.refresh()
        assert answer.code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (
            method.name,
            answer.details,
        )
        leaked = _secrets_in(world, answer.details.encode(), drawn.sent)
        assert not leaked, f"{method.name} refused {caller} naming alice's {leaked}"
        if caller in STRANGERS:
            assert answer.code == grpc.StatusCode.UNAUTHENTICATED, (method.name, caller, answer)
            return
        if method.name in OPERATOR_ONLY:
            assert answer.code == grpc.StatusCode.PERMISSION_DENIED, (method.name, answer)
            return
        _count_keeps(world, method, caller, drawn.messages, answer)
        if drawn.twin_sent is not None:  # every page it lacks, whoever else holds it
            must_bring = drawn.missing_before - drawn.twin_sent
            expected = grpc.StatusCode.INVALID_ARGUMENT if must_bring else grpc.StatusCode.OK
            assert answer.code == expected, (caller, len(must_bring), answer.details)
        if answer.code == grpc.StatusCode.OK:
            _check_answer(world, method, drawn, answer, bound)
            _check_figures(world, method, caller, answer, before, after)
        if drawn.stand_in is None:
            return
        other = _answer(world, caller, method, drawn.stand_in)
        _count_keeps(world, method, caller, drawn.stand_in, other)
        details = other.details
        for theirs, mine in sorted(drawn.back.items(), key=lambda kv: -len(kv[0])):
            details = details.replace(theirs, mine)
        assert (answer.code, answer.details) == (other.code, details), (
            f"{method.name} answered {caller} about alice's data otherwise than about "
            f"nobody's: {answer.code} {answer.details!r} / {other.code} {other.details!r}"
        )

    prove = PROPERTY(given(drawn=strategy)(run))
    for drawn in explicit:
        prove = example(drawn=drawn)(prove)
    prove()


def test_every_rpc_is_covered() -> None:
    assert {m.name for m in SERVICE.methods} >= OPERATOR_ONLY
    streaming_in = [m.name for m in SERVICE.methods if m.client_streaming]
    assert streaming_in == ["PutArtifact"], "a new client-streaming RPC needs a strategy here"


def test_alices_artifacts_outlive_the_others_requests(world) -> None:
    alice, secrets = world.alice_client, world.alice
    held = {i.artifact_id: i for i in alice.list_artifacts()}
    gone = {*secrets.present_ids, secrets.published_id} - set(held)
    assert not gone, f"alice's artifacts {sorted(a[:16] for a in gone)} were deleted"
    for aid in [*secrets.present_ids, secrets.published_id]:
        info = held[aid]
        assert info.pinned == (aid == secrets.put.id), f"artifact {aid[:16]} was (un)pinned"
        assert owner_of(info.labels) == "alice", info.labels
        assert is_shared(info.labels) == (aid == secrets.published_id), info.labels
    assert_served_whole(alice.get_artifact(secrets.put.id), secrets.put)
    assert_served_whole(alice.get_artifact(secrets.twin.id), secrets.twin)


def test_each_tenant_is_told_its_own_figures_only(world) -> None:
    now = world.catalogue.refresh()
    shared = {i.artifact_id for i in now if is_shared(i.labels)}
    for name in (*TENANTS, "dave"):
        own = [i for i in now if owner_of(i.labels) == name]
        with Client(world.address, token_file=world.tokens[name]) as tenant:
            stats, info = tenant.stats(), tenant.info()
            listed = {i.artifact_id for i in tenant.list_artifacts()}
            sizes = {  # the distinct pages its artifacts reference (issue 47: they were 0)
                digest: size
                for i in own
                for digest, size in page_sizes(
                    tenant.stat(i.artifact_id, include_manifest=True).manifest
                ).items()
            }
        expected = pb.StatsResponse(
            artifacts=len(own),
            pages=len(sizes),
            page_bytes=sum(i.page_bytes for i in own),
            segment_disk_bytes=sum(block_aligned(size) for size in sizes.values()),
        )
        assert stats == expected, (name, stats)
        assert listed == {i.artifact_id for i in own} | shared, name
        assert (info.tenant, list(info.tenants), list(info.tiers)) == (name, [], [])
        cache = pb.CacheInfo(
            policy=info.cache.policy,
            mode=info.cache.mode,
            auto_deposits=world.keeps[name],
            # bob's and carol's own TTL pins (drawn) may have expired; dave had none
            expired_artifacts=info.cache.expired_artifacts if name != "dave" else 0,
        )
        assert info.cache == cache, (name, info.cache)
