"""Tenants on a store-only daemon: ownership, no existence oracle, pages told per owner,
budgets within a tenant, publishing, the operator, replication (kvgraft.tenancy).

Each test runs real daemons in their own processes, configured with [tenants.NAME]
tables (kvgraftd.testing.tenants); alice's artifacts are random ones labelled as
hers, so their ids are what she computed.
"""

from __future__ import annotations

import random
from pathlib import Path

import grpc
import pytest

from kvgraft import Client, wire
from kvgraft.errors import InvalidArgument, KvgraftError, NotFound, PermissionDenied
from kvgraft.tenancy import SHARED_LABEL, TENANT_LABEL
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.testing.daemon_process import DaemonProcess
from kvgraftd.testing.tenants import write_tenants
from tests.support.factory import random_artifact
from tests.support.metrics_scrape import labelled_metrics
from tests.support.store_audit import assert_served_whole

PUT_ARTIFACT = "/kvgraft.v1.Kvgraft/PutArtifact"


def artifact_of(rng: random.Random, tenant: str, **kwargs):
    return random_artifact(rng, labels={TENANT_LABEL: tenant, "doc": "x"}, **kwargs)


@pytest.fixture
def tenants(tmp_path: Path):
    """A store-only daemon with tenants alice (a budget of her own) and bob; clients."""
    config, tokens = write_tenants(
        tmp_path / "etc", {"alice": {"store_budget_bytes": 40_000}, "bob": {}}
    )
    daemon = DaemonProcess.start(tmp_path / "data", ["--config", str(config)])
    clients = {name: Client(daemon.address, token_file=path) for name, path in tokens.items()}
    yield daemon, clients, tokens
    for client in clients.values():
        client.close()
    daemon.stop()


def refusal(call) -> KvgraftError:
    with pytest.raises(KvgraftError) as caught:
        call()
    return caught.value


def test_another_tenants_id_answers_exactly_as_an_id_nobody_stored(tenants) -> None:
    _, c, _ = tenants
    rng = random.Random(1)
    mine = artifact_of(rng, "alice")
    c["alice"].put_artifact(mine)
    unknown = f"{rng.getrandbits(256):064x}"
    calls = {
        "stat": lambda client, aid: client.stat(aid),
        "delete": lambda client, aid: client.delete(aid),
        "pin": lambda client, aid: client.pin(aid),
        "export": lambda client, aid: client.get_artifact(aid),
        "publish": lambda client, aid: client.publish(aid),
        "withdraw": lambda client, aid: client.publish(aid, withdraw=True),
    }
    for name, call in calls.items():
        for length in (64, 16, 8):  # the whole id and prefixes of it
            theirs = refusal(lambda: call(c["bob"], mine.id[:length]))  # noqa: B023
            nobodys = refusal(lambda: call(c["bob"], unknown[:length]))  # noqa: B023
            assert type(theirs) is type(nobodys) is NotFound, (name, theirs, nobodys)
            assert str(theirs).replace(mine.id[:length], "ID") == str(nobodys).replace(
                unknown[:length], "ID"
            ), name
    # alice's artifact is untouched, and served to her whole
    assert c["alice"].stat(mine.id).info.pinned is False
    assert_served_whole(c["alice"].get_artifact(mine.id), mine)


def test_listings_pages_and_figures_answer_about_the_callers_own(tenants) -> None:
    _, c, _ = tenants
    rng = random.Random(2)
    hers, his = artifact_of(rng, "alice"), artifact_of(rng, "bob")
    c["alice"].put_artifact(hers)
    c["bob"].put_artifact(his)
    pages = list(hers.pages)
    assert [i.artifact_id for i in c["bob"].list_artifacts()] == [his.id]
    assert [i.artifact_id for i in c["alice"].list_artifacts()] == [hers.id]
    assert {i.artifact_id for i in c["operator"].list_artifacts()} == {hers.id, his.id}
    assert set(c["bob"].missing_pages(pages)) == set(pages)  # only alice holds them
    assert c["alice"].missing_pages(pages) == []
    assert c["operator"].missing_pages(pages) == []
    assert c["bob"].stats().artifacts == 1 and c["alice"].stats().artifacts == 1
    assert c["operator"].stats().artifacts == 2
    info = c["bob"].info()
    assert (info.tenant, list(info.tenants)) == ("bob", [])
    assert list(c["operator"].info().tenants) == ["alice", "bob"]


def test_an_upload_brings_every_page_only_another_tenant_holds(tenants) -> None:
    daemon, c, tokens = tenants
    rng = random.Random(3)
    hers = artifact_of(rng, "alice", num_layers=2, tokens=40, page_tokens=16)
    c["alice"].put_artifact(hers)
    manifest = pb.Manifest.FromString(hers.manifest.SerializeToString())
    manifest.labels[TENANT_LABEL] = "bob"
    # a manifest naming alice's pages without sending them fails as for pages nobody stored
    other = pb.Manifest.FromString(manifest.SerializeToString())
    other.labels["doc"] = "another"
    other.labels[TENANT_LABEL] = "carol-not-a-tenant"  # relabelled to bob's on the way in
    token = "Bearer " + tokens["bob"].read_text().strip()
    with grpc.insecure_channel(daemon.address) as channel:
        put = channel.stream_unary(PUT_ARTIFACT)
        with pytest.raises(grpc.RpcError) as caught:
            put(
                iter([wire.encode_put_manifest(other.SerializeToString())]),
                metadata=[("authorization", token)],
            )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is neither stored nor sent" in caught.value.details()
    # bob's artifact holds the same pages: he is told to send them all, and the
    # answer says he wrote them all, as if nobody held them
    copy = type(hers)(manifest, hers.pages)
    response = c["bob"].put_artifact(copy)
    assert response.pages_written == len(set(hers.manifest.page_sha256))
    assert response.bytes_written == sum(len(p) for p in hers.pages.values())


def test_an_upload_labelled_for_another_tenant_is_stored_as_the_callers(tenants) -> None:
    _, c, _ = tenants
    forged = artifact_of(random.Random(4), "alice")
    response = c["bob"].put_artifact(forged)
    assert response.artifact_id != forged.id  # relabelled: another manifest, another id
    info = c["bob"].stat(response.artifact_id).info
    assert info.labels[TENANT_LABEL] == "bob" and info.labels["doc"] == "x"
    assert list(c["alice"].list_artifacts()) == []
    with pytest.raises(NotFound):
        c["alice"].stat(response.artifact_id)


def test_budgets_evict_within_a_tenant_only(tenants) -> None:
    _, c, _ = tenants
    rng = random.Random(5)
    shape = {"num_layers": 2, "kv_heads": 2, "head_dim": 32, "kv_dtype": pb.KV_DTYPE_FLOAT32}
    his = [artifact_of(rng, "bob", tokens=64, page_tokens=64, **shape) for _ in range(4)]
    for artifact in his:  # bob has no budget of his own: 4 x 32 KiB
        c["bob"].put_artifact(artifact)
    hers = [artifact_of(rng, "alice", tokens=32, page_tokens=32, **shape) for _ in range(6)]
    for artifact in hers:  # 16 KiB each against her 40,000 bytes
        c["alice"].put_artifact(artifact)
    kept = {i.artifact_id for i in c["alice"].list_artifacts()}
    assert kept and kept < {a.id for a in hers}
    assert hers[-1].id in kept  # the newest stays: least recently used go first
    assert sum(len(p) for a in hers if a.id in kept for p in a.pages.values()) <= 40_000
    assert {i.artifact_id for i in c["bob"].list_artifacts()} == {a.id for a in his}
    assert c["alice"].info().cache.budget_bytes == 40_000
    assert c["bob"].info().cache.budget_bytes == 0


def test_metrics_are_labelled_by_tenant(tmp_path: Path) -> None:
    config, tokens = write_tenants(tmp_path / "etc", {"alice": {"store_budget_bytes": "1MB"}})
    daemon = DaemonProcess.start(
        tmp_path / "data", ["--config", str(config), "--metrics-listen", "127.0.0.1:0"]
    )
    try:
        with Client(daemon.address, token_file=tokens["alice"]) as alice:
            artifact = artifact_of(random.Random(8), "alice")
            alice.put_artifact(artifact)
            list(alice.list_artifacts())
        figures = labelled_metrics(daemon)
        assert figures["kvgraft_tenant_artifacts", (("tenant", "alice"),)] == 1
        page_bytes = sum(len(p) for p in artifact.pages.values())
        assert figures["kvgraft_tenant_page_bytes", (("tenant", "alice"),)] == page_bytes
        assert figures["kvgraft_tenant_budget_bytes", (("tenant", "alice"),)] == 1_000_000
        calls = figures["kvgraft_tenant_calls_total", (("method", "List"), ("tenant", "alice"))]
        assert calls == 1
    finally:
        daemon.stop()


def test_a_published_artifact_is_read_by_all_and_changed_by_its_owner(tenants) -> None:
    _, c, _ = tenants
    rng = random.Random(6)
    hers = artifact_of(rng, "alice")
    c["alice"].put_artifact(hers)
    shared = c["alice"].publish(hers.id[:16])
    assert shared.labels[SHARED_LABEL] == "true" and shared.labels[TENANT_LABEL] == "alice"
    assert shared.artifact_id != hers.id
    assert [i.artifact_id for i in c["bob"].list_artifacts()] == [shared.artifact_id]
    fetched = c["bob"].get_artifact(shared.artifact_id)
    assert {d: bytes(p) for d, p in fetched.pages.items()} == {
        d: bytes(p) for d, p in hers.pages.items()
    }
    for call in (
        lambda: c["bob"].delete(shared.artifact_id),
        lambda: c["bob"].pin(shared.artifact_id),
        lambda: c["bob"].publish(shared.artifact_id, withdraw=True),
    ):
        error = refusal(call)
        assert isinstance(error, PermissionDenied) and "only its owner" in str(error)
    with pytest.raises(NotFound):  # the one it was published from stays hers alone
        c["bob"].stat(hers.id)
    # its uses are every tenant's: its owner sees them, the others do not
    assert c["alice"].stat(shared.artifact_id).info.last_used_unix_ms > 0  # bob's export
    seen = c["bob"].stat(shared.artifact_id).info
    assert (seen.last_used_unix_ms, seen.reused_tokens) == (0, 0)
    withdrawn = c["alice"].publish(hers.id, withdraw=True)
    assert withdrawn.artifact_id == shared.artifact_id
    assert list(c["bob"].list_artifacts()) == []
    with pytest.raises(NotFound, match="not published"):
        c["alice"].publish(hers.id, withdraw=True)


def test_the_operators_rpcs_are_refused_to_tenants(tenants) -> None:
    _, c, _ = tenants
    for call in (
        lambda: list(c["bob"].watch()),
        lambda: c["bob"].scrub(),
        lambda: c["bob"].remote_status(),
    ):
        error = refusal(call)
        assert isinstance(error, PermissionDenied) and "operator" in str(error)
    assert c["operator"].scrub().pages_done == 0  # the operator's are served
    assert list(c["operator"].watch()) == []


def test_replication_keeps_each_artifacts_tenant(tmp_path: Path) -> None:
    config, tokens = write_tenants(tmp_path / "etc", {"alice": {}, "bob": {}})
    source = DaemonProcess.start(tmp_path / "a", ["--config", str(config)])
    replica = DaemonProcess.start(tmp_path / "b", ["--config", str(config)])
    try:
        rng = random.Random(7)
        hers, his = artifact_of(rng, "alice"), artifact_of(rng, "bob")
        with Client(source.address, token_file=tokens["alice"]) as alice:
            alice.put_artifact(hers)
        with Client(source.address, token_file=tokens["bob"]) as bob:
            bob.put_artifact(his)
            with pytest.raises(PermissionDenied):  # replication is the operator's
                bob.replicate_to(replica.address, client_options={"token_file": tokens["bob"]})
        with Client(source.address, token_file=tokens["operator"]) as operator:
            summary = operator.replicate_to(
                replica.address, client_options={"token_file": tokens["operator"]}
            )
        assert summary.artifacts_added == 2
        with Client(replica.address, token_file=tokens["alice"]) as alice:
            assert [i.artifact_id for i in alice.list_artifacts()] == [hers.id]
            assert_served_whole(alice.get_artifact(hers.id), hers)
        with Client(replica.address, token_file=tokens["bob"]) as bob:
            assert [i.artifact_id for i in bob.list_artifacts()] == [his.id]
            with pytest.raises(NotFound):
                bob.stat(hers.id)
            assert set(bob.missing_pages(list(hers.pages))) == set(hers.pages)
    finally:
        source.stop()
        replica.stop()


def test_tenant_configuration_is_checked_before_the_daemon_starts(tmp_path: Path) -> None:
    import subprocess
    import sys

    config, tokens = write_tenants(tmp_path / "etc", {"alice": {}})
    no_operator = tmp_path / "no-operator.toml"
    no_operator.write_text(config.read_text().split("\n", 1)[1])  # token_file line dropped
    same = tmp_path / "same.toml"
    same.write_text(config.read_text().replace(str(tokens["alice"]), str(tokens["operator"])))
    bad_name = tmp_path / "bad-name.toml"
    bad_name.write_text(config.read_text().replace("[tenants.alice]", "[tenants.Shared]"))
    for path, words in (
        (no_operator, "need the operator's token_file"),
        (same, "hold the same token"),
        (bad_name, "cannot name a tenant"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "kvgraftd", "--config", str(path), "--data", str(tmp_path / "d"),
             "--model", "none"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, (path, done.stderr)
        assert words in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_invalid_tenant_input_is_refused_by_name(tenants) -> None:
    _, c, _ = tenants
    with pytest.raises(InvalidArgument, match="not an artifact id"):
        c["bob"].publish("zz")


def test_a_tenant_is_shown_no_change_feed_sequence(tenants) -> None:
    """Regression: ArtifactInfo.sequence numbered a tenant's artifacts in the store-wide
    feed, so two of bob's told him how many changes alice made between them."""
    _, c, _ = tenants
    rng = random.Random(9)
    first = c["bob"].put_artifact(artifact_of(rng, "bob")).artifact_id
    small = {"num_layers": 1, "kv_heads": 1, "head_dim": 8, "tokens": 4, "page_tokens": 4}
    for _ in range(3):
        c["alice"].put_artifact(artifact_of(rng, "alice", **small))
    second = c["bob"].put_artifact(artifact_of(rng, "bob")).artifact_id
    shown = {i.artifact_id: i.sequence for i in c["bob"].list_artifacts()}
    assert shown == {first: 0, second: 0}
    assert c["bob"].stat(second).info.sequence == 0
    operator = [c["operator"].stat(aid).info.sequence for aid in (first, second)]
    assert operator[1] - operator[0] == 4  # the operator's feed numbers them
