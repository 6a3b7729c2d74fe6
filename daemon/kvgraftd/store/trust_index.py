"""The store's record of trust: why it believes each artifact, and who vouches for each
chain entry.

Sub-databases (inside the store's transactions):
  provenance  artifact id (32 bytes) -> kvgraft.v1 Provenance (deterministic bytes)
  vouchers    chain key (32) || artifact id (32) -> b""   trusted artifacts holding that page

Invariant: an artifact's whole pages are in the chain index (kvgraftd.store.chains),
and it vouches for them here, exactly while its provenance is trusted
(computed, verified, or signed by a trusted key). So Generate's prefix lookup
only ever finds pages some trusted artifact holds, and names that artifact. An
artifact without a record (stored before trust existed: format 2) is untrusted
until it is verified.

This module decides nothing about keys (kvgraftd.store.signing does); it keeps what
it is told, and upgrades, never downgrades, an artifact's trust.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store import chains

TRUSTED = frozenset(
    {pb.Provenance.TRUST_COMPUTED, pb.Provenance.TRUST_VERIFIED, pb.Provenance.TRUST_SIGNED}
)
_RANK = {
    pb.Provenance.TRUST_COMPUTED: 3,
    pb.Provenance.TRUST_VERIFIED: 3,
    pb.Provenance.TRUST_SIGNED: 2,
    pb.Provenance.TRUST_UNTRUSTED: 1,
}
MAX_KEPT_SIGNATURES = 16  # per artifact: its voucher's first
MAX_SOURCES = 16  # replication sources remembered per artifact
UNRECORDED = pb.Provenance(trust=pb.Provenance.TRUST_UNTRUSTED, origin="stored before trust")


def is_trusted(provenance: pb.Provenance) -> bool:
    return provenance.trust in TRUSTED


def merged(stored: pb.Provenance, arrived: pb.Provenance) -> pb.Provenance:
    """An artifact's provenance when it arrives (or is verified) again: the more trusted
    of the two, with every signature of both, one per key."""
    best = arrived if _RANK.get(arrived.trust, 0) > _RANK.get(stored.trust, 0) else stored
    out = pb.Provenance()
    out.CopyFrom(best)
    del out.signatures[:]
    out.signatures.extend(
        unique_signatures([*stored.signatures, *arrived.signatures], first=best.vouched_by)
    )
    del out.replicated_from[:]
    sources = dict.fromkeys([*stored.replicated_from, *arrived.replicated_from])
    out.replicated_from.extend(list(sources)[:MAX_SOURCES])
    return out


def unique_signatures(signatures, first: bytes = b"") -> list[pb.ArtifactSignature]:
    """One signature per key, the voucher's (`first`) first, at most MAX_KEPT_SIGNATURES:
    anyone may add valid signatures by throwaway keys; they must not grow without bound."""
    by_key: dict[bytes, pb.ArtifactSignature] = {}
    for signature in sorted(signatures, key=lambda s: s.public_key != first):
        by_key.setdefault(signature.public_key, signature)
    return list(by_key.values())[:MAX_KEPT_SIGNATURES]


def read(txn, dbs, aid: bytes) -> pb.Provenance:
    found = txn.get(aid, db=dbs["provenance"])
    return pb.Provenance.FromString(bytes(found)) if found is not None else UNRECORDED


def record(txn, dbs, aid: bytes, manifest: pb.Manifest, provenance: pb.Provenance) -> None:
    """Keep `provenance` for a stored artifact (merged with what was kept before); its
    pages enter the chain index when it becomes trusted."""
    found = txn.get(aid, db=dbs["provenance"])
    before = pb.Provenance.FromString(bytes(found)) if found is not None else None
    after = merged(before, provenance) if before is not None else merged(provenance, provenance)
    before = before or UNRECORDED
    txn.put(aid, after.SerializeToString(deterministic=True), db=dbs["provenance"])
    if is_trusted(after) and not is_trusted(before) and txn.get(aid, db=dbs["quarantine"]) is None:
        vouch(txn, dbs, aid, manifest)


def vouch(txn, dbs, aid: bytes, manifest: pb.Manifest) -> None:
    """A trusted artifact's pages enter the chain index, vouched for by it."""
    entries = list(chains.manifest_entries(manifest))
    chains.register(txn, dbs["chains"], entries, +1)
    for key, entry in entries:
        found = txn.get(key, db=dbs["chains"])
        # it vouches only where the index holds its bytes (not another's, kept first)
        if found is not None and chains.ChainEntry.decode(found).page_sha256 == (entry.page_sha256):
            txn.put(key + aid, b"", db=dbs["vouchers"])


def withdraw_vouchers(txn, dbs, aid: bytes, manifest: pb.Manifest, entries=None) -> None:
    """The artifact vouches for nothing any more (deleted, or quarantined: it stays trusted).
    `entries`: its chain entries, when the caller has them."""
    if is_trusted(read(txn, dbs, aid)):
        entries = entries if entries is not None else list(chains.manifest_entries(manifest))
        chains.register(txn, dbs["chains"], entries, -1)
        for key, _ in entries:
            txn.delete(key + aid, db=dbs["vouchers"])


def forget(txn, dbs, aid: bytes, manifest: pb.Manifest, entries=None) -> None:
    """An artifact is deleted: it vouches for nothing any more."""
    if txn.get(aid, db=dbs["quarantine"]) is None:  # a quarantined one already withdrew
        withdraw_vouchers(txn, dbs, aid, manifest, entries)
    txn.delete(aid, db=dbs["provenance"])


def withdraw(txn, dbs, keys: frozenset[bytes], manifest_of) -> int:
    """Keys no longer trusted: an artifact they vouched for is vouched for by another
    trusted signature it carries, or becomes untrusted and leaves the chain index.
    `manifest_of(aid)` reads an artifact's manifest. Returns the artifacts downgraded."""
    downgraded = 0
    for raw_aid, raw in list(txn.cursor(db=dbs["provenance"])):
        provenance = pb.Provenance.FromString(bytes(raw))
        if provenance.trust != pb.Provenance.TRUST_SIGNED or provenance.vouched_by in keys:
            continue
        aid = bytes(raw_aid)
        other = next((s.public_key for s in provenance.signatures if s.public_key in keys), b"")
        if not other:
            forget(txn, dbs, aid, manifest_of(aid))  # out of the index while still trusted
            provenance.trust = pb.Provenance.TRUST_UNTRUSTED
            downgraded += 1
        provenance.vouched_by = other
        txn.put(aid, provenance.SerializeToString(deterministic=True), db=dbs["provenance"])
    return downgraded


def voucher(txn, dbs, chain_key: bytes) -> bytes | None:
    """A trusted artifact holding the page of `chain_key` (and so every page before it)."""
    cursor = txn.cursor(db=dbs["vouchers"])
    if not cursor.set_range(chain_key):
        return None
    key = bytes(cursor.key())
    return key[32:] if key[:32] == chain_key else None


@dataclass(frozen=True)
class ChainMatch:
    """A prompt's longest run of trusted stored whole pages, and what vouches for them."""

    entries: list[chains.ChainEntry]
    grafted: list[pb.GraftedArtifact]  # the artifacts holding them (receipts name them)


def longest_trusted_run(
    txn,
    dbs,
    fingerprint: bytes,
    profile: pb.ComputeProfile,
    layout: pb.KvLayout,
    token_ids: Sequence[int],
    max_pages: int,
) -> ChainMatch:
    """The chain entries of the longest run of pages starting `token_ids` (only trusted
    artifacts' pages are indexed; see chains.longest_run), and the artifact vouching
    for the last one: it holds every page before it too."""
    entries = chains.longest_run(
        txn, dbs["chains"], fingerprint, profile, layout, token_ids, max_pages
    )
    if not entries:
        return ChainMatch([], [])
    last_key = chains.entry_keys(fingerprint, profile, layout, entries)[-1]
    aid = voucher(txn, dbs, last_key)
    if aid is None:  # an entry is registered only with a voucher
        return ChainMatch([], [])
    provenance = read(txn, dbs, aid)
    grafted = pb.GraftedArtifact(
        artifact_id=aid.hex(),
        tokens=sum(len(entry.token_ids) for entry in entries),
        trust=provenance.trust,
        vouched_by=provenance.vouched_by,
    )
    return ChainMatch(entries, [grafted])


def clear_chains(txn, dbs) -> None:
    """Format 2 -> 3: no artifact is trusted yet, so none has pages in the chain index."""
    txn.drop(dbs["chains"], delete=False)
    txn.drop(dbs["vouchers"], delete=False)
