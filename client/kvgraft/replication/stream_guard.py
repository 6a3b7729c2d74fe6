"""A watch over the open streams of a long-running client task (replication).

A connection can go silent without closing (a peer host gone, a flow-control
frame damaged on the way): a stream then waits forever, since a follow Watch
has no deadline and a transfer's is long. The guard tracks the open streams
and cancels them all when the task is stopped, or when it stalls: its
progress marker did not change over a whole probe interval while it was
`behind` (the caller's probe: work exists, or the peer does not answer). A
cancelled stream raises kvgraft.errors.Cancelled where it is read, and the
task's own retry logic takes over.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

from kvgraft.stream import Stream

log = logging.getLogger(__name__)


class StreamGuard:
    def __init__(
        self,
        behind: Callable[[], bool],
        progress: Callable[[], Hashable],
        interval_s: float,
        what: str,
    ) -> None:
        self._behind = behind  # True when work is waiting (or the peer does not answer)
        self._progress = progress  # a marker that changes whenever the task progresses
        self._interval_s = interval_s
        self._what = what
        self._lock = threading.Lock()
        self._streams: set[Stream] = set()
        self._stop: threading.Event | None = None  # the task's, from watch()

    @contextmanager
    def opened(self, stream: Stream | None) -> Iterator[Stream | None]:
        """Track `stream` (None passes through) until the block ends, then cancel it."""
        if stream is None:
            yield None
            return
        with self._lock:
            self._streams.add(stream)
        # A stream opened as the task is stopped may miss the guard's cancel_all
        # (regression: `replicate --follow` then ignored Ctrl-C); stop is set before
        # cancel_all takes its list, so checking it after adding the stream closes the gap.
        if self._stop is not None and self._stop.is_set():
            stream.cancel()
        try:
            yield stream
        finally:
            stream.cancel()  # a no-op once it has ended
            with self._lock:
                self._streams.discard(stream)

    def cancel_all(self) -> None:
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.cancel()

    def watch(self, stop: threading.Event) -> None:
        """Start a thread that cancels stalled streams, and all of them once `stop` is set."""
        self._stop = stop
        threading.Thread(target=self._run, args=(stop,), name="stream-guard", daemon=True).start()

    def _run(self, stop: threading.Event) -> None:
        previous = None
        while not stop.wait(self._interval_s):
            marker = self._progress()
            if self._behind() and marker == previous:
                log.warning(
                    "%s made no progress for %.0f s; cancelling its streams to reconnect",
                    self._what,
                    self._interval_s,
                )
                self.cancel_all()
            previous = marker
        self.cancel_all()
