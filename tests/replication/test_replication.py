"""Replication between two real daemons (separate processes, separate stores), no faults.

* 100 artifacts of varied geometry (shared pages, multi-message artifacts,
  pages larger than one message) replicated A -> B: every artifact's exported
  bundle is byte-identical on both, B's store holds exactly them (counters,
  reference counts, change feed), and a second replication moves nothing.
* Deletes propagate, except onto an artifact pinned on the replica.
* Two sources replicated into one target at once leave one copy of each.
* `kvgraft replicate` prints the summary (text and --json).
* A graft on the replica: the same prompt generates with the same receipt
  hashes on source and replica, reusing the replicated pages.
"""

from __future__ import annotations

import json
import random
import threading

import pytest

from kvgraft import Artifact, Client
from kvgraft.cli.main import main as cli_main
from kvgraft.errors import FailedPrecondition
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.testing.daemon_process import wait_model_ready
from tests.support.factory import random_artifact
from tests.support.replica_audit import divergent_artifacts, export_digests, ids
from tests.support.store_audit import (
    audit_store,
    big_page_artifact,
    derived_artifact,
    distinct_page_sizes,
    multi_mib_artifact,
)


def corpus(rng: random.Random, count: int) -> list[Artifact]:
    """`count` artifacts: mostly small and random, some sharing pages, a few large."""
    artifacts: list[Artifact] = []
    for index in range(count):
        if index % 10 == 3 and artifacts:
            artifacts.append(derived_artifact(rng, rng.choice(artifacts)))
        elif index == 17:
            artifacts.append(multi_mib_artifact(rng))
        elif index == 41:
            artifacts.append(big_page_artifact(rng))
        else:
            artifacts.append(random_artifact(rng))
    return artifacts


def test_hundred_artifacts_replicate_byte_identical(start_daemon, rng, tmp_path) -> None:
    source, replica = start_daemon(), start_daemon()
    artifacts = corpus(rng, 100)
    with Client(source.address) as a, Client(replica.address) as b:
        for artifact in artifacts:
            a.put_artifact(artifact)
        a.pin(artifacts[5].id)  # pins are the replica operator's: not replicated

        summary = a.replicate_to(b)
        assert (summary.artifacts_added, summary.artifacts_failed) == (100, 0)
        assert summary.last_sequence == a.stats().last_sequence == 100
        distinct = distinct_page_sizes(artifacts)
        # Concurrent copies of two artifacts sharing pages may both send them.
        assert summary.bytes_moved >= sum(distinct.values())
        assert summary.pages_resent == summary.retries == 0

        expected = {artifact.id: artifact for artifact in artifacts}
        audit_store(b, expected)  # exactly these, whole; counters, refs and feed agree
        assert not b.stat(artifacts[5].id).info.pinned
        on_source = export_digests(a, set(expected), tmp_path / "a")
        assert export_digests(b, set(expected), tmp_path / "b") == on_source

        sequence = b.stats().last_sequence
        again = b.replicate_from(a)
        assert (again.artifacts_added, again.artifacts_present) == (0, 100)
        assert (again.bytes_moved, again.pages_written) == (0, 0)
        assert b.stats().last_sequence == sequence  # nothing was written


def test_deletes_propagate_and_pins_on_the_replica_win(start_daemon, rng) -> None:
    source, replica = start_daemon(), start_daemon()
    artifacts = [random_artifact(rng) for _ in range(6)]
    first, second, third = artifacts[:3]
    with Client(source.address) as a, Client(replica.address) as b:
        for artifact in artifacts:
            a.put_artifact(artifact)
        a.replicate_to(b)
        a.delete(first.id)
        a.delete(second.id)
        b.pin(second.id)
        a.delete(third.id)
        a.put_artifact(third)  # deleted, then stored again: the replica keeps it

        summary = a.replicate_to(b)
        assert (summary.artifacts_deleted, summary.deletes_kept_pinned) == (1, 1)
        assert ids(b) == ids(a) | {second.id}
        assert b.stat(second.id).info.pinned

        b.pin(second.id, pinned=False)
        assert a.replicate_to(b).artifacts_deleted == 1
        assert ids(b) == ids(a)
        assert divergent_artifacts(a, b) == []


def test_two_sources_at_once_leave_one_copy(start_daemon, rng) -> None:
    first, second, target = start_daemon(), start_daemon(), start_daemon()
    shared = [multi_mib_artifact(rng) for _ in range(3)]
    derived = [derived_artifact(rng, parent, share=0.8) for parent in shared]
    own_first = [random_artifact(rng) for _ in range(8)]
    own_second = [random_artifact(rng) for _ in range(8)]
    with (
        Client(first.address) as a1,
        Client(second.address) as a2,
        Client(target.address) as b,
    ):
        for artifact in [*shared, *own_first, *derived[:2]]:
            a1.put_artifact(artifact)
        for artifact in [*shared, *own_second, *derived[1:]]:
            a2.put_artifact(artifact)
        summaries = []
        threads = [
            threading.Thread(target=lambda s=src: summaries.append(s.replicate_to(b)))
            for src in (a1, a2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert [s.artifacts_failed for s in summaries] == [0, 0]
        union = [*shared, *own_first, *own_second, *derived]
        audit_store(b, {artifact.id: artifact for artifact in union})
        assert sum(s.artifacts_added for s in summaries) == len(union)


def test_cli_replicate_prints_a_summary(start_daemon, rng, capsys) -> None:
    source, replica = start_daemon(), start_daemon()
    artifacts = [random_artifact(rng) for _ in range(4)]
    with Client(source.address) as a, Client(replica.address) as b:
        for artifact in artifacts:
            a.put_artifact(artifact)
        argv = ["--json", "replicate", "--from", source.address, "--to", replica.address]
        assert cli_main(argv) == 0
        document = json.loads(capsys.readouterr().out)
        page_bytes = sum(distinct_page_sizes(artifacts).values())
        assert document["artifacts_added"] == 4
        assert document["bytes_moved"] == page_bytes
        assert document["last_sequence"] == 4
        assert ids(b) == {artifact.id for artifact in artifacts}

        a.delete(artifacts[0].id)
        argv = ["replicate", "--from", source.address, "--to", replica.address]
        assert cli_main(argv) == 0
        text = capsys.readouterr().out
        assert "0 added, 0 repaired, 3 already there, 1 deleted" in text
        assert "applied up to sequence 5" in text
        assert ids(b) == ids(a)


def test_cli_replicate_needs_a_target_other_than_its_source(start_daemon, rng, capsys) -> None:
    """Regression: `kvgraft replicate --from A` with no --to copied A onto the default
    daemon, which may be A itself, and reported success."""
    source = start_daemon(extra_args=["--replication-pull-from", "*"])
    with Client(source.address) as a:
        a.put_artifact(random_artifact(rng))
    port = source.address.rsplit(":", 1)[1]
    with pytest.raises(SystemExit) as exited:
        cli_main(["--server", source.address, "replicate", "--from", source.address])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "usage: kvgraft replicate" in err and "give --to ADDR" in err
    # another name for the same daemon: refused by its instance id, through the caller or
    # by the daemon asked to pull (which pulls from what it reaches as 127.0.0.1)
    for argv, says in (
        (["replicate", "--from", source.address, "--to", f"localhost:{port}"], "same daemon"),
        (
            ["replicate", "--from", f"localhost:{port}", "--to", source.address, "--pull"],
            "is this daemon itself",
        ),
    ):
        assert cli_main(argv) == 1
        assert says in capsys.readouterr().err
    with Client(source.address) as a, pytest.raises(FailedPrecondition, match="same daemon"):
        a.replicate_to(f"localhost:{port}")
    with Client(source.address) as a:
        assert len(list(a.list_artifacts())) == 1  # nothing was touched


TINY = ["--model", "tiny:0", "--page-tokens", "16", "--block-tokens", "64"]


def test_replica_generates_with_replicated_pages(start_daemon, rng) -> None:
    """A replica that trusts the source's key grafts what it replicates at once, with the
    source's receipt hashes; the receipt names the artifact and the key that vouched."""
    prefix_tokens = 100  # 6 whole pages of 16 tokens, and a partial one
    source = start_daemon(extra_args=TINY)
    with Client(source.address) as a:
        key = a.info().signing_key
    replica = start_daemon(extra_args=[*TINY, "--trust-keys", key.hex()])
    wait_model_ready(source.address)
    wait_model_ready(replica.address)
    prefix = [rng.randrange(512) for _ in range(prefix_tokens)]
    suffix = [rng.randrange(512) for _ in range(7)]
    options = {"max_new_tokens": 5}
    with Client(source.address) as a, Client(replica.address) as b:
        assert a.info().model_fingerprint == b.info().model_fingerprint
        deposited = a.deposit(token_ids=prefix).artifact_id
        assert b.lookup(prefix).matched_tokens == 0
        summary = a.replicate_to(b)
        assert summary.artifacts_added == 1
        matched = b.lookup(prefix).matched_tokens  # the tail page too, on row-invariant products
        assert matched in (prefix_tokens, prefix_tokens // 16 * 16) and matched > 0
        assert (matched == prefix_tokens) == bool(b.info().profile.products)
        provenance = b.stat(deposited).info.provenance
        assert provenance.trust == pb.Provenance.TRUST_SIGNED and provenance.vouched_by == key

        on_source = a.generate(token_ids=prefix + suffix, **options).receipt
        on_replica = b.generate(token_ids=prefix + suffix, **options).receipt
        fresh = b.generate(token_ids=prefix + suffix, no_cache=True, **options)
        assert on_replica.reused_tokens == on_source.reused_tokens > 0
        [grafted] = on_replica.raw.grafted
        assert (grafted.artifact_id, grafted.tokens) == (deposited, on_replica.reused_tokens)
        assert (grafted.trust, grafted.vouched_by) == (pb.Provenance.TRUST_SIGNED, key)
        for receipt in (on_replica, fresh.receipt):
            assert receipt.input_sha256 == on_source.input_sha256
            assert receipt.prompt_logits_sha256 == on_source.prompt_logits_sha256
            assert receipt.generated_logits_sha256 == on_source.generated_logits_sha256
            assert receipt.generated_token_ids == on_source.generated_token_ids


def test_a_replica_that_does_not_trust_grafts_only_after_verify(start_daemon, rng) -> None:
    source, replica = start_daemon(extra_args=TINY), start_daemon(extra_args=TINY)
    wait_model_ready(source.address)
    wait_model_ready(replica.address)
    prefix = [rng.randrange(512) for _ in range(64)]
    prompt = [*prefix, 9, 9]
    with Client(source.address) as a, Client(replica.address) as b:
        deposited = a.deposit(token_ids=prefix).artifact_id
        a.replicate_to(b)
        assert b.stat(deposited).info.provenance.trust == pb.Provenance.TRUST_UNTRUSTED
        fresh = b.generate(token_ids=prompt, max_new_tokens=3, no_cache=True)
        unverified = b.generate(token_ids=prompt, max_new_tokens=3)
        assert unverified.reused_tokens == 0 and unverified.receipt.raw.grafted == []
        assert unverified.receipt.hashes == fresh.receipt.hashes
        with pytest.raises(FailedPrecondition, match="untrusted"):
            b.graft(deposited, token_ids=[5], max_new_tokens=1)
        anyway = b.graft(deposited, token_ids=[5], max_new_tokens=1, allow_untrusted=True)
        assert anyway.receipt.raw.grafted[0].trust == pb.Provenance.TRUST_UNTRUSTED

        assert b.verify(deposited).ok  # recomputed here: now this replica vouches for it
        provenance = b.stat(deposited).info.provenance
        assert provenance.trust == pb.Provenance.TRUST_VERIFIED
        assert provenance.vouched_by == b.info().signing_key
        assert len(provenance.signatures) == 2  # the source's and its own
        verified = b.generate(token_ids=prompt, max_new_tokens=3)
        assert verified.reused_tokens == 64 and verified.receipt.hashes == fresh.receipt.hashes
        assert verified.receipt.raw.grafted[0].artifact_id == deposited
