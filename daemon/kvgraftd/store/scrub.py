"""Scrub: the SHA-256 of every stored page recomputed, corrupt ones quarantined.

Every read checks a page's xxh3-128, but a page nobody reads is never checked,
and a replica or the remote tier can repair only what is known to be damaged.
A scrub walks the `page_locations` index in key order, BATCH pages per read
transaction (kvgraftd.store.quarantine.Quarantine.hash_batch), at most
`bytes_per_s` (it sleeps to keep the pace), and quarantines the artifacts
holding each page whose bytes do not hash to its name, as it finds them.

`Scrubber.run` scrubs once (one at a time: a second caller gets
FailedPrecondition); `progress()` is the running or the last scrub's figures
(`kvgraft info`, /metrics). `Scrubber.start_periodic(interval_s)` runs one every
`interval_s` on a thread, counting from the last one's end (kept in the
store's `meta` as `last_scrub_ms`, so a restart does not start one early).
"""

from __future__ import annotations

import logging
import threading
import time

from kvgraft.errors import FailedPrecondition
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store.catalog import now_ms

log = logging.getLogger(__name__)

BATCH = 64  # pages hashed per read transaction
MAX_LISTED = 1000  # corrupt pages and quarantined artifacts named in a progress message


class Scrubber:
    def __init__(self, store, bytes_per_s: int) -> None:
        self.store = store
        self.bytes_per_s = bytes_per_s
        self._running = threading.Lock()
        self._lock = threading.Lock()
        self._progress = pb.ScrubProgress()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def progress(self) -> pb.ScrubProgress:
        with self._lock:
            copy = pb.ScrubProgress()
            copy.CopyFrom(self._progress)
            return copy

    def run(self, bytes_per_s: int = 0) -> pb.ScrubProgress:
        """Scrub the whole store (`progress()` follows it); returns the findings."""
        if not self._running.acquire(blocking=False):
            raise FailedPrecondition("a scrub is running already: wait for it (kvgraft info)")
        try:
            return self._scrub(bytes_per_s or self.bytes_per_s)
        finally:
            self._running.release()

    def _scrub(self, rate: int) -> pb.ScrubProgress:
        stats = self.store.stats()
        progress = pb.ScrubProgress(
            pages_total=stats.pages,
            bytes_total=stats.page_bytes,
            started_unix_ms=now_ms(),
            running=True,
        )
        self._publish(progress)
        began = time.monotonic()
        after = b""
        quarantined: set[str] = set()
        while not self._stop.is_set():
            after, pages, size, corrupt = self.store.hash_batch(after, BATCH)
            if not pages:
                break
            progress.pages_done += pages
            progress.bytes_done += size
            if corrupt:
                held = self.store.quarantine(corrupt)
                progress.corrupt_count += len(corrupt)
                room = MAX_LISTED - len(progress.corrupt_pages)
                progress.corrupt_pages.extend(digest.hex() for digest in corrupt[:room])
                for aid in held:
                    if aid not in quarantined:
                        quarantined.add(aid)
                        if len(progress.quarantined) < MAX_LISTED:
                            progress.quarantined.append(aid)
                progress.quarantined_count = len(quarantined)
            self._publish(progress)
            ahead = progress.bytes_done / rate - (time.monotonic() - began)
            if ahead > 0:
                self._stop.wait(ahead)
        progress.running = False
        progress.done = not self._stop.is_set()
        progress.finished_unix_ms = now_ms()
        self._publish(progress)
        if progress.done:
            self.store.set_meta_time(b"last_scrub_ms", progress.finished_unix_ms)
        log.info(
            "scrub %s: %d pages, %.1f MB, %d corrupt, %d artifacts quarantined",
            "done" if progress.done else "stopped",
            progress.pages_done,
            progress.bytes_done / 1e6,
            progress.corrupt_count,
            progress.quarantined_count,
        )
        return self.progress()

    def _publish(self, progress: pb.ScrubProgress) -> None:
        with self._lock:
            self._progress.CopyFrom(progress)

    # ------------------------------------------------------------------
    # periodic

    def start_periodic(self, interval_s: float) -> Scrubber:
        if interval_s > 0:
            self._thread = threading.Thread(
                target=self._periodic, args=(interval_s,), name="scrub", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """End the periodic scrubs and any scrub running (after its current batch)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._running:  # a Scrub call's scrub, on a thread of its own
            pass

    def _periodic(self, interval_s: float) -> None:
        while not self._stop.is_set():
            last = self.store.meta_time(b"last_scrub_ms")
            if not last:  # the clock starts now
                last = now_ms()
                self.store.set_meta_time(b"last_scrub_ms", last)
            wait_s = max(0.0, (last + interval_s * 1000 - now_ms()) / 1000)
            if self._stop.wait(wait_s):
                return
            try:
                self.run()
            except FailedPrecondition:
                pass  # one asked for by a caller is running: it counts
            except Exception:
                log.exception("the periodic scrub failed; next try in %.0f s", interval_s)
                self._stop.wait(interval_s)
