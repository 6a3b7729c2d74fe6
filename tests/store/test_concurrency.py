"""Concurrency: readers during writes see whole artifacts only; shared pages count right.

The store commits an artifact (pages, reference counts, manifest, change
record) in one write transaction and serves reads from short read
transactions, so whatever runs at the same time:

* a reader that lists an artifact then reads it gets it whole and
  byte-identical to what was sent, or NOT_FOUND when a delete of it has
  started (a deletion between List and GetArtifact is legal; partial content
  never is);
* puts of one artifact from many clients store one copy, acknowledged as new
  exactly once;
* artifacts sharing pages keep one copy of each page, with reference counts
  such that deleting any of them frees exactly the pages nobody else names,
  and deleting all of them (even concurrently) returns Stats to zero;
* a Pin racing a Delete ends as one of the two orders, never an internal error;
* a put whose shared pages are freed by a concurrent Delete after the client
  asked MissingPages still succeeds (the client asks again and resends).

Real daemon process, real LMDB, several client threads with a connection each.
"""

from __future__ import annotations

import random
import threading
from collections import Counter

from kvgraft import Client
from kvgraft.artifact import Artifact, page_sizes
from kvgraft.errors import FailedPrecondition, KvgraftError, NotFound
from tests.support.factory import random_artifact
from tests.support.store_audit import (
    assert_served_whole,
    audit_store,
    delete_checked,
    derived_artifact,
    distinct_page_sizes,
    multi_mib_artifact,
)

WRITERS = 2
READERS = 2
WRITES_PER_WRITER = 24


class SharedLedger:
    """What writers sent and which deletes they started, for readers to judge."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: dict[str, Artifact] = {}
        self.deleting: set[str] = set()
        self.kept: dict[str, Artifact] = {}  # stored and never deleted
        self.problems: list[str] = []
        self.reads: Counter = Counter()

    def problem(self, text: str) -> None:
        with self.lock:
            self.problems.append(text)


def _writer(address: str, rng: random.Random, base: list[Artifact], ledger: SharedLedger) -> None:
    own: list[Artifact] = []
    with Client(address, timeout_s=60, transfer_timeout_s=300) as client:
        for _ in range(WRITES_PER_WRITER):
            roll = rng.random()
            if roll < 0.45:
                artifact = random_artifact(rng)
            elif roll < 0.7:
                artifact = multi_mib_artifact(rng)
            else:
                artifact = derived_artifact(rng, rng.choice(base + own), rng.uniform(0.3, 1.0))
            with ledger.lock:
                ledger.sent[artifact.id] = artifact
            response = client.put_artifact(artifact)
            if response.artifact_id != artifact.id or response.already_present:
                ledger.problem(f"put {artifact.id}: {response}")
            own.append(artifact)
            if own and rng.random() < 0.4:
                victim = own.pop(rng.randrange(len(own)))
                if rng.random() < 0.3:  # a pinned artifact refuses deletion
                    client.pin(victim.id)
                    try:
                        client.delete(victim.id)
                        ledger.problem(f"pinned {victim.id} was deleted")
                    except FailedPrecondition:
                        pass
                    client.pin(victim.id, pinned=False)
                with ledger.lock:
                    ledger.deleting.add(victim.id)
                client.delete(victim.id)
    with ledger.lock:
        ledger.kept.update({a.id: a for a in own})


def _read_one(client: Client, aid: str, ledger: SharedLedger, rng: random.Random) -> None:
    with ledger.lock:
        sent = ledger.sent.get(aid)
    if sent is None:
        ledger.problem(f"listed {aid}, which no writer sent")
        return
    try:
        if rng.random() < 0.3:
            stat = client.stat(aid[:12], include_manifest=True)
            if stat.info.artifact_id != aid or stat.manifest != sent.manifest:
                ledger.problem(f"stat {aid} disagrees with what was sent")
        assert_served_whole(client.get_artifact(aid if rng.random() < 0.7 else aid[:16]), sent)
        outcome = "whole"
    except NotFound as exc:
        with ledger.lock:
            deleting = aid in ledger.deleting
        if not deleting:
            ledger.problem(f"{aid} was listed, never deleted, and then not found: {exc}")
        outcome = "not_found_after_delete"
    except (AssertionError, KvgraftError) as exc:
        ledger.problem(f"read {aid}: {exc!r}")
        outcome = "bad"
    with ledger.lock:
        ledger.reads[outcome] += 1


def _reader(
    address: str, rng: random.Random, ledger: SharedLedger, writers_done: threading.Event
) -> None:
    with Client(address, timeout_s=60, transfer_timeout_s=300) as client:
        last_pass = False
        while not last_pass:
            last_pass = writers_done.is_set()  # one whole pass after the writers stop
            listed = [info.artifact_id for info in client.list_artifacts()]
            stats = client.stats()  # one read transaction: a consistent snapshot
            with ledger.lock:
                sent = len(ledger.sent)
            if stats.artifacts > sent or stats.staged_pages > stats.pages:
                ledger.problem(f"stats count what nobody sent: {stats}")
            sample = listed if last_pass else rng.sample(listed, min(3, len(listed)))
            for aid in sample:
                _read_one(client, aid, ledger, rng)


def _run_threads(targets: list[tuple]) -> list[BaseException]:
    errors: list[BaseException] = []

    def guarded(fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(fn, *args)) for fn, *args in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_readers_during_writes_see_whole_artifacts(start_daemon, rng) -> None:
    # A 1 MiB map grows under the readers; a 1 MiB spill stages pages mid-put.
    daemon = start_daemon(extra_args=["--map-initial-bytes", "1MiB", "--spill-bytes", "1MiB"])
    ledger = SharedLedger()
    base = [multi_mib_artifact(rng), random_artifact(rng)]
    with Client(daemon.address) as client:
        for artifact in base:
            client.put_artifact(artifact)
    ledger.sent.update({a.id: a for a in base})
    ledger.kept.update({a.id: a for a in base})

    writers_done = threading.Event()
    writer_threads = [
        (_writer, daemon.address, random.Random(rng.random()), base, ledger) for _ in range(WRITERS)
    ]
    reader_threads = [
        (_reader, daemon.address, random.Random(rng.random()), ledger, writers_done)
        for _ in range(READERS)
    ]
    errors: list[BaseException] = []
    readers = threading.Thread(target=lambda: errors.extend(_run_threads(reader_threads)))
    readers.start()
    errors += _run_threads(writer_threads)
    writers_done.set()
    readers.join()

    assert not errors, errors
    assert not ledger.problems, ledger.problems
    assert ledger.reads["whole"] >= len(ledger.kept)  # the last pass read every survivor
    assert ledger.reads["bad"] == 0
    with Client(daemon.address) as client:
        audit_store(client, ledger.kept)
        remaining = dict(ledger.kept)
        for aid in sorted(ledger.kept):
            delete_checked(client, remaining.pop(aid), remaining.values())
        stats = client.stats()
    assert (stats.artifacts, stats.pages, stats.page_bytes, stats.staged_pages) == (0, 0, 0, 0)


def _put_all_at_once(address: str, artifacts: list[Artifact]) -> list:
    """Put each artifact from its own client, all released together."""
    barrier = threading.Barrier(len(artifacts))
    responses: list = [None] * len(artifacts)

    def put(index: int) -> None:
        with Client(address, timeout_s=60, transfer_timeout_s=300) as client:
            barrier.wait()
            responses[index] = client.put_artifact(artifacts[index])

    errors = _run_threads([(put, i) for i in range(len(artifacts))])
    assert not errors, errors
    return responses


def test_concurrent_puts_of_one_artifact_store_one_copy(client: Client, daemon, rng) -> None:
    artifact = multi_mib_artifact(rng)
    sizes = page_sizes(artifact.manifest)
    responses = _put_all_at_once(daemon.address, [artifact] * 6)

    assert {r.artifact_id for r in responses} == {artifact.id}
    assert sum(not r.already_present for r in responses) == 1
    assert sum(r.pages_written for r in responses) == len(sizes)
    assert sum(r.bytes_written for r in responses) == sum(sizes.values())
    audit_store(client, {artifact.id: artifact})
    response = client.delete(artifact.id)
    assert (response.pages_freed, response.bytes_freed) == (len(sizes), sum(sizes.values()))
    stats = client.stats()
    assert (stats.artifacts, stats.pages, stats.page_bytes) == (0, 0, 0)


def test_concurrent_puts_sharing_pages_count_references(client: Client, daemon, rng) -> None:
    parent = multi_mib_artifact(rng)
    family = [parent, *(derived_artifact(rng, parent, share=0.6) for _ in range(5))]
    union = distinct_page_sizes(family)
    assert len(union) < sum(len(page_sizes(a.manifest)) for a in family)  # pages are shared

    responses = _put_all_at_once(daemon.address, family)
    assert [r.artifact_id for r in responses] == [a.id for a in family]
    assert not any(r.already_present for r in responses)
    assert sum(r.pages_written for r in responses) == len(union)
    assert sum(r.bytes_written for r in responses) == sum(union.values())
    stored = {a.id: a for a in family}
    audit_store(client, stored)

    # Delete one: exactly its unshared pages go, the others stay whole.
    victim = stored.pop(family[1].id)
    delete_checked(client, victim, stored.values())
    audit_store(client, stored)

    # Delete the rest at once: the references still add up to zero.
    barrier = threading.Barrier(len(stored))
    freed: list[tuple[int, int]] = []

    def delete(aid: str) -> None:
        with Client(daemon.address) as own:
            barrier.wait()
            response = own.delete(aid)
            freed.append((response.pages_freed, response.bytes_freed))

    errors = _run_threads([(delete, aid) for aid in stored])
    assert not errors, errors
    left = distinct_page_sizes(stored.values())
    assert sum(p for p, _ in freed) == len(left)
    assert sum(b for _, b in freed) == sum(left.values())
    stats = client.stats()
    assert (stats.artifacts, stats.pages, stats.page_bytes, stats.staged_pages) == (0, 0, 0, 0)
    assert sorted(client.missing_pages(union)) == sorted(union)


def _race_pin_and_delete(address: str, aid: str) -> tuple[str, str]:
    """Pin and Delete one artifact from two clients at once; (pin, delete) outcomes."""
    barrier = threading.Barrier(2)
    result: dict[str, str] = {}

    def pin() -> None:
        with Client(address) as own:
            barrier.wait()
            try:
                own.pin(aid)
                result["pin"] = "ok"
            except NotFound:
                result["pin"] = "not_found"

    def delete() -> None:
        with Client(address) as own:
            barrier.wait()
            try:
                own.delete(aid)
                result["delete"] = "ok"
            except FailedPrecondition:
                result["delete"] = "pinned"

    errors = _run_threads([(pin,), (delete,)])
    assert not errors, errors
    return result["pin"], result["delete"]


def test_pin_racing_delete_ends_in_one_order(client: Client, daemon, rng) -> None:
    """Regression: a Pin whose artifact was deleted after it resolved the id was INTERNAL."""
    outcomes: Counter = Counter()
    for _ in range(60):
        artifact = random_artifact(rng, tokens=4)
        client.put_artifact(artifact)
        pin, delete = _race_pin_and_delete(daemon.address, artifact.id)
        outcomes[(pin, delete)] += 1
        listed = {info.artifact_id: info for info in client.list_artifacts()}
        if delete == "pinned":
            assert pin == "ok"
            assert listed[artifact.id].pinned
            client.pin(artifact.id, pinned=False)
            client.delete(artifact.id)
        else:
            assert pin == "not_found"
            assert artifact.id not in listed
    assert set(outcomes) <= {("ok", "pinned"), ("not_found", "ok")}, outcomes
    assert client.stats().artifacts == 0


def test_put_survives_concurrent_delete_of_its_shared_pages(client: Client, daemon, rng) -> None:
    """Regression: MissingPages said "held", a Delete freed them, the put failed.

    B shares pages with A only. While B's put is streaming its own pages
    (after it asked MissingPages), A is deleted, freeing the shared pages B
    did not send. The client must notice and resend them, not fail.
    """
    parent = random_artifact(rng, num_layers=2, tokens=40, page_tokens=16)
    child = derived_artifact(rng, parent, share=0.0)
    # Keep page 0 of both layers from the parent (same sizes), new bytes elsewhere.
    pages = [parent.page(0, 0), parent.page(0, 1)] + [
        child.pages[digest] for digest in child.manifest.page_sha256[2:]
    ]
    child = Artifact.build(
        model_fingerprint=child.manifest.model_fingerprint,
        layout=child.manifest.layout,
        profile=child.manifest.profile,
        token_ids=child.manifest.token_ids,
        page_bytes=pages,
        segment_ends=child.manifest.segment_ends,
    )
    shared = set(page_sizes(parent.manifest)) & set(page_sizes(child.manifest))
    assert len(shared) == 2 and len(page_sizes(child.manifest)) == 6
    client.put_artifact(parent)

    deleted: list[int] = []

    def delete_parent(sent_bytes: int) -> None:
        if not deleted:
            with Client(daemon.address) as other:
                deleted.append(other.delete(parent.id).pages_freed)

    response = client.put_artifact(child, progress=delete_parent)
    assert response.artifact_id == child.id
    assert deleted == [len(page_sizes(parent.manifest))]  # the shared pages were freed
    audit_store(client, {child.id: child})
