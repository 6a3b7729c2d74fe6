"""The store's trust: provenance kept, trust upgraded or withdrawn, trusted prefixes found.

`TrustedPrefixes` is a part of kvgraftd.store.artifact_store.Store (a mixin over its
LMDB environment, like kvgraftd.store.lifecycle); the records and the chain index they
keep are kvgraftd.store.trust_index's. `longest_chain` with `hold` also leases the
artifact vouching for the match (kvgraftd.store.usage): a Generate reads its pages
with the artifact held, and one evicted between the lookup and the lease is looked up
again, so what is gone is computed, never half-read.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack

import lmdb

from kvgraft.errors import NotFound
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store import catalog, trust_index
from kvgraftd.store.catalog import decode_record
from kvgraftd.store.trust_index import ChainMatch

LOOKUP_ATTEMPTS = 3  # prefix lookups racing eviction before a request computes it all


class TrustedPrefixes:
    """Mixin of Store: needs `_db`, `_read`, `_write`, `reading`."""

    def longest_chain(
        self,
        fingerprint: bytes,
        profile: pb.ComputeProfile,
        layout: pb.KvLayout,
        token_ids: Sequence[int],
        max_pages: int,
        hold: ExitStack | None = None,
    ) -> ChainMatch:
        """The longest run of trusted whole pages starting `token_ids`, and the artifact
        that vouches for it. With `hold`, that artifact is leased there (`reading`: not
        evicted while the caller reads its pages); one evicted since is looked up again."""
        for _ in range(LOOKUP_ATTEMPTS):
            with self._read() as txn:
                match = trust_index.longest_trusted_run(
                    txn, self._db, fingerprint, profile, layout, token_ids, max_pages
                )
            if hold is None or not match.entries:
                return match
            tokens = sum(len(entry.token_ids) for entry in match.entries)
            try:
                hold.enter_context(self.reading(match.grafted[0].artifact_id, tokens))
                return match
            except NotFound:
                continue
        return ChainMatch([], [])

    def withdraw_trust(self, keys: frozenset[bytes]) -> int:
        """Trust only `keys` from now on (a key removed from [trust] keys): see
        trust_index.withdraw. Returns how many artifacts became untrusted."""

        def body(txn: lmdb.Transaction) -> int:
            def manifest_of(aid: bytes) -> pb.Manifest:
                return decode_record(txn.get(aid, db=self._db["artifacts"])).manifest()

            return trust_index.withdraw(txn, self._db, keys, manifest_of)

        return self._write(0, body)

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
