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
alone, so every page qualifies, the partial tail page too: its key hashes its
fewer tokens, and a lookup that misses a whole page tries the tails that
begin the rest of the prompt, longest first (a 14-token deposit is found by a
prompt that extends it).

Entry value: count (u32, artifacts that registered it) | page index (u64) |
token count (u32) | token ids (u32 each) | one 32-byte page hash per layer.
`register` and `longest_run` keep the entries in the store's `chains`
sub-database, inside the store's transactions; the rest are pure functions.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvgraft.artifact import canonical_bytes
from kvgraft.v1 import kvgraft_pb2 as pb

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<IQI")  # count, page index, tokens
_COUNT = struct.Struct("<I")


@dataclass(frozen=True)
class ChainEntry:
    count: int
    page_index: int
    token_ids: tuple[int, ...]
    page_sha256: tuple[bytes, ...]  # one per layer

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

    def with_count(self, count: int) -> ChainEntry:
        return ChainEntry(count, self.page_index, self.token_ids, self.page_sha256)


def chain_root(fingerprint: bytes, profile: pb.ComputeProfile, layout: pb.KvLayout) -> bytes:
    digest = hashlib.sha256(b"kvgraft-chain-root/1\0" + fingerprint)
    digest.update(canonical_bytes(profile))
    digest.update(canonical_bytes(layout))
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
) -> Iterator[tuple[int, bytes]]:
    """(page index, chain key) of the first `pages` whole pages of `token_ids`."""
    page_tokens = profile.page_tokens
    key = chain_root(fingerprint, profile, layout)
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
    keys = chain_keys(
        manifest.model_fingerprint, manifest.profile, manifest.layout, manifest.token_ids, pages
    )
    for page, key in keys:
        tokens = tuple(manifest.token_ids[page * page_tokens : (page + 1) * page_tokens])
        hashes = tuple(manifest.page_sha256[page * layers : (page + 1) * layers])
        yield key, ChainEntry(1, page, tokens, hashes)


def register(txn, db, entries: list[tuple[bytes, ChainEntry]], delta: int) -> None:
    """Count an artifact's whole pages (its `manifest_entries`) in (+1) or out (-1) of the
    chain index. (The stored entry is compared and recounted as bytes: its hashes end it,
    its count begins it; every commit and removal does this for each page.)"""
    for key, entry in entries:
        found = txn.get(key, db=db)
        if found is None:
            if delta > 0:
                txn.put(key, entry.encode(), db=db)
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
            txn.put(key, _COUNT.pack(count) + found[_COUNT.size :], db=db)
        else:
            txn.delete(key, db=db)


def longest_run(
    txn,
    db,
    fingerprint: bytes,
    profile: pb.ComputeProfile,
    layout: pb.KvLayout,
    token_ids: Sequence[int],
    max_pages: int,
) -> list[ChainEntry]:
    """Entries of the longest run of registered pages starting `token_ids`: whole pages (at
    most `max_pages`), then, with row-invariant products, the longest partial tail page
    that begins the tokens left (within `token_ids`)."""
    page_tokens = profile.page_tokens
    found: list[ChainEntry] = []
    parent = chain_root(fingerprint, profile, layout)
    for page, key in chain_keys(fingerprint, profile, layout, token_ids, max_pages):
        entry = _entry(txn, db, key, token_ids[page * page_tokens : (page + 1) * page_tokens])
        if entry is None:
            break
        found.append(entry)
        parent = key
    if row_invariant(profile):
        begin = len(found) * page_tokens
        rest = token_ids[begin : begin + page_tokens - 1]
        for length in range(len(rest), 0, -1):
            key = chain_key(parent, fingerprint, rest[:length], len(found))
            entry = _entry(txn, db, key, rest[:length])
            if entry is not None:
                found.append(entry)
                break
    return found


def entry_keys(
    fingerprint: bytes,
    profile: pb.ComputeProfile,
    layout: pb.KvLayout,
    entries: Sequence[ChainEntry],
) -> list[bytes]:
    """The chain keys of a run of entries (as `longest_run` found them)."""
    keys, key = [], chain_root(fingerprint, profile, layout)
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
