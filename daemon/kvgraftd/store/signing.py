"""Who vouches for an artifact: this daemon's Ed25519 key, and the keys it trusts.

A content hash proves that bytes are the bytes that were sent; it cannot prove
they are the KV of those tokens under this model. Only computation, or trust in
whoever computed them, can. So each daemon has a signing key (created on first
start in the data directory, `signing.key`, mode 0600: 32 raw bytes, the
private seed) and signs the id of every artifact it computes or verifies. The
signature travels with the artifact (replication, bundles, the remote tier);
`[trust] keys` lists the public keys (hex) whose signatures a daemon accepts.

Signed bytes: b"kvgraft-artifact/1\\0" followed by the 32 bytes of the artifact
id (the SHA-256 of its canonical manifest), so a signature vouches for one
manifest and, through its page hashes, for every byte of the artifact.

A signature is valid when Ed25519 verifies it and its key is not a point of small
order (kvgraft.public_keys: such a key "signs" every artifact, and the cryptography
package accepts it): a signature by one is dropped wherever it arrives (uploads,
replication, bundles, the bucket), like any invalid one.

`TrustPolicy.received` turns what came with an artifact into its kvgraft.v1
Provenance; the store keeps it and obeys its `trust`. `TrustPolicy.voucher` judges
stored signatures again when the trusted keys or the rule that judges them change (at
start: kvgraftd.store.trusted_prefixes.reevaluate_trust).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from kvgraft.public_keys import is_degenerate
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store.catalog import now_ms
from kvgraftd.store.trust_index import unique_signatures

log = logging.getLogger(__name__)

DOMAIN = b"kvgraft-artifact/1\0"
KEY_FILE = "signing.key"
KEY_BYTES = 32
SIGNATURE_BYTES = 64
# The rule that judges stored signatures, hashed with the trusted keys: a new rule makes
# every store judge its records once again (2: keys of small order vouch for nothing).
JUDGING_RULE = b"kvgraft-trust-rule/2\0"


def _signed_bytes(artifact_id: str) -> bytes:
    return DOMAIN + bytes.fromhex(artifact_id)


def signature_is_valid(signature: pb.ArtifactSignature, artifact_id: str) -> bool:
    if len(signature.public_key) != KEY_BYTES or len(signature.signature) != SIGNATURE_BYTES:
        return False
    if is_degenerate(signature.public_key):
        return False  # verifies for any artifact: it proves nothing
    try:
        Ed25519PublicKey.from_public_bytes(signature.public_key).verify(
            signature.signature, _signed_bytes(artifact_id)
        )
    except InvalidSignature:
        return False
    return True


class Signer:
    """This daemon's signing key."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public_key = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    @classmethod
    def generate(cls) -> Signer:
        """A key of this process alone (an engine built without the daemon's)."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, directory: Path) -> Signer:
        """The key in `directory`/signing.key, created (mode 0600, atomically) if missing."""
        path = Path(directory) / KEY_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            seed = path.read_bytes()
        except FileNotFoundError:
            private = Ed25519PrivateKey.generate()
            seed = private.private_bytes_raw()
            tmp = path.with_name(f".{KEY_FILE}.tmp-{os.getpid()}")
            descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(descriptor, seed)
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
            os.replace(tmp, path)
            log.info("created the signing key %s", path)
        if len(seed) != KEY_BYTES:
            raise ValueError(
                f"{path} is not a kvgraft signing key ({len(seed)} bytes, not {KEY_BYTES}): "
                "restore it from a backup, or remove it to make a new one (artifacts signed "
                "with the old key are then trusted elsewhere only by that key)"
            )
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    def sign(self, artifact_id: str) -> pb.ArtifactSignature:
        signature = self._private.sign(_signed_bytes(artifact_id))
        return pb.ArtifactSignature(public_key=self.public_key, signature=signature)


class TrustPolicy:
    """What this daemon believes: its own computations, and the keys it trusts."""

    def __init__(self, signer: Signer, trusted_keys: Iterable[bytes] = ()) -> None:
        self.signer = signer
        self.keys = frozenset([signer.public_key, *trusted_keys])
        # the store remembers which keys (and rule) its artifacts were judged by: this digest
        self.keys_digest = hashlib.sha256(JUDGING_RULE + b"".join(sorted(self.keys))).digest()

    def voucher(
        self, artifact_id: str, signatures: Iterable[pb.ArtifactSignature], current: bytes = b""
    ) -> bytes:
        """The trusted key that vouches for an artifact carrying `signatures`: `current`
        (its voucher so far) while it is still trusted, else the first key trusted now
        whose signature is valid; b"" when none is."""
        if current in self.keys:
            return current  # its signature was checked when it became the voucher
        return next(
            (
                s.public_key
                for s in signatures
                if s.public_key in self.keys and signature_is_valid(s, artifact_id)
            ),
            b"",
        )

    def computed(self, artifact_id: str, trust: int = pb.Provenance.TRUST_COMPUTED):
        """The provenance of an artifact this daemon computed (or verified): signed by it."""
        return pb.Provenance(
            trust=trust,
            origin="computed" if trust == pb.Provenance.TRUST_COMPUTED else "verified",
            vouched_by=self.signer.public_key,
            signatures=[self.signer.sign(artifact_id)],
            unix_ms=now_ms(),
        )

    def received(
        self, artifact_id: str, signatures: Iterable[pb.ArtifactSignature], origin: str
    ) -> pb.Provenance:
        """The provenance of an artifact that arrived with `signatures` from `origin`:
        signed if one of them is valid and by a trusted key, else untrusted. Invalid
        signatures are dropped (they would only travel on)."""
        valid = [s for s in signatures if signature_is_valid(s, artifact_id)]
        voucher = next((s.public_key for s in valid if s.public_key in self.keys), b"")
        return pb.Provenance(
            trust=pb.Provenance.TRUST_SIGNED if voucher else pb.Provenance.TRUST_UNTRUSTED,
            origin=origin,
            vouched_by=voucher,
            signatures=unique_signatures(valid, first=voucher),
            unix_ms=now_ms(),
        )
