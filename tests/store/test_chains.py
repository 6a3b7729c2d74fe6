"""The chain index as a radix tree: the longest stored prefix of a prompt, to the token.

With row-invariant products, the first r rows of any stored page are the KV of its first
r tokens, so a lookup reuses any prefix of any stored sequence: whole pages while they
match, then the stored page after them that shares the longest start with the prompt's
next tokens (kvgraftd.store.chains). On the fixed schedule, whole pages only. Real stores
on disk; artifacts of random bytes with chosen tokens.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import lmdb
import pytest

from kvgraft.artifact import Artifact
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store import chains
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.page_records import page_records_of
from tests.support.factory import FINGERPRINT

COMPUTED = pb.Provenance(trust=pb.Provenance.TRUST_COMPUTED, origin="computed")
UNTRUSTED = pb.Provenance(trust=pb.Provenance.TRUST_UNTRUSTED, origin="upload")
LAYOUT = pb.KvLayout(
    num_layers=2,
    kv_heads=1,
    head_dim=4,  # a row: 32 bytes
    kv_dtype=pb.KV_DTYPE_FLOAT32,
)


def _profile(page_tokens: int, row_invariant: bool = True) -> pb.ComputeProfile:
    products = "row-invariant-fma rowwise=1" if row_invariant else ""
    return pb.ComputeProfile(
        torch_version="test", device_kind="cpu", page_tokens=page_tokens, products=products
    )


def _artifact(token_ids: list[int], profile: pb.ComputeProfile) -> Artifact:
    """Rows that depend on the tokens up to them, as the row-invariant forward's do."""
    page_tokens = profile.page_tokens
    pages = [
        b"".join(
            hashlib.sha256(struct.pack(f"<{end + 1}I", layer, *token_ids[:end])).digest()
            for end in range(start + 1, min(start + page_tokens, len(token_ids)) + 1)
        )
        for start in range(0, len(token_ids), page_tokens)
        for layer in range(LAYOUT.num_layers)
    ]
    return Artifact.build(
        model_fingerprint=FINGERPRINT,
        layout=LAYOUT,
        profile=profile,
        token_ids=token_ids,
        page_bytes=pages,
    )


@pytest.fixture
def store(tmp_path: Path):
    s = Store(tmp_path / "store", initial_map_bytes=1 << 22, min_free_bytes=0)
    yield s
    s.close()


def _commit(store: Store, artifact: Artifact, provenance=COMPUTED) -> str:
    records = page_records_of(artifact.pages)
    return store.commit_artifact(artifact.manifest, records, provenance).artifact_id


def _match(store: Store, token_ids: list[int], profile: pb.ComputeProfile):
    return store.longest_chain(FINGERPRINT, profile, LAYOUT, token_ids)


def _pages_of(artifact: Artifact) -> list[tuple[bytes, ...]]:
    layers = LAYOUT.num_layers
    hashes = list(artifact.manifest.page_sha256)
    return [tuple(hashes[i : i + layers]) for i in range(0, len(hashes), layers)]


def test_a_prompt_reuses_any_prefix_of_any_stored_page(store, rng) -> None:
    profile = _profile(page_tokens=8)
    base = [rng.randrange(1000) for _ in range(40)]
    # siblings after the same two pages: they share 0, 3 and 6 tokens of page 2 with `base`
    siblings = [
        base[:16] + [2000 + i for i in range(8)],
        base[:19] + [3000 + i for i in range(5)],
        [*base[:22], 4000, 4001],
    ]
    stored = [_artifact(tokens, profile) for tokens in [base, *siblings]]
    ids = [_commit(store, artifact) for artifact in stored]
    by_id = dict(zip(ids, stored, strict=True))

    # the cases: 473 of a 479-token document's, 81 of a 100-token deposit's, and
    # a prompt made of the first 14 tokens of a 16-token deposit: each to the token
    for shared, extra in ((39, [5000]), (21, [6000, 6001]), (13, [])):
        prompt = base[:shared] + extra
        match = _match(store, prompt, profile)
        assert match.tokens == shared
        (grafted,) = match.grafted
        assert grafted.tokens == shared
        holder = by_id[grafted.artifact_id]  # one holding them (several may: any of those)
        assert list(holder.manifest.token_ids[:shared]) == prompt[:shared]
        assert [e.page_sha256 for e in match.entries] == _pages_of(holder)[: -(-shared // 8)]

    # the sibling sharing the most of page 2 with the prompt is the one taken
    prompt = [*base[:19], 3000, 3001, 3002, 7]
    match = _match(store, prompt, profile)
    assert (match.tokens, match.grafted[0].artifact_id) == (22, ids[2])
    assert match.entries[-1].page_sha256 == _pages_of(stored[2])[2]
    assert _match(store, [*base[:22], 4000, 9], profile).tokens == 23
    assert _match(store, [base[0] + 1], profile).tokens == 0  # a first token nobody has
    assert _match(store, [], profile).tokens == 0

    # a tail page is a prefix like any other: a 5-token artifact serves 1..5 of its tokens
    short = [7000 + i for i in range(5)]
    short_id = _commit(store, _artifact(short, profile))
    for length in range(1, 6):
        match = _match(store, [*short[:length], 1], profile)
        assert (match.tokens, match.grafted[0].artifact_id) == (length, short_id)

    # deleted or untrusted artifacts' pages are not offered
    store.delete_artifact(ids[2])
    assert _match(store, [*base[:19], 3000, 3001, 3002, 7], profile).tokens == 19
    untrusted = [8000 + i for i in range(12)]
    untrusted_id = _commit(store, _artifact(untrusted, profile), UNTRUSTED)
    assert _match(store, untrusted, profile).tokens == 0
    # ... but Lookup names the untrusted artifact holding them, until it is trusted
    assert _untrusted(store, [*untrusted[:10], 1], profile) == (10, untrusted_id)
    assert _untrusted(store, untrusted[:3], profile) == (3, untrusted_id)
    assert _untrusted(store, [1, 2], profile) == (0, "")
    store.trust_artifact(untrusted_id, COMPUTED)
    assert _untrusted(store, untrusted, profile) == (0, "")
    assert _match(store, untrusted, profile).tokens == 12


def test_lookup_names_the_untrusted_artifact_holding_the_most(store) -> None:
    profile = _profile(page_tokens=8)
    shared = list(range(100, 120))
    # many untrusted artifacts start alike: the one sharing the most is among those looked at
    ids = {
        length: _commit(store, _artifact([*shared[:length], 9000 + length], profile), UNTRUSTED)
        for length in range(1, 21)
    }
    for length in (1, 7, 13, 20):
        prompt = [*shared[:length], 9000 + length, 5]
        assert _untrusted(store, prompt, profile) == (length + 1, ids[length])
    other_model = _artifact([*shared, 9020, 5], _profile(page_tokens=16))  # another profile
    _commit(store, other_model, UNTRUSTED)
    assert _untrusted(store, [*shared, 9020, 5], profile) == (21, ids[20])
    store.delete_artifact(ids[20])
    assert _untrusted(store, [*shared, 9020, 5], profile) == (19, ids[19])


def _untrusted(store: Store, token_ids: list[int], profile: pb.ComputeProfile):
    return store.longest_untrusted(FINGERPRINT, profile, LAYOUT, token_ids)


def test_the_closest_page_is_found_among_many_siblings(store, rng) -> None:
    profile = _profile(page_tokens=16)
    shared = [rng.randrange(1000) for _ in range(16)]
    pages = [[rng.randrange(50) for _ in range(16)] for _ in range(200)]
    for page in pages:
        _commit(store, _artifact(shared + page, profile))
    for _ in range(100):
        prompt = shared + [rng.randrange(50) for _ in range(17)]
        best = 0
        for page in pages:
            common = next(
                (i for i, (x, y) in enumerate(zip(page, prompt[16:], strict=True)) if x != y), 16
            )
            best = max(best, common)
        assert _match(store, prompt, profile).tokens == 16 + best


def test_pages_longer_than_a_key_are_compared_past_it(store, rng) -> None:
    page_tokens = chains.CHILD_KEY_TOKENS + 20
    profile = _profile(page_tokens)
    head = [rng.randrange(1000) for _ in range(chains.CHILD_KEY_TOKENS + 5)]
    for tail in range(6):
        _commit(store, _artifact(head + [tail] * 15, profile))
    assert _match(store, [*head, 3, 3, 3, 9], profile).tokens == len(head) + 3
    assert _match(store, [*head[:50], 9], profile).tokens == 50


def test_the_fixed_schedule_reuses_whole_pages_only(store, rng) -> None:
    profile = _profile(page_tokens=8, row_invariant=False)
    tokens = [rng.randrange(1000) for _ in range(24)]
    _commit(store, _artifact(tokens, profile))
    assert _match(store, [*tokens[:23], 1], profile).tokens == 16
    assert _match(store, [*tokens, 1], profile).tokens == 24


def test_a_format_3_store_lists_chain_entries_and_untrusted_artifacts_when_opened(
    tmp_path: Path, rng
) -> None:
    profile = _profile(page_tokens=8)
    tokens = [rng.randrange(1000) for _ in range(20)]
    path = tmp_path / "store"
    store = Store(path, initial_map_bytes=1 << 22, min_free_bytes=0)
    _commit(store, _artifact(tokens, profile))
    untrusted = [rng.randrange(1000, 2000) for _ in range(20)]
    untrusted_id = _commit(store, _artifact(untrusted, profile), UNTRUSTED)
    store.close()
    # what a format-3 kvgraft left: no chain_children, no untrusted_heads
    env = lmdb.open(str(path), max_dbs=32)
    with env.begin(write=True) as txn:
        for name in (b"chain_children", b"untrusted_heads"):
            txn.drop(env.open_db(name, txn=txn), delete=False)
        txn.put(b"format_version", b"3", db=env.open_db(b"meta", txn=txn))
    env.close()
    store = Store(path, initial_map_bytes=1 << 22, min_free_bytes=0)
    try:
        assert _match(store, [*tokens[:11], 1], profile).tokens == 11
        assert _untrusted(store, [*untrusted[:15], 1], profile) == (15, untrusted_id)
    finally:
        store.close()
