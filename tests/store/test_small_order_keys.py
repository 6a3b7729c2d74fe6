"""Keys of small order sign anything: a "signature" by the identity point (R = identity,
S = 0) verifies for every artifact under plain Ed25519 (the `cryptography` package accepts
it). Such keys and what they sign are refused wherever a key or a signature enters: an
upload, a bundle, the bucket (TrustPolicy.received), `[trust] keys`; and a store written
before the rule drops the ones it kept, judged again at its next start."""

from __future__ import annotations

import hashlib
import random

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from kvgraft import Client
from kvgraft.bundle import read_bundle, write_bundle
from kvgraft.public_keys import is_degenerate
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.config import ConfigError, DaemonConfig
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.page_records import page_records_of
from kvgraftd.store.signing import DOMAIN, Signer, TrustPolicy
from kvgraftd.store.trusted_prefixes import TRUST_KEYS_META
from tests.support.factory import random_artifact

# The keys of small order (libsodium's blocklist): the y of the 8 torsion points (1: the
# identity, p - 1, 0, and ±Y8, those of order 8) and the non-canonical p and p + 1, each
# with both signs of x.
P = 2**255 - 19
Y8 = 2707385501144840649318225287225658788936804267575313519463743609750303402022
SMALL_ORDER = [
    (y | sign << 255).to_bytes(32, "little")
    for y in (1, P - 1, 0, Y8, P - Y8, P, P + 1)
    for sign in (0, 1)
]
IDENTITY = SMALL_ORDER[0]


def _identity_signature() -> pb.ArtifactSignature:
    """R = the identity, S = 0, by the identity key: it verifies for any artifact."""
    return pb.ArtifactSignature(public_key=IDENTITY, signature=IDENTITY + bytes(32))


def test_keys_of_small_order_sign_anything_and_are_refused() -> None:
    d = -121665 * pow(121666, -1, P) % P
    assert (d * Y8**4 + 2 * Y8**2 - 1) % P == 0  # a point of order 8 has this y
    assert all(map(is_degenerate, SMALL_ORDER))
    assert not any(is_degenerate(Signer.generate().public_key) for _ in range(100))
    torsion = SMALL_ORDER[:10]  # the canonical encodings: one of them is a valid R
    for key in torsion:  # why: for each, S = 0 and some R "sign" these ids (cryptography)
        verifier = Ed25519PublicKey.from_public_bytes(key)
        forged = 0
        for n in range(16):
            message = DOMAIN + bytes([n]) * 32
            for r in torsion:
                try:
                    verifier.verify(r + bytes(32), message)
                except InvalidSignature:
                    continue
                forged += 1
                break
        assert forged >= 8, key.hex()


def test_a_signature_by_a_key_of_small_order_is_refused_where_it_enters(
    start_daemon, tmp_path
) -> None:
    """Was: a "signature" by the identity point (R = identity, S = 0) verified for any
    artifact and was kept among its signatures, and [trust] keys took such a key. It is
    dropped where signatures enter (an upload, a bundle, the bucket), and refused as a key."""
    trusted = Signer.generate()
    artifact = random_artifact(random.Random(11))
    forged = _identity_signature()
    Ed25519PublicKey.from_public_bytes(IDENTITY).verify(  # cryptography alone accepts it
        forged.signature, DOMAIN + bytes.fromhex(artifact.id)
    )
    artifact.signatures = [forged, trusted.sign(artifact.id)]
    path = tmp_path / "a.safetensors"
    write_bundle(artifact, path)
    assert read_bundle(path).signatures == [trusted.sign(artifact.id)]
    daemon = start_daemon(extra_args=["--trust-keys", trusted.public_key.hex()])
    with Client(daemon.address) as client:
        client.put_artifact(artifact)
        provenance = client.stat(artifact.id).info.provenance
    assert [s.public_key for s in provenance.signatures] == [trusted.public_key]
    # the bucket's signatures objects are judged by TrustPolicy.received, as uploads are
    remote = TrustPolicy(Signer.generate()).received(artifact.id, [forged], "remote")
    assert list(remote.signatures) == [] and remote.trust == pb.Provenance.TRUST_UNTRUSTED
    for key in SMALL_ORDER:
        with pytest.raises(ConfigError, match="small order"):
            DaemonConfig(trust_keys=(key.hex(),))


def test_a_store_drops_the_signatures_of_small_order_it_kept_before(tmp_path) -> None:
    """A store written before the rule holds such signatures, judged against its keys by
    the old digest: the new rule is part of the digest, so the next start judges again
    and drops them."""
    store = Store(tmp_path / "store", min_free_bytes=0)
    try:
        mine = Signer.generate()
        artifact = random_artifact(random.Random(12))
        store.commit_artifact(artifact.manifest, page_records_of(artifact.pages))
        before = pb.Provenance(
            trust=pb.Provenance.TRUST_UNTRUSTED,
            origin="upload",
            signatures=[_identity_signature(), mine.sign(artifact.id)],
        )

        def as_kept_before(txn) -> None:  # what an older daemon wrote
            aid = bytes.fromhex(artifact.id)
            txn.put(aid, before.SerializeToString(deterministic=True), db=store._db["provenance"])
            old_digest = hashlib.sha256(mine.public_key).digest()
            txn.put(TRUST_KEYS_META, old_digest, db=store._db["meta"])

        store._write(0, as_kept_before)
        assert store.reevaluate_trust(TrustPolicy(mine)) == (1, 0)  # its own key vouches
        provenance = store.provenance(artifact.id)
        assert [s.public_key for s in provenance.signatures] == [mine.public_key]
        assert provenance.trust == pb.Provenance.TRUST_SIGNED
    finally:
        store.close()
