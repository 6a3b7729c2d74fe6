"""Only verified KV is ever grafted: forged artifacts, signatures and what carries them.

Any caller of PutArtifact can store an artifact with the daemon's own fingerprint,
profile and layout and arbitrary page bytes for a real token prefix. Before trust,
every Generate whose prompt started with those tokens grafted the forgery. Here, on
real daemons (the tiny model, so each test takes seconds): a forgery of zeros or NaN
is stored but never grafted by Generate or recalled by Ask (their output equals
--no-cache), Graft refuses it unless told otherwise (and the receipt says so), a
signature counts only when it is valid and by a trusted key, signatures travel in
bundles and replication (even when added after a copy was made), every stored signature
is judged again when the trusted keys change, and a pull applies deletes only to what
came from its source. Keys of small order: test_small_order_keys.py.
"""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys

import pytest

from kvgraft import Artifact, Client, wire
from kvgraft.artifact import canonical_bytes
from kvgraft.errors import FailedPrecondition, InvalidArgument
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.signing import Signer, TrustPolicy
from kvgraftd.testing.daemon_process import wait_model_ready
from tests.support.factory import random_artifact

TINY = ["--model", "tiny:0", "--page-tokens", "16", "--block-tokens", "64"]
NAN = struct.pack("<f", float("nan"))


def _forged(genuine: Artifact, fill: bytes, labels: dict[str, str] | None = None) -> Artifact:
    """The genuine artifact's tokens, model, profile and layout, with pages of `fill`."""
    pages = [
        (fill * (len(genuine.pages[digest]) // len(fill) + 1))[: len(genuine.pages[digest])]
        for digest in genuine.manifest.page_sha256
    ]
    manifest = genuine.manifest
    return Artifact.build(
        model_fingerprint=manifest.model_fingerprint,
        layout=manifest.layout,
        profile=manifest.profile,
        token_ids=manifest.token_ids,
        page_bytes=pages,
        segment_ends=manifest.segment_ends,
        labels=labels if labels is not None else dict(manifest.labels),
    )


@pytest.fixture
def tiny(start_daemon):
    daemon = start_daemon(extra_args=TINY)
    wait_model_ready(daemon.address)
    return daemon


@pytest.mark.parametrize("fill", [b"\0", NAN], ids=["zeros", "nan"])
def test_a_forged_prefix_is_never_grafted(tiny, fill) -> None:
    prefix = list(range(10, 74))  # four whole pages
    prompt = [*prefix, 3, 4, 5]
    with Client(tiny.address, timeout_s=60) as client:
        genuine_id = client.deposit(token_ids=prefix).artifact_id
        genuine = client.get_artifact(genuine_id)
        client.delete(genuine_id)  # only the forgery holds these tokens now
        forged = _forged(genuine, fill)
        assert forged.id != genuine_id
        client.put_artifact(forged)
        assert client.stat(forged.id).info.provenance.trust == pb.Provenance.TRUST_UNTRUSTED

        fresh = client.generate(token_ids=prompt, max_new_tokens=6, no_cache=True)
        asked = client.generate(token_ids=prompt, max_new_tokens=6)
        assert asked.reused_tokens == 0 and asked.receipt.raw.grafted == []
        assert asked.token_ids == fresh.token_ids
        assert asked.receipt.hashes == fresh.receipt.hashes
        lookup = client.lookup(prompt)  # was: "0 tokens stored", not a word of the forgery
        assert lookup.matched_tokens == 0
        assert (lookup.untrusted_tokens, lookup.untrusted_artifact_id) == (64, forged.id)

        with pytest.raises(FailedPrecondition, match="untrusted"):
            client.graft(forged.id, token_ids=[5], max_new_tokens=1)
        anyway = client.graft(forged.id, token_ids=[5], max_new_tokens=1, allow_untrusted=True)
        [grafted] = anyway.receipt.raw.grafted
        assert (grafted.artifact_id, grafted.trust) == (forged.id, pb.Provenance.TRUST_UNTRUSTED)

        # Verify recomputes it: the forgery's pages do not match, it stays untrusted
        assert not client.verify(forged.id).ok
        assert client.stat(forged.id).info.provenance.trust == pb.Provenance.TRUST_UNTRUSTED
        assert client.generate(token_ids=prompt, max_new_tokens=6).reused_tokens == 0
        client.delete(forged.id)
        assert client.lookup(prompt).untrusted_tokens == 0


def test_only_a_valid_signature_by_a_trusted_key_counts(start_daemon) -> None:
    trusted, stranger = Signer.generate(), Signer.generate()
    daemon = start_daemon(extra_args=["--trust-keys", trusted.public_key.hex()])
    rng = random.Random(3)
    with Client(daemon.address) as client:
        cases = []
        for signer in (stranger, None, trusted):
            artifact = random_artifact(rng)
            if signer is None:  # a signature by the trusted key, of another artifact
                artifact.signatures = [trusted.sign(random_artifact(rng).id)]
            else:
                artifact.signatures = [signer.sign(artifact.id)]
            client.put_artifact(artifact)
            cases.append(client.stat(artifact.id).info.provenance)
    by_stranger, misapplied, by_trusted = cases
    assert by_stranger.trust == pb.Provenance.TRUST_UNTRUSTED
    assert len(by_stranger.signatures) == 1  # kept: it travels on, to whom trusts it
    assert misapplied.trust == pb.Provenance.TRUST_UNTRUSTED
    assert list(misapplied.signatures) == []  # invalid: dropped
    assert by_trusted.trust == pb.Provenance.TRUST_SIGNED
    assert by_trusted.vouched_by == trusted.public_key and by_trusted.origin == "upload"


def test_signatures_travel_in_bundles(start_daemon, tmp_path) -> None:
    source = start_daemon(extra_args=TINY)
    wait_model_ready(source.address)
    with Client(source.address, timeout_s=60) as a:
        key = a.info().signing_key
        artifact_id = a.deposit(token_ids=list(range(5, 40))).artifact_id
        path = tmp_path / "a.safetensors"
        a.export_bundle(artifact_id, path)
    trusting = start_daemon(extra_args=["--trust-keys", key.hex()])
    other = start_daemon()
    for daemon, trust in (
        (trusting, pb.Provenance.TRUST_SIGNED),
        (other, pb.Provenance.TRUST_UNTRUSTED),
    ):
        with Client(daemon.address) as client:
            client.import_bundle(path)
            assert client.stat(artifact_id).info.provenance.trust == trust


def test_a_pull_deletes_only_what_came_from_its_source(start_daemon) -> None:
    """Was: a pull applied the source's deletes to artifacts that never came from it
    (13 artifacts to 0 in one pull)."""
    rng = random.Random(13)
    artifacts = [random_artifact(rng) for _ in range(13)]
    source = start_daemon()
    target = start_daemon(extra_args=["--replication-pull-from", "*"])
    with Client(source.address) as a, Client(target.address) as b:
        for artifact in artifacts:
            b.put_artifact(artifact)  # uploaded to the target directly
            a.put_artifact(artifact)
            a.delete(artifact.id)  # the source's feed: added, then deleted
        mine = random_artifact(rng)
        a.put_artifact(mine)
        b.pull_from(source.address)
        a.delete(mine.id)
        summary = b.pull_from(source.address)
        held = {info.artifact_id for info in b.list_artifacts()}
    assert held == {artifact.id for artifact in artifacts}  # all 13 kept; `mine` followed
    assert summary.artifacts_deleted == 1


def test_verify_untrusted_trusts_every_artifact_that_recomputes(tiny, tmp_path) -> None:
    """`kvgraft verify --untrusted`: after an upgrade (or a replication from a daemon it
    does not trust) a store's artifacts are untrusted; those that recompute equal are
    trusted, a forgery is reported and stays untrusted (exit 1)."""
    rng = random.Random(5)
    with Client(tiny.address, timeout_s=60) as client:
        genuine = [
            client.get_artifact(client.deposit(token_ids=p).artifact_id)
            for p in (
                [rng.randrange(1, 500) for _ in range(40)],
                [rng.randrange(1, 500) for _ in range(20)],
            )
        ]
        for artifact in genuine:  # stored again as uploads: untrusted copies elsewhere
            client.delete(artifact.id)
            artifact.signatures = []
            client.put_artifact(artifact)
        forged = _forged(genuine[0], b"\0")
        client.put_artifact(forged)
    result = subprocess.run(
        [sys.executable, "-m", "kvgraft", "--server", tiny.address, "--json", "verify",
         "--untrusted"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    document = json.loads(result.stdout)
    assert document["verified"] == 2
    assert document["artifacts"][forged.id] == "mismatch"
    with Client(tiny.address) as client:
        trusts = {i.artifact_id: i.provenance.trust for i in client.list_artifacts()}
    assert trusts == {
        genuine[0].id: pb.Provenance.TRUST_VERIFIED,
        genuine[1].id: pb.Provenance.TRUST_VERIFIED,
        forged.id: pb.Provenance.TRUST_UNTRUSTED,
    }


def test_a_deposit_on_untrusted_pages_is_untrusted(tiny) -> None:
    """A Graft with allow_untrusted and deposit computes on the forged pages: what it
    deposits must not become trusted (it would feed every later Generate)."""
    prefix = list(range(10, 74))
    with Client(tiny.address, timeout_s=60) as client:
        genuine = client.get_artifact(client.deposit(token_ids=prefix).artifact_id)
        client.delete(genuine.id)
        forged = _forged(genuine, b"\0")
        client.put_artifact(forged)
        result = client.graft(
            forged.id, token_ids=[5], max_new_tokens=1, allow_untrusted=True, deposit=True
        )
        derived = client.stat(result.deposited_artifact_id).info.provenance
        assert derived.trust == pb.Provenance.TRUST_UNTRUSTED and not derived.signatures
        assert client.generate(token_ids=[*prefix, 5, 6], max_new_tokens=2).reused_tokens == 0


def test_signatures_by_throwaway_keys_cannot_grow_without_bound(start_daemon) -> None:
    trusted = Signer.generate()
    daemon = start_daemon(extra_args=["--trust-keys", trusted.public_key.hex()])
    artifact = random_artifact(random.Random(8))
    with Client(daemon.address) as client:
        artifact.signatures = [trusted.sign(artifact.id)]
        client.put_artifact(artifact)
        for _ in range(3):  # anyone may re-put it with valid signatures by new keys
            artifact.signatures = [Signer.generate().sign(artifact.id) for _ in range(64)]
            client.put_artifact(artifact)
        provenance = client.stat(artifact.id).info.provenance
        assert len(provenance.signatures) == 16
        assert provenance.signatures[0].public_key == trusted.public_key  # the voucher's kept
        assert provenance.trust == pb.Provenance.TRUST_SIGNED
        assert len(client.get_artifact(artifact.id).signatures) == 16  # still served


def test_stored_signatures_are_judged_again_when_the_trusted_keys_change(
    start_daemon, tmp_path
) -> None:
    """Was: a key added to [trust] keys did not upgrade what it had signed (no restart or
    replication did), and a key taken out then listed again did not restore trust in what
    it validly signed. At each start every stored signature meets the keys in force."""
    first, second = Signer.generate(), Signer.generate()
    daemon = start_daemon(
        data_dir=tmp_path / "d", extra_args=[*TINY, "--trust-keys", first.public_key.hex()]
    )
    wait_model_ready(daemon.address)
    prefixes = [list(range(start, start + 64)) for start in (20, 100, 180)]  # 4 pages each
    signed_by = ((first,), (second,), (first, second))
    stored = []
    with Client(daemon.address, timeout_s=60) as client:
        for prefix, signers in zip(prefixes, signed_by, strict=True):
            computed = client.get_artifact(client.deposit(token_ids=prefix).artifact_id)
            client.delete(computed.id)
            computed.signatures = [signer.sign(computed.id) for signer in signers]
            client.put_artifact(computed)  # the same KV, vouched for by those keys only
            stored.append(computed)

    def trust_now(lookups: bool) -> list[tuple[int, bytes, int | None]]:
        """(trust, voucher, tokens Lookup finds: None on a store-only daemon) of each."""
        with Client(daemon.address, timeout_s=60) as client:
            provenances = [client.stat(a.id).info.provenance for a in stored]
            return [
                (p.trust, p.vouched_by, client.lookup(prefix).matched_tokens if lookups else None)
                for p, prefix in zip(provenances, prefixes, strict=True)
            ]

    def restart(key: Signer, model: bool) -> list[tuple[int, bytes, int | None]]:
        daemon.stop()  # store only (no model to load: a fast start) unless `model`
        daemon.extra_args = [*(TINY if model else []), "--trust-keys", key.public_key.hex()]
        daemon.launch()
        if model:
            wait_model_ready(daemon.address)
        return trust_now(lookups=model)

    signed, untrusted = pb.Provenance.TRUST_SIGNED, pb.Provenance.TRUST_UNTRUSTED
    by_first, untrusted_here = (signed, first.public_key, 64), (untrusted, b"", 0)
    assert trust_now(lookups=True) == [by_first, untrusted_here, by_first]
    assert restart(second, model=False) == [  # the key added upgrades what it signed
        (untrusted, b"", None),
        (signed, second.public_key, None),
        (signed, second.public_key, None),
    ]
    assert "trusted now 1 artifacts (signed by a key added), untrusted now 1" in daemon.log()
    # listed again: trusted again, its pages back in the chain index (and the other's out)
    assert restart(first, model=True) == [by_first, untrusted_here, by_first]


def test_trust_is_judged_again_only_when_the_keys_change(tmp_path) -> None:
    """A start with the keys of the last one reads one value and rewrites no record."""
    store = Store(tmp_path / "store", min_free_bytes=0)
    try:
        mine, other = Signer.generate(), Signer.generate()
        assert store.reevaluate_trust(TrustPolicy(mine)) == (0, 0)  # never judged yet
        assert store.reevaluate_trust(TrustPolicy(mine)) is None
        assert store.reevaluate_trust(TrustPolicy(mine, [other.public_key])) == (0, 0)
        assert store.reevaluate_trust(TrustPolicy(mine, [other.public_key])) is None
    finally:
        store.close()


def test_a_replica_records_its_source_and_signatures_added_later(start_daemon) -> None:
    """Was: a relay (`kvgraft replicate` without --pull) recorded `origin upload` and no
    source; and an artifact the target held already was never sent again, so a signature
    the source gained later never reached it. Where an artifact came from is information,
    not trust: a relay's word gives it no say in which deletes apply."""
    key, stranger = Signer.generate(), Signer.generate()
    source = start_daemon()
    relayed = start_daemon(extra_args=["--trust-keys", key.public_key.hex()])
    pulled = start_daemon(
        extra_args=["--trust-keys", key.public_key.hex(), "--replication-pull-from", "*"]
    )
    artifact = random_artifact(random.Random(21))
    artifact.signatures = [stranger.sign(artifact.id)]
    with (
        Client(source.address) as a,
        Client(relayed.address) as b,
        Client(pulled.address) as c,
    ):
        a.put_artifact(artifact)
        assert a.replicate_to(b, pull=False).artifacts_added == 1
        assert c.pull_from(source.address).artifacts_added == 1
        by_relay = b.stat(artifact.id).info.provenance
        assert by_relay.origin == f"replicated from {source.address} via a client"
        assert list(by_relay.replicated_from) == []
        by_pull = c.stat(artifact.id).info.provenance
        assert by_pull.origin == f"replicated from {source.address}"
        assert list(by_pull.replicated_from) == [source.address]

        artifact.signatures = [key.sign(artifact.id)]
        a.put_artifact(artifact)  # the source's copy gains a signature by `key`
        assert a.replicate_to(b, pull=False).artifacts_present == 1
        assert c.pull_from(source.address).artifacts_present == 1
        for replica in (b, c):
            provenance = replica.stat(artifact.id).info.provenance
            assert (provenance.trust, provenance.vouched_by) == (
                pb.Provenance.TRUST_SIGNED,
                key.public_key,
            )
            assert [s.public_key for s in provenance.signatures] == [
                key.public_key,
                stranger.public_key,
            ]

        hostile = wire.encode_put_manifest(
            canonical_bytes(artifact.manifest), artifact.id, (), "10.0.0.1:1\u202e\n"
        )
        with pytest.raises(InvalidArgument, match="relayed_from must be"):
            b.put_artifact_messages([hostile])


def test_a_verified_replica_still_follows_its_sources_deletes(start_daemon) -> None:
    """Verifying a replicated artifact upgrades its trust; the source it came from can
    still delete it (where an artifact came from is kept apart from its trust)."""
    source = start_daemon(extra_args=TINY)
    target = start_daemon(extra_args=[*TINY, "--replication-pull-from", "*"])
    wait_model_ready(source.address)
    wait_model_ready(target.address)
    with Client(source.address, timeout_s=60) as a, Client(target.address, timeout_s=60) as b:
        artifact_id = a.deposit(token_ids=list(range(30, 70))).artifact_id
        b.pull_from(source.address)
        assert b.verify(artifact_id).ok
        assert b.stat(artifact_id).info.provenance.trust == pb.Provenance.TRUST_VERIFIED
        a.delete(artifact_id)
        assert b.pull_from(source.address).artifacts_deleted == 1
