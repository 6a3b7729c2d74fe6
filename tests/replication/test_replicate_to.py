"""`Client.replicate_to` asks the target to pull first, and relays when it will not.

* A target whose `[replication] pull_from` names the source pulls (the summary's mode is
  "pull"), given as a Client or an address; it then holds the same artifacts, byte for
  byte. `pull=False`, or an option only a relay serves, relays.
* A target that does not allow the source refuses the pull (FAILED_PRECONDITION naming
  pull_from): `pull=True` raises it and changes nothing; by default replicate_to falls back
  to relaying (mode "relay") and the target holds the same artifacts.
* The summary's mode is client-side: to_proto/from_proto carry every other field.
"""

from __future__ import annotations

import pytest

from kvgraft import Client
from kvgraft.errors import FailedPrecondition, InvalidArgument
from kvgraft.replication.summary import ReplicationSummary
from tests.support.factory import random_artifact
from tests.support.replica_audit import divergent_artifacts, ids


def _filled_source(start_daemon, rng, count: int = 3):
    source = start_daemon()
    artifacts = [random_artifact(rng) for _ in range(count)]
    with Client(source.address) as a:
        for artifact in artifacts:
            a.put_artifact(artifact)
    return source, artifacts


def test_a_target_that_allows_it_pulls(start_daemon, rng) -> None:
    source, artifacts = _filled_source(start_daemon, rng)
    replica = start_daemon(extra_args=["--replication-pull-from", source.address])
    with Client(source.address) as a, Client(replica.address) as b:
        summary = a.replicate_to(b)
        assert (summary.mode, summary.artifacts_added, summary.artifacts_failed) == ("pull", 3, 0)
        assert (summary.source, summary.target) == (source.address, replica.address)
        assert ids(b) == ids(a) == {artifact.id for artifact in artifacts}
        assert divergent_artifacts(a, b) == []  # manifests and page bytes, hashes checked
        one = artifacts[0]
        pulled = b.get_artifact(one.id, check_sha256=True)
        assert {d: bytes(p) for d, p in pulled.pages.items()} == {
            d: bytes(p) for d, p in one.pages.items()
        }

        again = a.replicate_to(replica.address)  # an address: opened, pulled, closed
        assert (again.mode, again.artifacts_added, again.artifacts_present) == ("pull", 0, 3)

        extra = random_artifact(rng)
        a.put_artifact(extra)
        relayed = a.replicate_to(b, pull=False)
        assert (relayed.mode, relayed.artifacts_added) == ("relay", 1)
        assert a.replicate_to(b, workers=1).mode == "relay"  # only a relay has workers
        with pytest.raises(InvalidArgument, match="follow need a relay"):
            a.replicate_to(b, pull=True, follow=True)
        assert divergent_artifacts(a, b) == []


def test_a_target_that_refuses_the_pull_is_relayed_to(start_daemon, rng) -> None:
    source, artifacts = _filled_source(start_daemon, rng)
    replica = start_daemon()  # no [replication] pull_from
    with Client(source.address) as a, Client(replica.address) as b:
        with pytest.raises(FailedPrecondition, match=r"\[replication\] pull_from"):
            a.replicate_to(b, pull=True)
        assert not ids(b)

        summary = a.replicate_to(b)
        assert (summary.mode, summary.artifacts_added, summary.artifacts_failed) == ("relay", 3, 0)
        assert (summary.source, summary.target) == (source.address, replica.address)
        assert ids(b) == {artifact.id for artifact in artifacts}
        assert divergent_artifacts(a, b) == []


def test_the_mode_stays_client_side() -> None:
    summary = ReplicationSummary(source="a:1", target="b:2", artifacts_added=2, mode="pull")
    back = ReplicationSummary.from_proto(summary.to_proto())
    assert back.mode == "relay"  # the default: the caller sets it
    back.mode = "pull"
    assert back == summary
