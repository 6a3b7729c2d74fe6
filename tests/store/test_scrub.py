"""Scrub on a real store: a byte flipped on disk in a page nobody reads is found, the
artifacts holding it are quarantined (never served, out of the prefix index), and a good
copy committed again repairs them."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import numpy as np
import pytest

from kvgraft.artifact import Artifact, page_sizes
from kvgraft.errors import DataLoss, FailedPrecondition
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.page_records import page_records_of
from kvgraftd.store.scrub import Scrubber
from tests.support.factory import random_artifact
from tests.support.on_disk import flip_stored_page

COMPUTED = pb.Provenance(trust=pb.Provenance.TRUST_COMPUTED, origin="computed")
LAYOUT = {"num_layers": 2, "kv_heads": 2, "head_dim": 32, "kv_dtype": pb.KV_DTYPE_FLOAT32}


@pytest.fixture
def store(tmp_path: Path):
    s = Store(tmp_path / "store", initial_map_bytes=1 << 22, min_free_bytes=0)
    yield s
    s.close()


def _commit(store: Store, artifact) -> str:
    records = page_records_of(artifact.pages)
    return store.commit_artifact(artifact.manifest, records, COMPUTED).artifact_id


def _read(store: Store, manifest: pb.Manifest) -> None:
    sizes = page_sizes(manifest)
    store.read_pages_into(list(sizes), [np.empty(n, np.uint8) for n in sizes.values()])


def _one_segment(artifact, token_ids=None) -> Artifact:
    """The artifact's pages as one segment (whole pages of one segment enter the prefix
    index), optionally under other tokens."""
    manifest = artifact.manifest
    return Artifact.build(
        model_fingerprint=manifest.model_fingerprint,
        layout=manifest.layout,
        profile=manifest.profile,
        token_ids=token_ids or manifest.token_ids,
        page_bytes=[artifact.pages[d] for d in manifest.page_sha256],
    )


def test_scrub_finds_a_flipped_byte_quarantines_and_a_good_copy_repairs(store, rng) -> None:
    victim = _one_segment(random_artifact(rng, tokens=96, page_tokens=16, **LAYOUT))
    shared = {(p, layer): victim.page(p, layer) for p in range(3) for layer in range(2)}
    sibling = random_artifact(rng, tokens=80, page_tokens=16, shared_pages=shared, **LAYOUT)
    sibling = _one_segment(sibling, list(victim.manifest.token_ids[:48]) + [7] * 32)
    bystander = random_artifact(rng, tokens=64, page_tokens=16, **LAYOUT)
    for artifact in (victim, sibling, bystander):
        _commit(store, artifact)
    token_ids = list(victim.manifest.token_ids[:80])  # five whole pages
    profile, layout = victim.manifest.profile, victim.manifest.layout
    fingerprint = victim.manifest.model_fingerprint
    before = store.longest_chain(fingerprint, profile, layout, token_ids)
    assert len(before.entries) == 5

    bad = victim.page(1, 0)  # shared by the sibling too; nobody reads it before the scrub
    assert flip_stored_page(store.path, bad) == 1
    found = Scrubber(store, 1 << 40).run()
    assert found.done and found.pages_done == found.pages_total
    assert found.corrupt_pages == [victim.manifest.page_sha256[2].hex()]
    assert sorted(found.quarantined) == sorted([victim.id, sibling.id])
    assert sorted(store.quarantined_ids()) == sorted([victim.id, sibling.id])

    for quarantined in (victim, sibling):
        with pytest.raises(DataLoss, match="quarantined"):
            store.check_servable(quarantined.id)
    store.check_servable(bystander.id)
    _read(store, bystander.manifest)
    after = store.longest_chain(fingerprint, profile, layout, token_ids)
    assert after.entries == []  # every artifact holding this prefix is quarantined
    assert store.missing_pages(list(page_sizes(victim.manifest))) == [bad_digest(victim)]

    # a good copy (a replica's put, a pull): only the missing page is written
    result = store.commit_artifact(victim.manifest, page_records_of(victim.pages), COMPUTED)
    assert result.already_present and result.pages_written == 1
    assert store.quarantined_ids() == []  # the sibling is whole again too
    _read(store, victim.manifest)
    _read(store, sibling.manifest)
    repaired = store.longest_chain(fingerprint, profile, layout, token_ids)
    assert [e.page_sha256 for e in repaired.entries] == [e.page_sha256 for e in before.entries]
    assert not Scrubber(store, 1 << 40).run().corrupt_pages


def bad_digest(artifact) -> bytes:
    return artifact.manifest.page_sha256[2]


def test_a_deleted_quarantined_artifact_takes_its_pages_with_it(store, rng) -> None:
    victim = random_artifact(rng, tokens=32, page_tokens=16, **LAYOUT)
    _commit(store, victim)
    flip_stored_page(store.path, victim.page(0, 1))
    assert Scrubber(store, 1 << 40).run().quarantined == [victim.id]
    store.delete_artifact(victim.id)
    assert store.stats().pages == 0 and store.quarantined_ids() == []


def test_scrub_keeps_its_pace_and_one_runs_at_a_time(store, rng) -> None:
    for _ in range(4):
        _commit(store, random_artifact(rng, tokens=64, page_tokens=16, **LAYOUT))
    total = store.stats().page_bytes
    scrubber = Scrubber(store, total)  # a second's worth at this rate
    outcome = []
    first = threading.Thread(target=lambda: outcome.append(scrubber.run()))
    first.start()
    while not scrubber.progress().running:
        pass
    with pytest.raises(FailedPrecondition, match="running"):
        scrubber.run()
    first.join()
    assert outcome[0].bytes_done == total and outcome[0].finished_unix_ms
    elapsed_ms = outcome[0].finished_unix_ms - outcome[0].started_unix_ms
    assert elapsed_ms >= 900  # the rate: about one second for the store's bytes


def test_random_stores_every_flip_found(tmp_path, rng) -> None:
    """Many artifacts, a byte flipped in a random tenth of the pages: each one is found."""
    store = Store(tmp_path / "s", initial_map_bytes=1 << 24, min_free_bytes=0)
    artifacts = [random_artifact(random.Random(i), tokens=48, page_tokens=16) for i in range(40)]
    for artifact in artifacts:
        _commit(store, artifact)
    digests = sorted({d for a in artifacts for d in a.pages})
    flipped = set(rng.sample(digests, len(digests) // 10))
    pages = {d: a.pages[d] for a in artifacts for d in a.pages}
    for digest in flipped:  # `at` counts from the page's middle
        size = len(pages[digest])
        assert flip_stored_page(store.path, pages[digest], at=rng.randrange(size) - size // 2)
    found = Scrubber(store, 1 << 40).run()
    assert {bytes.fromhex(d) for d in found.corrupt_pages} == flipped
    store.close()
