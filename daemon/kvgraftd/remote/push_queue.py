"""Artifacts not yet in the bucket: the write-back queue, and uploads under way.

The store must never evict an artifact the bucket does not hold yet: from the
moment its commit is acknowledged to the end of its upload. Both classes here
answer `holds(aid)` for the store's evictor (kvgraftd.store.eviction's `keep`)
and offer `committing(artifact_id, stored)`, which a commit runs inside
(kvgraftd.remote.backed_store): the hold starts *before* the commit, so no
eviction pass, however it races the commit, sees the artifact unheld.

`WriteBackQueue` (write = "back"). Durable and dull on purpose: one empty
file per artifact id in DATA/remote-queue/, created (and the directory
fsynced) before the commit, removed once the artifact's manifest is in the
bucket; an in-memory mirror of the directory answers `holds`. An entry that
cannot be written stores nothing: ResourceExhausted on a full disk,
FailedPrecondition in words otherwise (the data directory deleted, read-only,
failing). A commit that fails takes its entry out again, unless the store
holds the artifact anyway (committed earlier) or another commit of it is
under way. A daemon killed at
any point finds its backlog on restart (an entry whose commit never happened
is dropped by the drain: the artifact is not in the store); an artifact
pushed twice is harmless (every remote write is idempotent). The store
module stays the only one that touches LMDB.

One background thread drains the queue oldest first, passing over artifacts
whose commit is under way. A failed push is retried after a backoff that
doubles from RETRY_MIN_S up to RETRY_MAX_S (an add, a sync or a stop wakes it
sooner); local serving never waits for it. An artifact deleted locally before
its upload leaves the queue unuploaded. Each entry has a generation: the
drain takes out only the entry it pushed, never one a new commit of the same
artifact made meanwhile. `kvgraft remote sync` drains the queue in the
caller's thread, now.

`PushesUnderWay` (write = "through"): in memory, the artifacts between their
commit and the end of their upload in the same call.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kvgraft.errors import KvgraftError, NotFound, ResourceExhausted
from kvgraftd.store.lmdb_env import unreachable_store

log = logging.getLogger(__name__)

RETRY_MIN_S = 0.5
RETRY_MAX_S = 30.0


class WriteBackQueue:
    def __init__(self, directory: Path, push: Callable[[str], object]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._push = push  # push(artifact_id): upload it (raises when it cannot)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._drain_lock = threading.Lock()  # one drainer at a time (thread or sync)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the mirror and the commits under way
        self._generations = itertools.count(1)
        self._held = {aid: next(self._generations) for aid in self.pending()}  # id -> generation
        self._committing: Counter[str] = Counter()
        self.last_error = ""

    # ------------------------------------------------------------------
    @contextmanager
    def committing(self, artifact_id: str, stored: Callable[[], bool]) -> Iterator[None]:
        """Around the local commit of `artifact_id`: queued (durably) before it, so held
        from the moment the store holds it; a commit that raises takes the entry out
        again unless `stored()` (the store holds the artifact) or another commit of it
        is under way."""
        with self._lock:
            self._committing[artifact_id] += 1
            self._held[artifact_id] = next(self._generations)
        failed = True
        try:
            self._write_entry(artifact_id)
            yield
            failed = False
        finally:
            with self._lock:
                self._committing[artifact_id] -= 1
                if not self._committing[artifact_id]:
                    del self._committing[artifact_id]
                    if failed and not stored():
                        self._take_out(artifact_id)
            self._wake.set()

    def holds(self, aid: bytes) -> bool:
        """Whether the artifact waits for its upload (the store must not evict it)."""
        return aid.hex() in self._held

    def pending(self) -> list[str]:
        """Queued ids, oldest first."""
        entries = []
        for path in self.directory.iterdir():
            if len(path.name) == 64 and not path.name.strip("0123456789abcdef"):
                try:
                    entries.append((path.stat().st_mtime_ns, path.name))
                except FileNotFoundError:
                    continue  # drained meanwhile
        return [name for _, name in sorted(entries)]

    def backlog(self) -> int:
        return len(self._held)

    def generation(self, artifact_id: str) -> int:
        """The entry's generation (0: not queued), for `discard`."""
        return self._held.get(artifact_id, 0)

    def discard(self, artifact_id: str, generation: int) -> None:
        """Take out the entry of that generation (the artifact is in the bucket, or gone
        from the store); a newer entry, or one whose commit is under way, stays."""
        with self._lock:
            if self._held.get(artifact_id) == generation and not self._committing[artifact_id]:
                self._take_out(artifact_id)

    def _take_out(self, artifact_id: str) -> None:
        """(Under the lock.) Out of the mirror, then off the disk."""
        self._held.pop(artifact_id, None)
        (self.directory / artifact_id).unlink(missing_ok=True)

    def _write_entry(self, artifact_id: str) -> None:
        path = self.directory / artifact_id
        if path.exists():
            return
        try:
            with open(path, "wb") as f:
                os.fsync(f.fileno())
            _fsync_dir(self.directory)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):  # deleted, read-only, failing
                raise unreachable_store(exc) from None
            raise ResourceExhausted(
                f"the disk holding {self.directory} is full: the artifact cannot be queued for "
                "its upload, so it was not stored. Free disk space or delete artifacts "
                "(kvgraft rm ID)."
            ) from None

    # ------------------------------------------------------------------
    def drain(self) -> tuple[int, list[str]]:
        """Push every queued artifact now: (artifacts pushed, failures as lines)."""
        pushed, failures = 0, []
        with self._drain_lock:
            for artifact_id in self.pending():
                if self._stop.is_set():
                    break
                if self._committing[artifact_id]:
                    continue  # its commit wakes the drain when it ends
                generation = self.generation(artifact_id)
                try:
                    self._push(artifact_id)
                except NotFound:
                    log.info("artifact %s was deleted before its upload", artifact_id)
                except KvgraftError as exc:
                    self.last_error = f"{artifact_id}: {exc}"
                    failures.append(self.last_error)
                    break  # keep the order: retry this one first
                else:
                    pushed += 1
                self.discard(artifact_id, generation)
        if not failures:
            self.last_error = ""
        return pushed, failures

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="remote-write-back", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the drain thread (queued ids stay on disk for the next start)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        delay_s = RETRY_MIN_S
        while not self._stop.is_set():
            self._wake.clear()
            try:
                _, failures = self.drain()
            except Exception:  # never let the thread die: the backlog would only grow
                log.exception("the write-back drain failed")
                failures = ["unexpected error"]
            if failures:
                self._wake.wait(delay_s)
                delay_s = min(RETRY_MAX_S, 2 * delay_s)
            else:
                delay_s = RETRY_MIN_S
                self._wake.wait(RETRY_MAX_S)


class PushesUnderWay:
    """Write-through: the artifacts whose commit-and-upload is under way (in memory)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: Counter[str] = Counter()

    @contextmanager
    def committing(self, artifact_id: str, stored: Callable[[], bool]) -> Iterator[None]:
        """Around a write-through commit and its upload: held all along."""
        with self._lock:
            self._ids[artifact_id] += 1
        try:
            yield
        finally:
            with self._lock:
                self._ids[artifact_id] -= 1
                if not self._ids[artifact_id]:
                    del self._ids[artifact_id]

    def holds(self, aid: bytes) -> bool:
        return aid.hex() in self._ids


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
