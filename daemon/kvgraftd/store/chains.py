"""Chain keys: finding stored pages by the tokens that produced them.

A full page computed in one forward pass has exactly the bytes a fresh
canonical run computes, given the same earlier pages (docs/architecture.md, contract 2).
Its chain key names it by what produced it:

    root     = SHA-256("kvgraft-chain-root/1" | fingerprint | profile | layout)
    key(p)   = SHA-256(key(p-1) | fingerprint | token ids of page p | p),  key(-1) = root

so a lookup walks a token sequence page by page and stops at the first miss.
The root binds the model fingerprint, compute profile (page size included)
and KV layout: pages of another model or profile are never found. Every hit
is confirmed by comparing the stored token ids with the requested ones.

On the fixed schedule (a profile whose products are torch's), a page of an
artifact gets a chain entry only if it and every page before it were computed
whole: all pages before the artifact's first segment end that is not a
multiple of page_tokens. Pages written by generation (one token per forward)
or after a mid-page append never qualify. With row-invariant products
(profile.products set), a position's bits depend on the tokens up to it
alone, so every page qualifies, the partial tail page too (its key hashes its
fewer tokens), and the first r rows of any stored page are the KV of its first
r tokens: a lookup reuses a prefix to the token, as a radix tree would. It
follows whole pages by their keys while they match; where the prompt's next
page is not stored whole, it takes the stored page after the same parent that
shares the longest start with it (any length, a tail page's too) and uses that
many of its rows.

To find that page without trying every length, each entry is also listed
under its parent in the `chain_children` sub-database, keyed by its tokens
in order (token + 1 as big-endian u32, then four zero bytes: a sequence sorts
right before its extensions): the entry sharing the longest start with a
sequence is the one sorted right before or right after it. Keys hold at most
CHILD_KEY_TOKENS tokens (LMDB's 511-byte keys); past that, the entries that
share them are compared one by one.

Entry value: count (u32, artifacts that registered it) | page index (u64) |
token count (u32) | token ids (u32 each) | one 32-byte page hash per layer.
Children: parent key | tokens as above | child key -> b"".
`register` and `longest_run` keep both in the store's transactions (`dbs`: its
sub-databases by name); the rest are pure functions.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvgraft.artifact import canonical_bytes
from kvgraft.tenancy import namespace_of
from kvgraft.v1 import kvgraft_pb2 as pb

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<IQI")  # count, page index, tokens
_COUNT = struct.Struct("<I")
CHILD_KEY_TOKENS = 110  # parent (32) + 4 a token + end mark (4) + key (32) <= 511 bytes
_END = bytes(4)
MAX_COMPARED = 256  # entries sharing a key's every token compared one by one (page_tokens > 110)


@dataclass(frozen=True)
class ChainEntry:
    count: int
    page_index: int
    token_ids: tuple[int, ...]
    page_sha256: tuple[bytes, ...]  # one per layer
    parent: bytes = field(default=b"", compare=False)  # its parent's key (not stored in it)

    def encode(self) -> bytes:
        head = _HEAD.pack(self.count, self.page_index, len(self.token_ids))
        return (
            head
            + struct.pack(f"<{len(self.token_ids)}I", *self.token_ids)
            + b"".join(self.page_sha256)
        )

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> ChainEntry:
        view = memoryview(raw)
        count, page_index, tokens = _HEAD.unpack(view[: _HEAD.size])
        ids_end = _HEAD.size + 4 * tokens
        token_ids = struct.unpack(f"<{tokens}I", view[_HEAD.size : ids_end])
        hashes = bytes(view[ids_end:])
        return cls(
            count,
            page_index,
            token_ids,
            tuple(hashes[i : i + 32] for i in range(0, len(hashes), 32)),
        )


def chain_root(
    fingerprint: bytes, profile: pb.ComputeProfile, layout: pb.KvLayout, namespace: str = ""
) -> bytes:
    """The parent of a prompt's first page. A tenant's pages and the shared ones hang
    under roots of their own (kvgraft.tenancy.namespace_of): no chain key of one
    namespace is ever a key of another, so a lookup never meets another tenant's pages.
    The operator's namespace ("") keeps the root of a daemon without tenants."""
    digest = hashlib.sha256(b"kvgraft-chain-root/1\0" + fingerprint)
    digest.update(canonical_bytes(profile))
    digest.update(canonical_bytes(layout))
    if namespace:
        digest.update(b"\0namespace\0" + namespace.encode())
    return digest.digest()


def chain_key(
    parent: bytes, fingerprint: bytes, token_ids: Sequence[int], page_index: int
) -> bytes:
    packed = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return hashlib.sha256(parent + fingerprint + packed + struct.pack("<Q", page_index)).digest()


def chain_keys(
    fingerprint: bytes,
    profile: pb.ComputeProfile,
    layout: pb.KvLayout,
    token_ids: Sequence[int],
    pages: int,
    namespace: str = "",
) -> Iterator[tuple[int, bytes]]:
    """(page index, chain key) of the first `pages` whole pages of `token_ids`."""
    page_tokens = profile.page_tokens
    key = chain_root(fingerprint, profile, layout, namespace)
    for page in range(pages):
        key = chain_key(
            key, fingerprint, token_ids[page * page_tokens : (page + 1) * page_tokens], page
        )
        yield page, key


def row_invariant(profile: pb.ComputeProfile) -> bool:
    return bool(profile.products)


def chain_pages(manifest: pb.Manifest) -> int:
    """How many leading pages of the artifact are chain-eligible: on the fixed schedule,
    those computed whole; with row-invariant products, every page, the tail included."""
    page_tokens = manifest.profile.page_tokens
    limit = len(manifest.token_ids)
    if row_invariant(manifest.profile):
        return -(-limit // page_tokens)
    for end in manifest.segment_ends:
        if end % page_tokens:
            limit = min(limit, end)
            break
    return limit // page_tokens


def manifest_entries(manifest: pb.Manifest) -> Iterator[tuple[bytes, ChainEntry]]:
    """The chain entries (count 1) an artifact registers."""
    layers = manifest.layout.num_layers
    page_tokens = manifest.profile.page_tokens
    pages = chain_pages(manifest)
    namespace = namespace_of(manifest.labels)
    fingerprint, profile, layout = manifest.model_fingerprint, manifest.profile, manifest.layout
    keys = chain_keys(fingerprint, profile, layout, manifest.token_ids, pages, namespace)
    parent = chain_root(fingerprint, profile, layout, namespace)
    for page, key in keys:
        tokens = tuple(manifest.token_ids[page * page_tokens : (page + 1) * page_tokens])
        hashes = tuple(manifest.page_sha256[page * layers : (page + 1) * layers])
        yield key, ChainEntry(1, page, tokens, hashes, parent)
        parent = key


def register(txn, dbs, entries: list[tuple[bytes, ChainEntry]], delta: int) -> None:
    """Count an artifact's pages (its `manifest_entries`) in (+1) or out (-1) of the chain
    index, listing each new entry under its parent and unlisting each one gone. (The
    stored entry is compared and recounted as bytes: its hashes end it, its count begins
    it; every commit and removal does this for each page.)"""
    chains, children = dbs["chains"], dbs["chain_children"]
    for key, entry in entries:
        found = txn.get(key, db=chains)
        if found is None:
            if delta > 0:
                txn.put(key, entry.encode(), db=chains)
                txn.put(child_key(entry.parent, entry.token_ids, key), b"", db=children)
            continue
        found = bytes(found)
        if not found.endswith(b"".join(entry.page_sha256)):
            if delta > 0:
                # Same tokens, same model and profile, other bytes: the run that
                # produced one of them was not deterministic. Keep the first.
                log.warning(
                    "chain page %d has two different contents; kept the first", entry.page_index
                )
            continue
        count = _COUNT.unpack_from(found)[0] + delta
        if count:
            txn.put(key, _COUNT.pack(count) + found[_COUNT.size :], db=chains)
        else:
            txn.delete(key, db=chains)
            txn.delete(child_key(entry.parent, entry.token_ids, key), db=children)


def child_key(parent: bytes, token_ids: Sequence[int], key: bytes) -> bytes:
    """An entry's key in `chain_children`: its parent's key, its tokens in order, its key."""
    return parent + _sort_key(token_ids) + key


def _sort_key(token_ids: Sequence[int]) -> bytes:
    """Tokens as bytes whose order is the sequences' (a prefix first): token + 1, big-endian
    (ids near 2**32 share a value; the stored tokens decide), then an end mark when whole."""
    shown = token_ids[:CHILD_KEY_TOKENS]
    packed = struct.pack(f">{len(shown)}I", *(min(t + 1, 0xFFFFFFFF) for t in shown))
    return packed + (_END if len(token_ids) <= CHILD_KEY_TOKENS else b"")


def head_key(token_ids: Sequence[int], aid: bytes) -> bytes:
    """An artifact listed by its first tokens (`untrusted_heads`): sorted as in
    `chain_children`, so the ones sharing the longest start with a prompt sort near it."""
    return _sort_key(token_ids[:CHILD_KEY_TOKENS]) + aid


def nearest_heads(txn, db, token_ids: Sequence[int], most: int) -> list[bytes]:
    """The artifacts (ids) listed around `token_ids` by `head_key`, up to `most`: half
    sorted after it, half before. The one sharing the longest start with it is among them
    unless more than half as many share as much (then some of those are)."""
    cursor = txn.cursor(db=db)
    query = _sort_key(token_ids)[: 4 * CHILD_KEY_TOKENS]
    after: list[bytes] = []
    if cursor.set_range(query):
        for key in cursor.iternext(values=False):
            after.append(bytes(key)[-32:])
            if len(after) == max(1, most // 2):
                break
        has_before = cursor.set_range(query) and cursor.prev()
    else:
        has_before = cursor.last()
    before: list[bytes] = []
    if has_before:
        for key in cursor.iterprev(values=False):
            before.append(bytes(key)[-32:])
            if len(before) >= most - max(1, most // 2):
                break
    return after + before


def longest_run(
    txn,
    dbs,
    fingerprint: bytes,
    profile: pb.ComputeProfile,
    layout: pb.KvLayout,
    token_ids: Sequence[int],
    namespace: str = "",
) -> tuple[list[ChainEntry], int]:
    """The entries of the longest stored prefix of `token_ids`, and its length in tokens:
    whole pages while they match, then, with row-invariant products, the stored page that
    shares the longest start with the rest of the page (its first rows: a tail page, or any
    page used in part)."""
    page_tokens = profile.page_tokens
    found: list[ChainEntry] = []
    parent = chain_root(fingerprint, profile, layout, namespace)
    for page in range(-(-len(token_ids) // page_tokens)):
        wanted = token_ids[page * page_tokens : (page + 1) * page_tokens]
        if len(wanted) == page_tokens:
            key = chain_key(parent, fingerprint, wanted, page)
            entry = _entry(txn, dbs["chains"], key, wanted)
            if entry is not None:
                found.append(entry)
                parent = key
                continue
        if row_invariant(profile):
            entry, shared = _closest_child(txn, dbs, parent, wanted)
            if entry is not None:
                found.append(entry)
                return found, page * page_tokens + shared
        break
    return found, len(found) * page_tokens


def _closest_child(txn, dbs, parent: bytes, wanted: Sequence[int]) -> tuple[ChainEntry | None, int]:
    """The entry after `parent` sharing the longest start with `wanted`, and how many tokens
    it shares (0: none). It sorts next to `wanted` in `chain_children`, unless they share
    all CHILD_KEY_TOKENS a key holds: then those that do are compared, up to MAX_COMPARED."""
    cursor = txn.cursor(db=dbs["chain_children"])
    query = parent + _sort_key(wanted)[: 4 * CHILD_KEY_TOKENS]
    keys = []
    if cursor.set_range(query):
        keys.append(bytes(cursor.key()))
        if cursor.prev():
            keys.append(bytes(cursor.key()))
    elif cursor.last():
        keys.append(bytes(cursor.key()))
    best: tuple[ChainEntry | None, int] = (None, 0)
    for key in keys:
        best = _better(txn, dbs, parent, key, wanted, best)
    if best[1] >= CHILD_KEY_TOKENS and cursor.set_range(query):
        for _, key in zip(range(MAX_COMPARED), cursor.iternext(values=False), strict=False):
            if not bytes(key).startswith(query):
                break
            best = _better(txn, dbs, parent, bytes(key), wanted, best)
    return best


def _better(txn, dbs, parent: bytes, key: bytes, wanted: Sequence[int], best):
    if not key.startswith(parent):
        return best
    raw = txn.get(key[-32:], db=dbs["chains"])
    if raw is None:
        return best
    entry = ChainEntry.decode(raw)
    shared = shared_start(entry.token_ids, wanted)
    return (entry, shared) if shared > best[1] else best


def shared_start(stored: Sequence[int], wanted: Sequence[int]) -> int:
    """How many leading tokens the two sequences share."""
    shared = 0
    for a, b in zip(stored, wanted, strict=False):
        if a != b:
            break
        shared += 1
    return shared


def entry_keys(
    fingerprint: bytes,
    profile: pb.ComputeProfile,
    layout: pb.KvLayout,
    entries: Sequence[ChainEntry],
    namespace: str = "",
) -> list[bytes]:
    """The chain keys of a run of entries (as `longest_run` found them)."""
    keys, key = [], chain_root(fingerprint, profile, layout, namespace)
    for entry in entries:
        key = chain_key(key, fingerprint, entry.token_ids, entry.page_index)
        keys.append(key)
    return keys


def _entry(txn, db, key: bytes, token_ids: Sequence[int]) -> ChainEntry | None:
    raw = txn.get(key, db=db)
    if raw is None:
        return None
    entry = ChainEntry.decode(raw)
    # a hash collision would land here: the stored tokens decide
    return entry if entry.token_ids == tuple(token_ids) else None
