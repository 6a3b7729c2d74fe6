"""Conversation contexts (what chat_cache and cache = "auto" keep) live within a bound of their
own and are evicted first, whatever the policy: in-process on a real store (a clock the test
moves, the keeper's pass called where the daemon's thread would run it), then a real daemon
whose automatic deposits stay within the bound while an explicit deposit stays.

Was (issue 47): `make serve` kept every chat's context with no budget at all; about 60
short requests left 56 artifacts and 169 MiB, and nothing told them from deposits.
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

import pytest

from kvgraft import Client
from kvgraft.artifact import page_sizes
from kvgraft.conversations import KIND_LABEL, conversation_labels
from kvgraft.tenancy import TENANT_LABEL
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.eviction import CacheBudget, conversation_budget
from kvgraftd.store.page_records import page_records_of
from kvgraftd.store.publishing import publish, withdraw
from kvgraftd.store.signing import Signer, TrustPolicy
from kvgraftd.store.tenant_view import TenantView
from kvgraftd.testing.daemon_process import wait_model_ready
from tests.support.factory import Clock, random_artifact

LAYOUT = {"num_layers": 2, "kv_heads": 1, "head_dim": 32, "kv_dtype": pb.KV_DTYPE_FLOAT32}


def _artifact(rng: random.Random, conversation: bool = False, **labels: str):
    """64 tokens of fp32 in 16-token pages: every one the same page bytes."""
    labelled = conversation_labels(labels) if conversation else labels
    return random_artifact(rng, tokens=64, page_tokens=16, labels=labelled, **LAYOUT)


def _size(rng: random.Random) -> int:
    """The page bytes of every artifact `_artifact` makes (what the bound counts)."""
    return sum(page_sizes(_artifact(rng).manifest).values())


def _open(path: Path, clock: Clock, **budget) -> Store:
    return Store(path, initial_map_bytes=1 << 22, min_free_bytes=0, clock=clock,
                 budget=CacheBudget(**budget))  # fmt: skip


def _commit(store, artifact, clock: Clock) -> str:
    clock.now += 1000  # each newer than the last
    return store.commit_artifact(artifact.manifest, page_records_of(artifact.pages)).artifact_id


def _held(store: Store) -> set[str]:
    return {aid for aid, _ in store.list_records(b"", 1000)}


def test_conversation_contexts_stay_within_their_bound_and_go_first(tmp_path, rng) -> None:
    """Ten conversation contexts into a bound of four: after each commit and the keeper's
    pass the three newest are left (85 % of four), and the deposits, older, all stay."""
    clock, size = Clock(), _size(rng)
    store = _open(tmp_path / "s", clock, conversation_bytes=4 * size)
    deposits = {_commit(store, _artifact(rng), clock) for _ in range(3)}
    chats = []
    for _ in range(10):
        chats.append(_commit(store, _artifact(rng, conversation=True), clock))
        assert store.evictor.conversation_totals()[1] <= 4 * size  # a commit keeps the bound
        store.evictor.evict_past_high()  # the keeper's pass, woken by the commit
        assert _held(store) == deposits | set(chats[-3:])
    assert store.evictor.conversation_totals() == (3, 3 * size)
    assert store.evictor.counters.artifacts == 7
    store.close()


@pytest.mark.parametrize("policy", ["lru", "cost-aware"])
def test_under_the_store_budget_conversations_go_first_whatever_the_policy(
    tmp_path, rng, policy: str
) -> None:
    """Deposits older than the conversation contexts and never reused; the contexts used
    since and reused from (what both policies would keep): a full store evicts every
    context before any deposit."""
    clock = Clock()
    store = _open(tmp_path / "s", clock, artifacts=6, policy=policy)
    deposits = {_commit(store, _artifact(rng), clock) for _ in range(3)}
    chats = [_commit(store, _artifact(rng, conversation=True), clock) for _ in range(3)]
    for chat in chats:
        clock.now += 1000
        with store.reading(chat, reused_tokens=64):  # its turn grafted by the next
            pass
    for _ in range(2):
        deposits.add(_commit(store, _artifact(rng), clock))
        store.evictor.evict_past_high()
    assert _held(store) == deposits
    store.close()


def test_pinned_contexts_stay_uncounted_and_a_read_one_is_never_cut(tmp_path, rng) -> None:
    clock, size = Clock(), _size(rng)
    store = _open(tmp_path / "s", clock, conversation_bytes=2 * size)
    pinned = _commit(store, _artifact(rng, conversation=True), clock)
    store.set_pinned(pinned, True)  # kept by its user: neither evicted nor counted
    read = _commit(store, _artifact(rng, conversation=True), clock)
    with store.reading(read):  # a graft of it under way
        newer = [_commit(store, _artifact(rng, conversation=True), clock) for _ in range(2)]
        store.evictor.evict_past_high()
        assert _held(store) == {pinned, read}  # the bound kept with what could go
    assert store.evictor.conversation_totals() == (1, size)
    latest = _commit(store, _artifact(rng, conversation=True), clock)
    store.evictor.evict_past_high()
    assert _held(store) == {pinned, latest}  # the read one, oldest, went once read
    assert not set(newer) & _held(store)
    store.close()


def test_the_kind_is_read_again_at_start(tmp_path, rng) -> None:
    clock, size = Clock(), _size(rng)
    store = _open(tmp_path / "s", clock, conversation_bytes=10 * size)
    for conversation in (True, True, False):
        _commit(store, _artifact(rng, conversation=conversation), clock)
    store.close()
    store = _open(tmp_path / "s", clock, conversation_bytes=10 * size)
    assert store.evictor.conversation_totals() == (2, 2 * size)
    store.close()


def test_tenants_contexts_go_first_in_their_budget_and_count_in_the_one_bound(
    tmp_path, rng
) -> None:
    """Alice's own budget evicts her conversation contexts before her deposits; the bound
    holds every owner's together (the operator's oldest context went for hers)."""
    clock, size = Clock(), _size(rng)
    store = _open(tmp_path / "s", clock, conversation_bytes=3 * size)
    operators = _commit(store, _artifact(rng, conversation=True), clock)
    alice = TenantView(store, "alice", CacheBudget(bytes=6 * size))
    deposits = {_commit(alice, _artifact(rng), clock) for _ in range(3)}  # her oldest
    hers = [_commit(alice, _artifact(rng, conversation=True), clock) for _ in range(2)]
    store.evictor.evict_past_high()  # the store's keeper: three contexts past 95 % of three
    assert _held(store) == deposits | set(hers)
    chat = _commit(alice, _artifact(rng, conversation=True), clock)  # her budget's sixth
    deposits.add(_commit(alice, _artifact(rng), clock))  # and a seventh: two of hers went
    assert _held(store) == deposits | {chat}
    assert all(store.get_record(a).manifest().labels[TENANT_LABEL] == "alice" for a in deposits)
    assert operators not in _held(store)
    store.close()


def test_a_published_context_is_kept_as_any_artifact(tmp_path, rng) -> None:
    """Publishing a conversation context shares it: the published copy has no conversation
    kind, so it is neither evicted first nor hidden by `kvgraft ls`; withdraw finds it."""
    clock = Clock()
    store = _open(tmp_path / "s", clock)
    alice = TenantView(store, "alice", CacheBudget())
    kept = _commit(alice, _artifact(rng, conversation=True), clock)
    shared = publish(alice, "alice", TrustPolicy(Signer.generate()), kept)
    labels = store.get_record(shared).manifest().labels
    assert KIND_LABEL not in labels and labels[TENANT_LABEL] == "alice"
    assert withdraw(alice, "alice", kept) == shared
    store.close()


def test_the_default_bound_is_the_store_budget_else_a_tenth_of_the_disk(tmp_path) -> None:
    tenth = shutil.disk_usage(tmp_path).total // 10
    assert conversation_budget(0, 0, tmp_path) == min(tenth, 4 << 30)
    assert conversation_budget(0, 5 << 30, tmp_path) == 5 << 30
    assert conversation_budget(123 << 20, 5 << 30, tmp_path) == 123 << 20


# ----------------------------------------------------------------------
# a real daemon: what cache = "auto" keeps (chat_cache's path too: a request's keep)

TINY = ["--model", "tiny:0", "--page-tokens", "16", "--block-tokens", "64"]


def test_a_daemon_keeps_its_automatic_contexts_within_the_bound(start_daemon) -> None:
    """Eight Generates of distinct prompts into a bound of three contexts: the keeper leaves
    the two newest (85 % of three), each labelled a conversation context; the deposit made
    first, older than all of them, stays."""
    daemon = start_daemon(extra_args=[*TINY, "--cache", "auto"])
    wait_model_ready(daemon.address)
    with Client(daemon.address) as client:
        probe = client.generate(token_ids=list(range(400, 440)), max_new_tokens=4)
        size = client.stat(probe.deposited_artifact_id).info.page_bytes
    daemon.stop()
    daemon = start_daemon(
        extra_args=[*TINY, "--cache", "auto", "--conversation-budget-bytes", str(3 * size)]
    )
    wait_model_ready(daemon.address)
    assert f"kept within {3 * size} bytes" in daemon.log()
    with Client(daemon.address) as client:
        deposit = client.deposit(token_ids=list(range(300, 340))).artifact_id
        kept = []
        for n in range(8):  # 40 tokens each, none a prefix of another: a size each
            prompt = [n, *range(10 + 40 * n, 49 + 40 * n)]
            kept.append(client.generate(token_ids=prompt, max_new_tokens=4).deposited_artifact_id)
        assert all(kept) and client.info().cache.auto_deposits == 8
        deadline = time.monotonic() + 30
        while (held := {i.artifact_id for i in client.list_artifacts()}) != {deposit, *kept[-2:]}:
            assert time.monotonic() < deadline, f"held {len(held)}: {held}"
            time.sleep(0.05)
        labels = {i.artifact_id: dict(i.labels) for i in client.list_artifacts()}
    assert labels == {deposit: {}, **{a: {KIND_LABEL: "conversation"} for a in kept[-2:]}}
    assert "Traceback" not in daemon.log()


def test_a_daemon_bounds_them_by_default(start_daemon) -> None:
    daemon = start_daemon()
    tenth = shutil.disk_usage(daemon.data_dir).total // 10
    assert f"kept within {min(tenth, 4 << 30)} bytes (conversation_budget_bytes)" in daemon.log()
