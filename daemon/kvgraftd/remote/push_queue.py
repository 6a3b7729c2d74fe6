"""The write-back queue: artifacts committed locally, waiting to be uploaded.

Durable and dull on purpose: one empty file per artifact id in
DATA/remote-queue/, created (and the directory fsynced) before the commit
returns to its caller, removed once the artifact's manifest is in the
bucket. A daemon killed at any point finds its backlog on restart; an
artifact pushed twice is harmless (every remote write is idempotent). The
store module stays the only one that touches LMDB.

One background thread drains the queue oldest first. A failed push is
retried after a backoff that doubles from RETRY_MIN_S up to RETRY_MAX_S (an
add, a sync or a stop wakes it sooner); local serving never waits for it. An
artifact deleted locally before its upload leaves the queue unuploaded.
`kvgraft remote sync` drains the queue in the caller's thread, now.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from kvgraft.errors import KvgraftError, NotFound

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
        self.last_error = ""

    # ------------------------------------------------------------------
    def add(self, artifact_id: str) -> None:
        path = self.directory / artifact_id
        if not path.exists():
            with open(path, "wb") as f:
                os.fsync(f.fileno())
            _fsync_dir(self.directory)
        self._wake.set()

    def discard(self, artifact_id: str) -> None:
        (self.directory / artifact_id).unlink(missing_ok=True)

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

    def holds(self, artifact_id: str) -> bool:
        """Whether the artifact waits for its upload (the store must not evict it)."""
        return (self.directory / artifact_id).exists()

    def backlog(self) -> int:
        return len(self.pending())

    # ------------------------------------------------------------------
    def drain(self) -> tuple[int, list[str]]:
        """Push every queued artifact now: (artifacts pushed, failures as lines)."""
        pushed, failures = 0, []
        with self._drain_lock:
            for artifact_id in self.pending():
                if self._stop.is_set():
                    break
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
                self.discard(artifact_id)
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


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
