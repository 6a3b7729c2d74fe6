"""The store's trust: provenance kept, trust upgraded or withdrawn, trusted prefixes found.

`TrustedPrefixes` is a part the Store holds (kvgraftd.store.artifact_store: it offers
these methods as its own) over the store's LMDB environment and its leases (`reading`,
kvgraftd.store.lifecycle); the records and the chain index they keep are
kvgraftd.store.trust_index's. `longest_chain` with `hold` also leases the
artifact vouching for the match (kvgraftd.store.usage): a Generate reads its pages
with the artifact held, and one evicted between the lookup and the lease is looked up
again, so what is gone is computed, never half-read.

`reevaluate_trust` runs at each start: when the trusted keys are not those the records
were last judged against (a digest kept in `meta`), every stored signature is judged
again; when they are, it reads one meta value and writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, ExitStack

import lmdb

from kvgraft.errors import NotFound
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store import catalog, trust_index
from kvgraftd.store.catalog import Visible, decode_record
from kvgraftd.store.lmdb_env import LmdbEnv
from kvgraftd.store.signing import TrustPolicy
from kvgraftd.store.trust_index import NO_MATCH, ChainMatch

LOOKUP_ATTEMPTS = 3  # prefix lookups racing eviction before a request computes it all
# meta: SHA-256 of the trusted keys every provenance record was last judged against
TRUST_KEYS_META = b"trust_keys_sha256"


class TrustedPrefixes:
    """The trust records of the store whose environment is `env`; `reading(artifact_id,
    reused_tokens)` leases an artifact (the Store's `reading`)."""

    def __init__(
        self, env: LmdbEnv, reading: Callable[[str, int], AbstractContextManager[None]]
    ) -> None:
        self._db, self._read, self._write = env.db, env.read, env.write
        self._reading = reading

    def longest_chain(
        self,
        fingerprint: bytes,
        profile: pb.ComputeProfile,
        layout: pb.KvLayout,
        token_ids: Sequence[int],
        hold: ExitStack | None = None,
        namespace: str = "",
    ) -> ChainMatch:
        """The longest stored prefix of `token_ids` among trusted artifacts' pages in
        `namespace` (kvgraft.tenancy; to the token with row-invariant products), and the
        artifact that vouches for it. With
        `hold`, that artifact is leased there (`reading`: not evicted while the caller reads
        its pages); one evicted since is looked up again."""
        for _ in range(LOOKUP_ATTEMPTS):
            with self._read() as txn:
                match = trust_index.longest_trusted_run(
                    txn, self._db, fingerprint, profile, layout, token_ids, namespace
                )
            if hold is None or not match.entries:
                return match
            try:
                hold.enter_context(self._reading(match.grafted[0].artifact_id, match.tokens))
                return match
            except NotFound:
                continue
        return NO_MATCH

    def reevaluate_trust(self, policy: TrustPolicy) -> tuple[int, int] | None:
        """Judge every stored signature against `policy`'s keys (trust_index.reevaluate)
        when they are not the keys the records were judged against last (kept in `meta`):
        a key added upgrades what it signed, a key removed downgrades what only it signed.
        Returns (upgraded, downgraded), or None when the keys did not change."""

        def voucher_of(aid: bytes, provenance: pb.Provenance) -> bytes:
            return policy.voucher(aid.hex(), provenance.signatures, provenance.vouched_by)

        def body(txn: lmdb.Transaction) -> tuple[int, int] | None:
            if txn.get(TRUST_KEYS_META, db=self._db["meta"]) == policy.keys_digest:
                return None

            def manifest_of(aid: bytes) -> pb.Manifest:
                return decode_record(txn.get(aid, db=self._db["artifacts"])).manifest()

            changed = trust_index.reevaluate(txn, self._db, voucher_of, manifest_of)
            txn.put(TRUST_KEYS_META, policy.keys_digest, db=self._db["meta"])
            return changed

        return self._write(0, body)

    def signer_keys(self, artifact_ids: Iterable[str]) -> dict[str, frozenset[bytes]]:
        """The public keys of the signatures each artifact carries (replication compares
        them with a source's: kvgraft.replication.replicator)."""
        with self._read() as txn:
            return {
                artifact_id: frozenset(
                    s.public_key
                    for s in trust_index.read(
                        txn, self._db, catalog.parse_full_id(artifact_id)
                    ).signatures
                )
                for artifact_id in artifact_ids
            }

    def longest_untrusted(
        self,
        fingerprint: bytes,
        profile: pb.ComputeProfile,
        layout: pb.KvLayout,
        token_ids: Sequence[int],
        visible: Visible | None = None,
    ) -> tuple[int, str]:
        """The longest prefix of `token_ids` an untrusted artifact holds (tokens, its id):
        what a Verify of it would let Generate reuse (see trust_index.longest_untrusted),
        of the artifacts `visible` accepts."""
        with self._read() as txn:
            return trust_index.longest_untrusted(
                txn, self._db, fingerprint, profile, layout, token_ids, visible
            )

    def provenance(self, artifact_id: str) -> pb.Provenance:
        with self._read() as txn:
            return trust_index.read(txn, self._db, catalog.parse_full_id(artifact_id))

    def trust_artifact(self, artifact_id: str, provenance: pb.Provenance) -> pb.Provenance:
        """Record more trust in a stored artifact (a Verify, a trusted signature); returns
        the provenance it now has. Its pages enter the chain index when it becomes trusted."""
        aid = catalog.parse_full_id(artifact_id)

        def body(txn: lmdb.Transaction) -> pb.Provenance:
            found = txn.get(aid, db=self._db["artifacts"])
            if found is None:
                raise NotFound(f"artifact {artifact_id} is not in the store")
            trust_index.record(txn, self._db, aid, decode_record(found).manifest(), provenance)
            return trust_index.read(txn, self._db, aid)

        return self._write(0, body)
