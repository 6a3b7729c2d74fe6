"""The store as a cache across real daemons: pins that expire reach a follower, evictions
do not, and a scrub's quarantine is repaired by a pull from a replica (through the CLI)
or a relay, which names what it repaired and leaves deleted what expired on the target.

Each daemon is its own process on a temporary store (store only: no model).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from kvgraft import Client
from kvgraft.errors import InvalidArgument
from kvgraft.v1 import kvgraft_pb2 as pb
from tests.support.factory import random_artifact
from tests.support.on_disk import flip_stored_page
from tests.support.replica_audit import divergent_artifacts, ids, wait_until

STORE_ONLY = ["--model", "none"]


def _follower(start_daemon, tmp_path, source, *extra: str):
    config = tmp_path / "follower.toml"
    config.write_text(f'[replication]\nfollow = ["{source.address}"]\n')
    return start_daemon(extra_args=[*STORE_ONLY, "--config", str(config), *extra])


def test_an_expired_pin_is_deleted_and_the_follower_deletes_its_copy(
    start_daemon, tmp_path, rng
) -> None:
    source = start_daemon(extra_args=STORE_ONLY)
    follower = _follower(start_daemon, tmp_path, source)
    with Client(source.address) as a, Client(follower.address) as b:
        short, kept = random_artifact(rng), random_artifact(rng)
        a.put_artifact(short)
        a.put_artifact(kept)
        wait_until(lambda: ids(b) == ids(a), "the replica holds both")
        with pytest.raises(InvalidArgument, match="a TTL goes with a pin"):
            a.pin(short.id, pinned=False, ttl_s=2)
        info = a.pin(short.id, ttl_s=2)
        assert info.pinned and info.pin_expires_unix_ms > time.time() * 1000
        a.pin(kept.id)
        time.sleep(1.0)
        assert short.id in ids(a)  # not before its time
        wait_until(lambda: short.id not in ids(a), "the pin expires", timeout_s=15)
        deleted = [r for r in a.watch(1) if r.kind == pb.ChangeRecord.KIND_DELETED]
        assert [(r.artifact_id, r.reason) for r in deleted] == [
            (short.id, pb.ChangeRecord.REASON_EXPIRED)
        ]
        wait_until(lambda: ids(b) == {kept.id}, "the follower deletes its copy")
        assert a.info().cache.expired_artifacts == 1


def test_evictions_stay_on_the_source(start_daemon, tmp_path, rng) -> None:
    """The source's budget evicts; a follower with room keeps its copies."""
    source = start_daemon(extra_args=[*STORE_ONLY, "--store-budget-artifacts", "4"])
    follower = _follower(start_daemon, tmp_path, source)
    with Client(source.address) as a, Client(follower.address) as b:
        first = [random_artifact(rng) for _ in range(3)]
        for artifact in first:
            a.put_artifact(artifact)
        wait_until(lambda: ids(b) == ids(a), "the follower holds the first three")
        later = [random_artifact(rng) for _ in range(4)]
        for artifact in later:
            a.put_artifact(artifact)
        wait_until(lambda: len(ids(a)) <= 4, "the source evicts down to its budget")
        marker = random_artifact(rng)
        a.put_artifact(marker)  # after the evictions in the feed
        wait_until(lambda: marker.id in ids(b), "the follower reads past the evictions")
        evicted = [r for r in a.watch(1) if r.kind == pb.ChangeRecord.KIND_DELETED]
        assert evicted and {r.reason for r in evicted} == {pb.ChangeRecord.REASON_EVICTED}
        assert {x.id for x in first} <= ids(b)  # copied before the evictions: kept
        assert a.info().cache.evicted_artifacts == len(evicted)


def _cli(address: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "kvgraft", "--server", address, "--json", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def _expire(client: Client, artifact_id: str) -> None:
    """Pin with a TTL and wait for the keeper to delete it (reason `expired`)."""
    client.pin(artifact_id, ttl_s=1)
    wait_until(lambda: artifact_id not in ids(client), "the pin expires", timeout_s=15)


def test_scrub_quarantines_and_a_pull_from_a_replica_repairs(start_daemon, tmp_path, rng) -> None:
    good = start_daemon(extra_args=STORE_ONLY)
    config = tmp_path / "damaged.toml"
    config.write_text(f'[replication]\npull_from = ["{good.address}"]\n')
    damaged = start_daemon(extra_args=[*STORE_ONLY, "--config", str(config)])
    artifacts = [random_artifact(rng) for _ in range(4)]
    with Client(good.address) as a, Client(damaged.address) as b:
        for artifact in artifacts:
            a.put_artifact(artifact)
            b.put_artifact(artifact)
        expired = artifacts[0]
        _expire(b, expired.id)  # was: the repairing pull below brought it back
        victim = artifacts[2]
        page = victim.pages[victim.manifest.page_sha256[-1]]
        assert flip_stored_page(damaged.data_dir / "store", page) == 1

        scrub = _cli(damaged.address, "scrub")
        assert scrub.returncode == 1, scrub.stderr  # corrupt pages found
        found = json.loads(scrub.stdout)
        assert found["corrupt_pages"] == [victim.manifest.page_sha256[-1].hex()]
        assert found["quarantined"] == [victim.id]
        listing = json.loads(_cli(damaged.address, "ls").stdout)["artifacts"]
        assert {i["artifact_id"] for i in listing if i.get("quarantined")} == {victim.id}
        assert b.info().cache.quarantined_artifacts == 1
        assert b.info().scrub.done and b.info().scrub.pages_done == b.stats().pages + 1

        summary = b.pull_from(good.address)
        assert summary.pages_written == 1  # the quarantined artifact's missing page, only
        assert list(summary.repaired) == [victim.id] and summary.artifacts_repaired == 1
        assert summary.expired_not_restored == 1
        assert not b.stat(victim.id).info.quarantined
        assert ids(b) == ids(a) - {expired.id}
        assert divergent_artifacts(a, b) == [expired.id]  # on the source only
        again = _cli(damaged.address, "scrub")
        assert again.returncode == 0 and json.loads(again.stdout)["corrupt_pages"] == []


def test_a_relay_repairs_names_what_it_repaired_and_leaves_expired_pins_deleted(
    start_daemon, rng
) -> None:
    """Was: a pass that repaired a quarantined artifact also copied back what the target's
    TTL pins had deleted (the source still lists it), and its summary did not say what it
    repaired. An expired pin stays deleted until the source adds the artifact again."""
    source, target = start_daemon(extra_args=STORE_ONLY), start_daemon(extra_args=STORE_ONLY)
    artifacts = [random_artifact(rng) for _ in range(3)]
    expired, first_victim, second_victim = artifacts
    relay = ["replicate", "--from", source.address, "--to", target.address]

    def quarantine(victim) -> None:
        page = victim.pages[victim.manifest.page_sha256[0]]
        assert flip_stored_page(target.data_dir / "store", page) == 1
        assert _cli(target.address, "scrub").returncode == 1  # found: quarantined

    with Client(source.address) as a, Client(target.address) as b:
        for artifact in artifacts:
            a.put_artifact(artifact)
        assert json.loads(_cli(source.address, *relay).stdout)["artifacts_added"] == 3
        _expire(b, expired.id)
        quarantine(first_victim)

        repair = _cli(source.address, *relay)
        assert repair.returncode == 0, repair.stderr
        summary = json.loads(repair.stdout)
        assert (summary["artifacts_added"], summary["artifacts_present"]) == (0, 1)
        assert (summary["artifacts_repaired"], summary["repaired"]) == (1, [first_victim.id])
        assert summary["expired_not_restored"] == 1
        assert not b.stat(first_victim.id).info.quarantined
        assert ids(b) == ids(a) - {expired.id}

        quarantine(second_victim)
        text = subprocess.run(
            [sys.executable, "-m", "kvgraft", *relay], capture_output=True, text=True, timeout=120
        ).stdout
        assert "0 added, 1 repaired, 1 already there" in text
        assert "1 not copied back (their pin expired here)" in text
        assert f"repaired {second_victim.id}" in text
        assert not b.stat(second_victim.id).info.quarantined

        a.delete(expired.id)
        a.put_artifact(expired)  # added again on the source, after the expiry: copied
        again = json.loads(_cli(source.address, *relay).stdout)
        assert (again["artifacts_added"], again["expired_not_restored"]) == (1, 0)
        assert ids(b) == ids(a)
        assert divergent_artifacts(a, b) == []
