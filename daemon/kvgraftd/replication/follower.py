"""Follow mode: this daemon keeps its store in sync with peers (`[replication] follow`).

One thread per peer runs kvgraft.replication.replicator.Replicator.follow: the peer's
gRPC API is the source (its change feed, GetArtifact), and this daemon's own
store is the target, written through StoreService.put_parts, the very
intake PutArtifact uses (every page's SHA-256 checked, one commit per
artifact). The local side skips a loopback gRPC hop on purpose: on a small
machine replication is CPU-bound, and the hop would cost an encode, a copy
and a decode of every byte (and a token of its own when the daemon wants
one): the pages go from GetArtifact's messages, as decoded, into the intake.

Position: after each change it applies, a follower records the peer's
sequence in DATA/replication.json (rewritten atomically: temporary file,
fsync, rename). A restarted daemon resumes from there; whatever the last run
did after its last save is done again, harmlessly (replication is
idempotent). If a peer's feed ends before the saved position, its store was
replaced, and the follower starts over from the beginning of its feed.

Peers are reached like any kvgraft.Client: TLS and the bearer token come from
the daemon's KVGRAFT_TLS_* and KVGRAFT_TOKEN_FILE environment (kvgraft.client.channel).
A follower whose peer goes silent (kvgraft.replication.stream_guard) or keeps failing opens
a new connection after FAILURES_BEFORE_RECONNECT errors in a row.

Must not: write to the store except through the service's intake and
Store.delete_artifact; outlive the store (main stops followers first).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from kvgraft import Client, wire
from kvgraft.errors import FailedPrecondition, KvgraftError, NotFound
from kvgraft.replication.feed import expiries
from kvgraft.replication.replicator import Replicator
from kvgraft.replication.target import Holdings
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.service import StoreService

log = logging.getLogger(__name__)

POSITIONS_FILE = "replication.json"
RESTART_DELAY_S = 5.0  # after an unexpected error in a follower thread
FAILURES_BEFORE_RECONNECT = 3  # errors in a row before the peer's channel is opened anew
LISTING_BATCH = 1000  # artifacts (or change records) read per read transaction


class LocalTarget:
    """This daemon's store as a replication target (kvgraft.replication.target.Target)."""

    def __init__(self, service: StoreService, store: Store, source: str = "") -> None:
        self._service = service
        self._store = store
        self._source = source
        self._origin = f"replicated from {source}" if source else "replicated"

    def from_source(self, source: str) -> LocalTarget:
        """This target, replicating from `source`: what it stores is marked as coming from
        there, and a delete from there applies only to what came from there."""
        return LocalTarget(self._service, self._store, source)

    def holdings(self) -> Holdings:
        signers: dict[str, frozenset[bytes]] = {}
        after = b""
        while batch := self._store.list_records(after, LISTING_BATCH):
            signers.update(self._store.signer_keys(aid for aid, _ in batch))
            after = bytes.fromhex(batch[-1][0])
        return Holdings(set(signers), set(self._store.quarantined_ids()), signers)

    def expired(self) -> dict[str, int]:
        def feed() -> Iterator[pb.ChangeRecord]:
            sequence = 1
            while batch := self._store.changes_since(sequence, LISTING_BATCH):
                yield from batch
                sequence = batch[-1].sequence + 1

        return expiries(feed())

    def has_artifact(self, artifact_id: str) -> bool:
        try:
            self._store.get_record(artifact_id)
        except NotFound:
            return False
        return True

    def missing_pages(self, digests: list[bytes]) -> list[bytes]:
        return self._store.missing_pages(digests)

    def put_parts(self, parts: Iterator[wire.PutPart]) -> pb.PutArtifactResponse:
        return self._service.put_parts(parts, self._origin, self._source)

    def delete_artifact(self, artifact_id: str) -> str:
        try:
            if self._source not in self._store.provenance(artifact_id).replicated_from:
                self._store.get_record(artifact_id)  # NotFound first, when it is gone
                return "foreign"
            self._store.delete_artifact(artifact_id)
        except NotFound:
            return "absent"
        except FailedPrecondition:
            if self._store.get_record(artifact_id).pinned:
                return "pinned"
            raise
        return "deleted"


class PositionBook:
    """Each peer's last applied sequence, kept in one JSON file written atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._positions: dict[str, int] = {}
        if path.exists():
            try:
                document = json.loads(path.read_text())
                self._positions = {k: int(v["sequence"]) for k, v in document["peers"].items()}
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("%s is unreadable (%s); following every peer from the start", path, exc)

    def get(self, peer: str) -> int:
        with self._lock:
            return self._positions.get(peer, 0)

    def set(self, peer: str, sequence: int) -> None:
        with self._lock:
            if self._positions.get(peer) == sequence:
                return
            self._positions[peer] = sequence
            document = {
                "format": 1,
                "peers": {
                    p: {"sequence": s, "saved_unix_ms": int(time.time() * 1000)}
                    for p, s in sorted(self._positions.items())
                },
            }
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            with open(tmp, "w") as out:
                json.dump(document, out, indent=2)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
            directory = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)


class Follower:
    """A thread that keeps this store in sync with one peer until stopped."""

    def __init__(
        self,
        peer: str,
        target: LocalTarget,
        positions: PositionBook,
        client_factory: Callable[[str], Client],
    ) -> None:
        self.peer = peer
        self._target = target
        self._positions = positions
        self._client_factory = client_factory
        self._stop = threading.Event()
        self._client: Client | None = None
        self._thread = threading.Thread(target=self._run, name=f"follow {peer}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end: closing its channel cancels the calls in flight."""
        self._stop.set()
        client = self._client
        if client is not None:
            client.close()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the follower of %s did not stop within %.0f s", self.peer, timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self._client_factory(self.peer) as client:
                    self._client = client
                    if self._stop.is_set():
                        return
                    self._follow(client)
            except KvgraftError as exc:
                # Errors in a row: perhaps a connection gone silent. A new client
                # opens a new one; the position is kept.
                if not self._stop.is_set():
                    log.warning("following %s: %s; reconnecting", self.peer, exc)
            except Exception:
                if self._stop.is_set():
                    return
                log.exception("the follower of %s failed; restarting it", self.peer)
                self._stop.wait(RESTART_DELAY_S)
            finally:
                self._client = None

    def _follow(self, client: Client) -> None:
        position = self._positions.get(self.peer)
        log.info("following %s from sequence %d", self.peer, position + 1)

        def saved(sequence: int) -> None:
            self._positions.set(self.peer, sequence)

        def changed(outcome: str, artifact_id: str) -> None:
            log.info("replica of %s: %s %s", self.peer, outcome, artifact_id)

        replicator = Replicator(client, self._target, on_change=changed)
        replicator.follow(
            position + 1, stop=self._stop, on_position=saved, max_failures=FAILURES_BEFORE_RECONNECT
        )


class Followers:
    """The followers of one daemon, started and stopped together."""

    def __init__(self, followers: list[Follower]) -> None:
        self._followers = followers

    def stop(self, timeout_s: float = 30.0) -> None:
        for follower in self._followers:
            follower.stop()
        for follower in self._followers:
            follower.join(timeout_s)


def start_followers(
    peers: Iterable[str],
    service: StoreService,
    store: Store,
    data_dir: Path,
    client_factory: Callable[[str], Client] = Client,
) -> Followers:
    """Start one follower per peer (none when `peers` is empty)."""
    positions = PositionBook(data_dir / POSITIONS_FILE)
    target = LocalTarget(service, store)
    followers = [
        Follower(peer, target.from_source(peer), positions, client_factory) for peer in peers
    ]
    for follower in followers:
        follower.start()
    return Followers(followers)
