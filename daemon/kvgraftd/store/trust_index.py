"""The store's record of trust: why it believes each artifact, and who vouches for each
chain entry.

Sub-databases (inside the store's transactions):
  provenance  artifact id (32 bytes) -> kvgraft.v1 Provenance (deterministic bytes)
  vouchers    chain key (32) || artifact id (32) -> b""   trusted artifacts holding that page
  untrusted_heads  first tokens || artifact id -> b""    untrusted artifacts, by what they start
                   with (chains.head_key): Lookup names one that holds a prompt's prefix

Invariant: an artifact's whole pages are in the chain index (kvgraftd.store.chains),
and it vouches for them here, exactly while its provenance is trusted
(computed, verified, or signed by a trusted key). So Generate's prefix lookup
only ever finds pages some trusted artifact holds, and names that artifact. An
artifact without a record (stored before trust existed: format 2) is untrusted
until it is verified.

This module decides nothing about keys (kvgraftd.store.signing does); it keeps what
it is told, except signatures by keys of small order (kvgraft.public_keys), which it
never keeps: they would vouch for anything. An arrival or a Verify only ever upgrades an
artifact's trust; `reevaluate` (when the trusted keys or the rule change) judges every
signed or untrusted artifact again, both ways, and drops such signatures kept before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvgraft.public_keys import is_degenerate
from kvgraft.tenancy import owner_in, owner_of
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store import chains
from kvgraftd.store.catalog import decode_record

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
UNTRUSTED_CANDIDATES = 8  # untrusted artifacts a Lookup compares with the prompt
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
    anyone may add valid signatures by throwaway keys; they must not grow without bound.
    None by a key of small order: those prove nothing, and must not travel on."""
    by_key: dict[bytes, pb.ArtifactSignature] = {}
    for signature in sorted(signatures, key=lambda s: s.public_key != first):
        if not is_degenerate(signature.public_key):
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
    list_untrusted(txn, dbs, aid, manifest, not is_trusted(after))
    if is_trusted(after) and not is_trusted(before) and txn.get(aid, db=dbs["quarantine"]) is None:
        vouch(txn, dbs, aid, manifest)


def list_untrusted(txn, dbs, aid: bytes, manifest: pb.Manifest, untrusted: bool) -> None:
    """List an untrusted artifact by its first tokens (or unlist it: trusted, or gone)."""
    key = chains.head_key(manifest.token_ids, aid)
    if untrusted:
        txn.put(key, b"", db=dbs["untrusted_heads"])
    else:
        txn.delete(key, db=dbs["untrusted_heads"])


def vouch(txn, dbs, aid: bytes, manifest: pb.Manifest) -> None:
    """A trusted artifact's pages enter the chain index, vouched for by it."""
    entries = list(chains.manifest_entries(manifest))
    chains.register(txn, dbs, entries, +1)
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
        chains.register(txn, dbs, entries, -1)
        for key, _ in entries:
            txn.delete(key + aid, db=dbs["vouchers"])


def forget(txn, dbs, aid: bytes, manifest: pb.Manifest, entries=None) -> None:
    """An artifact is deleted: it vouches for nothing any more."""
    if txn.get(aid, db=dbs["quarantine"]) is None:  # a quarantined one already withdrew
        withdraw_vouchers(txn, dbs, aid, manifest, entries)
    list_untrusted(txn, dbs, aid, manifest, False)
    txn.delete(aid, db=dbs["provenance"])


def reevaluate(txn, dbs, voucher_of, manifest_of) -> tuple[int, int]:
    """Judge every signed or untrusted artifact again (the trusted keys changed):
    `voucher_of(aid, provenance)` names the trusted key among its signatures (b"": none).
    One that gained a voucher is signed and its pages enter the chain index; one whose
    signers are all untrusted now is untrusted and leaves it; computed and verified
    artifacts stay. Any artifact's signatures by keys of small order (kept by a daemon
    older than that rule) are dropped. `manifest_of(aid)` reads a manifest. Returns
    (upgraded, downgraded)."""
    changed: list[tuple[bytes, pb.Provenance, bytes]] = []
    for raw_aid, raw in txn.cursor(db=dbs["provenance"]):  # read all before any write
        provenance = pb.Provenance.FromString(bytes(raw))
        judged = provenance.trust in (pb.Provenance.TRUST_SIGNED, pb.Provenance.TRUST_UNTRUSTED)
        voucher = voucher_of(bytes(raw_aid), provenance) if judged else provenance.vouched_by
        degenerate = any(is_degenerate(s.public_key) for s in provenance.signatures)
        if voucher != provenance.vouched_by or degenerate:
            changed.append((bytes(raw_aid), provenance, voucher))
    upgraded = downgraded = 0
    for aid, provenance, voucher in changed:
        if voucher != provenance.vouched_by:  # (a judged one whose trust changes)
            was_trusted = _rejudge(txn, dbs, aid, provenance, voucher, manifest_of)
            upgraded += bool(voucher) and not was_trusted
            downgraded += was_trusted and not voucher
        signatures = unique_signatures(provenance.signatures, first=voucher)
        del provenance.signatures[:]
        provenance.signatures.extend(signatures)
        txn.put(aid, provenance.SerializeToString(deterministic=True), db=dbs["provenance"])
    return upgraded, downgraded


def _rejudge(txn, dbs, aid: bytes, provenance: pb.Provenance, voucher: bytes, manifest_of) -> bool:
    """`provenance` becomes signed by `voucher` (untrusted if b""); its pages enter or leave
    the chain index to match. Returns whether it was trusted before."""
    was_trusted = is_trusted(provenance)
    held = txn.get(aid, db=dbs["quarantine"]) is None  # a quarantined one vouches for nothing
    if held and was_trusted and not voucher:
        withdraw_vouchers(txn, dbs, aid, manifest_of(aid))
    if held and voucher and not was_trusted:
        vouch(txn, dbs, aid, manifest_of(aid))
    if bool(voucher) != was_trusted:
        list_untrusted(txn, dbs, aid, manifest_of(aid), not voucher)
    provenance.trust = pb.Provenance.TRUST_SIGNED if voucher else pb.Provenance.TRUST_UNTRUSTED
    provenance.vouched_by = voucher
    return was_trusted


def voucher(txn, dbs, chain_key: bytes) -> bytes | None:
    """A trusted artifact holding the page of `chain_key` (and so every page before it)."""
    cursor = txn.cursor(db=dbs["vouchers"])
    if not cursor.set_range(chain_key):
        return None
    key = bytes(cursor.key())
    return key[32:] if key[:32] == chain_key else None


@dataclass(frozen=True)
class ChainMatch:
    """A prompt's longest stored prefix among trusted artifacts' pages, and what vouches
    for them: `entries` hold its first `tokens` tokens (the last one, with row-invariant
    products, perhaps in part: its first rows)."""

    entries: list[chains.ChainEntry]
    tokens: int
    grafted: list[pb.GraftedArtifact]  # the artifacts holding them (receipts name them)


NO_MATCH = ChainMatch([], 0, [])


def longest_trusted_run(
    txn,
    dbs,
    fingerprint: bytes,
    profile: pb.ComputeProfile,
    layout: pb.KvLayout,
    token_ids: Sequence[int],
    namespace: str = "",
) -> ChainMatch:
    """The longest stored prefix of `token_ids` in `namespace` (only trusted artifacts'
    pages are indexed; see chains.longest_run), and the artifact vouching for its last page:
    it holds every page before it too."""
    entries, tokens = chains.longest_run(
        txn, dbs, fingerprint, profile, layout, token_ids, namespace
    )
    if not entries:
        return NO_MATCH
    last_key = chains.entry_keys(fingerprint, profile, layout, entries, namespace)[-1]
    aid = voucher(txn, dbs, last_key)
    if aid is None:  # an entry is registered only with a voucher
        return NO_MATCH
    provenance = read(txn, dbs, aid)
    owner = owner_in(namespace)
    if owner is None:  # a published artifact's manifest names its owner (only then read)
        found = txn.get(aid, db=dbs["artifacts"])
        owner = owner_of(decode_record(found).manifest().labels) if found is not None else ""
    grafted = pb.GraftedArtifact(
        artifact_id=aid.hex(),
        tokens=tokens,
        trust=provenance.trust,
        vouched_by=provenance.vouched_by,
        owner=owner,
    )
    return ChainMatch(entries, tokens, [grafted])


def longest_untrusted(
    txn,
    dbs,
    fingerprint: bytes,
    profile: pb.ComputeProfile,
    layout: pb.KvLayout,
    token_ids: Sequence[int],
    visible: Callable[[Mapping[str, str]], bool] | None = None,
) -> tuple[int, str]:
    """The longest prefix of `token_ids` an untrusted artifact of this model and profile
    holds (tokens it would reuse once trusted: on the fixed schedule its chain pages
    only), and that artifact's id; (0, "") if none. It looks at the few artifacts listed
    nearest the prompt (UNTRUSTED_CANDIDATES): an answer to name, not a search. Only
    artifacts whose labels `visible` accepts count (a tenant's own and the shared)."""
    best, best_id = 0, ""
    for aid in chains.nearest_heads(txn, dbs["untrusted_heads"], token_ids, UNTRUSTED_CANDIDATES):
        found = txn.get(aid, db=dbs["artifacts"])
        if found is None or txn.get(aid, db=dbs["quarantine"]) is not None:
            continue
        manifest = decode_record(found).manifest()
        if visible is not None and not visible(manifest.labels):
            continue
        if (manifest.model_fingerprint, manifest.profile, manifest.layout) != (
            fingerprint,
            profile,
            layout,
        ):
            continue
        shared = chains.shared_start(manifest.token_ids, token_ids)
        if not chains.row_invariant(profile):
            eligible = chains.chain_pages(manifest) * profile.page_tokens
            shared = min(shared, eligible) // profile.page_tokens * profile.page_tokens
        if shared > best:
            best, best_id = shared, aid.hex()
    return best, best_id


def clear_chains(txn, dbs) -> None:
    """Format 2 -> 3: no artifact is trusted yet, so none has pages in the chain index."""
    txn.drop(dbs["chains"], delete=False)
    txn.drop(dbs["chain_children"], delete=False)
    txn.drop(dbs["vouchers"], delete=False)
