"""Audit a live store against what clients sent: for crash and concurrency tests.

A test keeps the artifacts it sent (manifest and page bytes) and asks this
module two things: is an artifact the store serves byte-identical to the one
sent (`assert_served_whole`), and does the whole store hold exactly a given set
of artifacts, with counters, reference counts and change feed to match
(`audit_store`). It also makes artifacts of the shapes those tests need:
multi-MiB ones, ones whose pages are larger than one gRPC message, and ones
that share pages with an earlier artifact.

Everything is checked through the daemon's public API; nothing here opens
the LMDB files.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Mapping

from kvgraft import Client
from kvgraft.artifact import Artifact, canonical_bytes, page_sizes
from kvgraft.v1 import kvgraft_pb2 as pb
from tests.support.factory import random_artifact

F32 = pb.KV_DTYPE_FLOAT32


def multi_mib_artifact(rng: random.Random) -> Artifact:
    """1 to 8 MiB in pages of 128 KiB: a put of several gRPC messages."""
    return random_artifact(
        rng,
        num_layers=rng.randint(2, 8),
        kv_heads=4,
        head_dim=64,
        kv_dtype=F32,
        page_tokens=64,
        tokens=rng.randint(129, 512),
    )


def big_page_artifact(rng: random.Random) -> Artifact:
    """Pages of up to 8 MiB: each travels as chunks spread over several messages."""
    return random_artifact(
        rng,
        num_layers=rng.randint(1, 2),
        kv_heads=8,
        head_dim=128,
        kv_dtype=F32,
        page_tokens=1024,
        tokens=rng.randint(600, 1500),
    )


def derived_artifact(rng: random.Random, parent: Artifact, share: float = 0.5) -> Artifact:
    """A new artifact of `parent`'s geometry reusing about `share` of its pages.

    Same token count and page size, so every reused page has the size the new
    manifest expects; new token ids give a new id. Sometimes one page is named
    twice inside the new artifact too (deduplicated within one manifest).
    """
    manifest = parent.manifest
    layers = manifest.layout.num_layers
    pages: list[bytes] = []
    for digest in manifest.page_sha256:
        if rng.random() < share:
            pages.append(bytes(parent.pages[digest]))
        else:
            pages.append(rng.randbytes(page_sizes(manifest)[digest]))
    if layers > 1 and rng.random() < 0.3:
        pages[1] = pages[0]  # layers 0 and 1 of page 0: the same size
    tokens = [rng.randrange(50_000) for _ in manifest.token_ids]
    return Artifact.build(
        model_fingerprint=manifest.model_fingerprint,
        layout=manifest.layout,
        profile=manifest.profile,
        token_ids=tokens,
        page_bytes=pages,
        segment_ends=list(manifest.segment_ends),
        labels={"parent": parent.id[:16]},
    )


def distinct_page_sizes(artifacts: Iterable[Artifact]) -> dict[bytes, int]:
    """Every distinct page the artifacts name, with its size."""
    sizes: dict[bytes, int] = {}
    for artifact in artifacts:
        sizes.update(page_sizes(artifact.manifest))
    return sizes


def pages_freed_by_delete(victim: Artifact, others: Iterable[Artifact]) -> tuple[int, int]:
    """(pages, bytes) a delete of `victim` must free while `others` remain stored."""
    kept = distinct_page_sizes(others)
    own = page_sizes(victim.manifest)
    freed = {digest: size for digest, size in own.items() if digest not in kept}
    return len(freed), sum(freed.values())


def assert_served_whole(fetched: Artifact, sent: Artifact) -> None:
    """The artifact read back is the one sent, to the byte."""
    assert canonical_bytes(fetched.manifest) == canonical_bytes(sent.manifest), sent.id
    assert fetched.id == sent.id
    assert set(fetched.pages) == set(page_sizes(sent.manifest)), sent.id
    for digest, data in fetched.pages.items():
        got = bytes(data)
        assert hashlib.sha256(got).digest() == digest, f"{sent.id}: page {digest.hex()[:16]}"
        assert got == bytes(sent.pages[digest]), f"{sent.id}: page {digest.hex()[:16]}"
    fetched.verify()


def feed_state(client: Client) -> tuple[set[str], int]:
    """Replay the whole change feed: (ids added and not deleted since, records)."""
    present: set[str] = set()
    records = 0
    expected_sequence = 1
    for record in client.watch(1):
        assert record.sequence == expected_sequence, "the change feed skips or repeats"
        expected_sequence += 1
        records += 1
        if record.kind == pb.ChangeRecord.KIND_ADDED:
            assert record.artifact_id not in present, f"{record.artifact_id} added twice"
            present.add(record.artifact_id)
        else:
            assert record.kind == pb.ChangeRecord.KIND_DELETED
            present.remove(record.artifact_id)
    return present, records


def audit_store(
    client: Client,
    expected: Mapping[str, Artifact],
    *,
    staged_pages: int = 0,
    read_pages: bool = True,
) -> None:
    """The store holds exactly `expected`, each whole; counters and feed agree.

    With `staged_pages` staged pages besides, Stats.pages and page_bytes are
    checked as referenced pages plus staged ones (staged sizes unknown here,
    so page_bytes is checked exactly only when nothing is staged). Without
    `read_pages`, the caller has read every artifact back already.
    """
    listed = {info.artifact_id: info for info in client.list_artifacts()}
    assert set(listed) == set(expected), (
        f"missing {sorted(set(expected) - set(listed))}, "
        f"unexpected {sorted(set(listed) - set(expected))}"
    )
    for aid, sent in expected.items():
        info = listed[aid]
        assert info.num_tokens == len(sent.manifest.token_ids)
        assert info.num_pages == len(sent.manifest.page_sha256)
        stat = client.stat(aid, include_manifest=True)
        assert canonical_bytes(stat.manifest) == canonical_bytes(sent.manifest)
        if read_pages:
            assert_served_whole(client.get_artifact(aid), sent)
    referenced = distinct_page_sizes(expected.values())
    stats = client.stats()
    assert stats.artifacts == len(expected)
    assert stats.staged_pages == staged_pages
    assert stats.pages == len(referenced) + staged_pages
    if not staged_pages:
        assert stats.page_bytes == sum(referenced.values())
    assert not client.missing_pages(referenced), "a referenced page is missing"
    present, records = feed_state(client)
    assert present == set(expected), "the change feed disagrees with the listing"
    assert stats.last_sequence == records


def delete_checked(client: Client, victim: Artifact, remaining: Iterable[Artifact]) -> None:
    """Delete `victim`; it must free exactly the pages no remaining artifact names."""
    pages, page_bytes = pages_freed_by_delete(victim, remaining)
    response = client.delete(victim.id)
    assert (response.pages_freed, response.bytes_freed) == (pages, page_bytes), victim.id
