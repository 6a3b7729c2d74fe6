"""Crash: kill -9 the daemon mid-put, restart, and check nothing acknowledged is lost.

The contract under test (docs/architecture.md, store layout): an artifact's pages,
reference counts, manifest and change record commit in one LMDB write
transaction, and PutArtifact answers only after that commit. So after a
kill -9 at any moment, and a restart on the same data directory:

* every artifact whose put_artifact returned is listed and reads back
  byte-identical (every page equal, to the byte, to what was sent);
* every listed artifact is one some client attempted, and it is whole;
* an acknowledged delete stayed done; a delete in flight at the kill either
  happened or did not, never halfway;
* Stats, reference counts (checked by exact `pages_freed` on deletes) and the
  change feed agree with the listing.

Each round, several client threads put random artifacts: small ones,
multi-MiB ones, ones whose pages are larger than one gRPC message, ones that
share pages with stored artifacts, and re-puts of stored ones; in some rounds
another thread deletes stored artifacts. The daemon is killed after a random
delay. It runs with a 1 MiB initial LMDB map, so kills land during map
growth, and in some rounds with a 1 MiB spill threshold, so kills land while
pages are staged mid-stream. It restarts with --staged-ttl-s 0, which
collects staged pages at start, so the audit checks page counters exactly.

A few rounds run by default; the slow test runs 200 and prints its figures
as one JSON line.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest

from kvgraft import Client
from kvgraft.artifact import Artifact
from kvgraft.errors import KvgraftError, Unavailable
from kvgraftd.testing.daemon_process import DaemonProcess
from tests.support.factory import random_artifact
from tests.support.store_audit import (
    assert_served_whole,
    audit_store,
    big_page_artifact,
    delete_checked,
    derived_artifact,
    multi_mib_artifact,
)

PUT_THREADS = 3
MAX_DELETES_PER_ROUND = 3
KEEP_ARTIFACTS = 24  # pruned back to this many after each round's audit
KEEP_BYTES = 48 << 20
BASE_ARGS = ["--map-initial-bytes", "1MiB", "--staged-ttl-s", "0"]


@dataclass
class Ledger:
    """What the store must hold between rounds, and the figures so far."""

    alive: dict[str, Artifact] = field(default_factory=dict)  # audited as stored
    base: set[str] = field(default_factory=set)  # never deleted during rounds
    figures: Counter = field(default_factory=Counter)


@dataclass
class RoundOutcome:
    """What the clients of one round did, as they saw it."""

    attempted: dict[str, Artifact] = field(default_factory=dict)
    acked: dict[str, Artifact] = field(default_factory=dict)
    deleted: set[str] = field(default_factory=set)  # acknowledged deletes
    delete_in_flight: set[str] = field(default_factory=set)  # sent, unanswered
    failures: list[tuple[float, str, BaseException]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # contract breaches seen by a client
    lock: threading.Lock = field(default_factory=threading.Lock)


def _next_artifact(rng: random.Random, pool: list[Artifact], own: list[Artifact]) -> Artifact:
    """A mix of sizes, shared pages and re-puts."""
    roll = rng.random()
    if roll < 0.40:
        return random_artifact(rng)
    if roll < 0.60:
        return multi_mib_artifact(rng)
    if roll < 0.67:
        return big_page_artifact(rng)
    if roll < 0.92:
        return derived_artifact(rng, rng.choice(pool + own), share=rng.uniform(0.2, 1.0))
    return rng.choice(pool + own)  # a re-put: already present


def _put_loop(
    address: str,
    rng: random.Random,
    pool: list[Artifact],
    outcome: RoundOutcome,
    stop: threading.Event,
) -> None:
    own: list[Artifact] = []
    with Client(address, timeout_s=30, transfer_timeout_s=120) as client:
        while not stop.is_set():
            artifact = _next_artifact(rng, pool, own)
            with outcome.lock:
                outcome.attempted[artifact.id] = artifact
            try:
                response = client.put_artifact(artifact)
            except KvgraftError as exc:
                outcome.failures.append((time.monotonic(), f"put {artifact.id}", exc))
                return
            if response.artifact_id != artifact.id:
                outcome.problems.append(f"put {artifact.id} answered {response.artifact_id}")
            with outcome.lock:
                outcome.acked[artifact.id] = artifact
            own.append(artifact)


def _delete_loop(
    address: str,
    rng: random.Random,
    victims: list[Artifact],
    outcome: RoundOutcome,
    stop: threading.Event,
) -> None:
    with Client(address, timeout_s=30) as client:
        for victim in victims:
            if stop.wait(rng.uniform(0.0, 0.3)):
                return
            with outcome.lock:
                outcome.delete_in_flight.add(victim.id)
            try:
                client.delete(victim.id)
            except KvgraftError as exc:
                outcome.failures.append((time.monotonic(), f"delete {victim.id}", exc))
                return
            with outcome.lock:
                outcome.delete_in_flight.discard(victim.id)
                outcome.deleted.add(victim.id)


def _guarded(target, outcome: RoundOutcome):
    def run(*args) -> None:
        try:
            target(*args)
        except BaseException as exc:  # a thread's failure must reach the test
            outcome.problems.append(f"{target.__name__} crashed: {exc!r}")

    return run


def _kill_delay_s(rng: random.Random) -> float:
    """Mostly mid-traffic; sometimes right at the start of the round."""
    return rng.uniform(0.0, 0.05) if rng.random() < 0.15 else rng.uniform(0.05, 1.2)


def _restart_args(rng: random.Random) -> list[str]:
    spill = ["--spill-bytes", "1MiB"] if rng.random() < 0.4 else []
    return [*BASE_ARGS, *spill]


def crash_round(daemon: DaemonProcess, rng: random.Random, ledger: Ledger) -> None:
    """Traffic, kill -9 at a random moment, restart, audit, prune."""
    figures = ledger.figures
    candidates = sorted(set(ledger.alive) - ledger.base)
    victims = []
    if candidates and rng.random() < 0.5:
        picked = rng.sample(candidates, min(len(candidates), rng.randint(1, MAX_DELETES_PER_ROUND)))
        victims = [ledger.alive[aid] for aid in picked]
    victim_ids = {v.id for v in victims}
    # Puts derive from and re-put only artifacts nobody deletes this round, so
    # that "an acknowledged delete stays done" has one meaning (a re-put acked
    # after the delete would legitimately bring the artifact back).
    pool = [a for aid, a in sorted(ledger.alive.items()) if aid not in victim_ids]

    outcome = RoundOutcome()
    stop = threading.Event()
    threads = [
        threading.Thread(
            target=_guarded(_put_loop, outcome),
            args=(daemon.address, random.Random(rng.random()), pool, outcome, stop),
        )
        for _ in range(PUT_THREADS)
    ]
    if victims:
        threads.append(
            threading.Thread(
                target=_guarded(_delete_loop, outcome),
                args=(daemon.address, random.Random(rng.random()), victims, outcome, stop),
            )
        )
    for thread in threads:
        thread.start()
    time.sleep(_kill_delay_s(rng))
    killed_at = time.monotonic()
    daemon.kill()
    stop.set()
    for thread in threads:
        thread.join()
    crashed_log = daemon.log()
    killed_with_spill = "--spill-bytes" in daemon.extra_args

    assert not outcome.problems, outcome.problems
    assert "Traceback" not in crashed_log and "internal error" not in crashed_log, crashed_log
    for seen_at, what, exc in outcome.failures:
        # Before the kill, nothing may fail; after it, only the connection may.
        assert seen_at >= killed_at, f"{what} failed before the kill: {exc!r}"
        assert isinstance(exc, Unavailable), f"{what} failed with {exc!r}"

    daemon.extra_args = _restart_args(rng)
    daemon.launch()
    with Client(daemon.address, timeout_s=60, transfer_timeout_s=300) as client:
        listed = {info.artifact_id for info in client.list_artifacts()}
        lost = set(outcome.acked) - listed
        unknown = listed - set(ledger.alive) - set(outcome.attempted)
        undeleted = listed & outcome.deleted
        vanished = set(ledger.alive) - listed - outcome.deleted - outcome.delete_in_flight
        corrupt = []
        expected: dict[str, Artifact] = {}
        for aid in sorted(listed - unknown):
            sent = ledger.alive.get(aid) or outcome.attempted[aid]
            expected[aid] = sent
            try:
                assert_served_whole(client.get_artifact(aid), sent)
            except (AssertionError, KvgraftError) as exc:
                corrupt.append(f"{aid}: {exc!r}")

        figures["rounds"] += 1
        figures["puts_attempted"] += len(outcome.attempted)
        figures["puts_acknowledged"] += len(outcome.acked)
        figures["committed_unacknowledged"] += len(
            (listed & set(outcome.attempted)) - set(outcome.acked) - set(ledger.alive)
        )
        figures["deletes_acknowledged"] += len(outcome.deleted)
        figures["deletes_in_flight_at_kill"] += len(outcome.delete_in_flight)
        figures["deletes_in_flight_applied"] += len(outcome.delete_in_flight - listed)
        figures["lost"] += len(lost)
        figures["corrupt"] += len(corrupt)
        figures["unknown_listed"] += len(unknown)
        figures["kills_with_spill"] += killed_with_spill
        assert not lost, f"acknowledged artifacts lost: {sorted(lost)}"
        assert not corrupt, f"artifacts served corrupt: {corrupt}"
        assert not unknown, f"artifacts nobody attempted are listed: {sorted(unknown)}"
        assert not undeleted, f"acknowledged deletes undone: {sorted(undeleted)}"
        assert not vanished, f"artifacts nobody deleted are gone: {sorted(vanished)}"

        audit_store(client, expected, read_pages=False)  # read back just above
        ledger.alive = expected
        _prune(client, rng, ledger)


def _prune(client: Client, rng: random.Random, ledger: Ledger) -> None:
    """Keep the store small; every delete must free exactly the unshared pages."""
    alive = ledger.alive
    while True:
        extra = sorted(set(alive) - ledger.base)
        size = sum(len(bytes(p)) for a in alive.values() for p in a.pages.values())
        if not extra or (len(alive) <= KEEP_ARTIFACTS and size <= KEEP_BYTES):
            return
        victim = alive.pop(rng.choice(extra))
        delete_checked(client, victim, alive.values())
        ledger.figures["pruned"] += 1


def run_crash_rounds(start_daemon, seed: int, rounds: int) -> Counter:
    rng = random.Random(seed)
    daemon = start_daemon(extra_args=_restart_args(rng))
    ledger = Ledger()
    with Client(daemon.address, timeout_s=60) as client:
        for artifact in (multi_mib_artifact(rng), random_artifact(rng)):
            client.put_artifact(artifact)
            ledger.alive[artifact.id] = artifact
            ledger.base.add(artifact.id)
    started = time.monotonic()
    for _ in range(rounds):
        crash_round(daemon, rng, ledger)
    with Client(daemon.address, timeout_s=60) as client:
        audit_store(client, ledger.alive)
        while ledger.alive:
            victim = ledger.alive.pop(sorted(ledger.alive)[0])
            delete_checked(client, victim, ledger.alive.values())
        stats = client.stats()
        assert (stats.artifacts, stats.pages, stats.page_bytes, stats.staged_pages) == (0, 0, 0, 0)
    ledger.figures["seconds"] = round(time.monotonic() - started)
    print(json.dumps({"seed": seed, **ledger.figures}))
    return ledger.figures


def test_crash_rounds(start_daemon) -> None:
    figures = run_crash_rounds(start_daemon, seed=20240601, rounds=3)
    assert figures["rounds"] == 3
    assert figures["puts_acknowledged"] > 0


@pytest.mark.slow
def test_crash_rounds_many(start_daemon) -> None:
    figures = run_crash_rounds(start_daemon, seed=20240602, rounds=200)
    assert figures["rounds"] == 200
    assert figures["lost"] == figures["corrupt"] == 0
