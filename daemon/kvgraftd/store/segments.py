"""Segment files: where a store keeps its page bytes, written around the page cache.

A store's page bytes live in append-only files `segments/NNNNNNNN.seg`
beside the LMDB index, which holds each page's location (segment, offset,
length) and checksum (kvgraftd.store.page_records). This module keeps the files;
what a location means is the index's business.

Contract:
* `append(pages, prepare)` writes a batch durably (fdatasync) at the
  committed end of the active segment (a new one once it holds
  `segment_bytes`), every page at a 4 KiB-aligned offset (so that a freed
  page's blocks can be given back alone), calling `prepare(i)` right before
  page i is written (the caller's checksum, overlapped with the device). A
  batch whose buffers all start on a block goes to the device from where it
  lies (O_DIRECT, kvgraftd.store.direct_io); any other batch, or a filesystem
  without direct I/O, goes through the page cache (pwritev from the buffers,
  each MiB handed to the device at once with sync_file_range). It returns
  the locations and leaves the new end `pending`: the caller records both in
  its index transaction, then calls `commit()` once that is durable, or
  `discard()` if it failed (the bytes past the committed end are cut off).
  One appender at a time (the caller serializes); an `append` after an
  `append` without `commit` starts again from the committed end.
* `open(tail, live)`, at start, makes the files agree with the index: files
  past the committed tail (a crash between `append` and the index commit)
  are cut off or removed, segments nothing lives in are removed, and the
  space between live pages is given back to the filesystem.
* `disk_bytes()`: the disk space the files take (holes excluded).
* `read(locations, dests, checksums=None)` and `read_bytes(location)` copy
  pages into the reader's memory, checked on the way given their xxh3-128
  (kvgraftd.store.segment_maps: out of guarded mappings, or by pread where the
  native part was not built; either way a damaged file fails a read with
  DataLoss, never the process). Reads happen inside `reading()`.
  `addresses(locations)`: where pages lie in the mappings, for guarded native
  code inside a `reading()` (None where reads are not mapped).
* `free(locations)` returns the space of pages the index no longer names, but
  only once every `reading()` that began before the free has ended (until
  then such a reader may still be looking at the bytes): the hole is
  punched (FALLOC_FL_PUNCH_HOLE) and a segment left empty, other than the
  active one, is removed. What is not given back then (a crash, an I/O
  error) is given back by the next `open`.

Why not in LMDB: LMDB copies a value into its dirty pages and writes them out
only at the commit (bench/README.md, store_bench).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import NamedTuple

from kvgraft.errors import ResourceExhausted
from kvgraft.page_buffers import BLOCK_BYTES, block_aligned
from kvgraftd.store.direct_io import (
    TailBlocks,
    direct_pieces,
    is_aligned,
    open_direct,
    pwritev_all,
)
from kvgraftd.store.linux_files import (
    punch_gaps,
    punch_spans,
    start_writeback,
    sync_directory,
)
from kvgraftd.store.segment_maps import MappedSegmentReads, mapped_reads
from kvgraftd.store.segment_reads import WritableBuffer

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 10.0  # close waits this long for reads under way before it unmaps
WRITEBACK_BYTES = 1 << 20  # written, then handed to the device at once (sync_file_range)
DIRECT_WRITE_BYTES = 8 << 20  # one O_DIRECT write: the device's pace needs a few MiB
WRITES_IN_FLIGHT = 2  # queued on the writer thread: one at the device, one waiting
IOV_MAX = 1024
DEFAULT_SEGMENT_BYTES = 1 << 30
_NAME = re.compile(r"^(\d{8})\.seg$")
_ZEROS = memoryview(bytes(BLOCK_BYTES))


PUNCH_BATCH_BYTES = 16 << 20  # freed bytes gathered before their holes are punched


class Location(NamedTuple):
    """Where a page's bytes are: `length` bytes at `offset` of segment `segment`."""

    segment: int
    offset: int
    length: int


class Tail(NamedTuple):
    """The end of what the store has committed: the active segment and its length."""

    segment: int
    end: int


class SegmentFiles:
    """The segment files of one store directory (`directory` is created if missing)."""

    def __init__(self, directory: Path, *, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._segment_bytes = segment_bytes
        self._committed = Tail(1, 0)
        self.pending = self._committed
        self._fd: int | None = None  # the active segment, opened for appends
        self._direct_fd: int | None = None  # the same with O_DIRECT (None: not supported)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="segment-writer")
        self._fd_segment = 0
        self._reads = mapped_reads(self._path, segment_bytes)
        self._lock = threading.Lock()  # epochs, readers, frees, live bytes
        self._reclaiming = threading.Lock()  # also guards _unpunched
        self._unpunched: list[Location] = []  # freed, their holes not punched yet
        self._epoch = 0
        self._readers: Counter[int] = Counter()
        self._freed: list[tuple[int, list[Location], bool]] = []  # epoch, pages, deferred
        self._live: Counter[int] = Counter()

    # ------------------------------------------------------------------
    # start and stop

    def open(self, tail: Tail, live: Iterable[Location]) -> None:
        """Make the files agree with the index (its committed `tail` and `live` pages)."""
        self._committed = self.pending = tail
        self._live = Counter()
        by_segment: dict[int, list[Location]] = {}
        for location in live:
            by_segment.setdefault(location.segment, []).append(location)
            self._live[location.segment] += block_aligned(location.length)
        for segment in self._existing():
            if segment > tail.segment:
                self._path(segment).unlink()  # begun by an append never committed
            elif segment < tail.segment and segment not in by_segment:
                self._path(segment).unlink()  # everything in it was freed
        fd = os.open(self._path(tail.segment), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size > tail.end:
                os.ftruncate(fd, tail.end)  # appended, never committed
        finally:
            os.close(fd)
        for segment, locations in by_segment.items():
            if not self._path(segment).exists():
                log.error("segment %s is missing: its pages will read as lost", segment)
                continue
            end = tail.end if segment == tail.segment else None
            self._punch_gaps(segment, sorted(locations), end)
        sync_directory(self.directory)

    def close(self) -> None:
        """Close the files; the mappings only once every `reading()` has ended (a reader
        still copying from one would fault): where readers outlast CLOSE_WAIT_S, the
        mappings are left for the process's exit to take."""
        self.give_back()
        self._writer.shutdown()
        self._close_fds()
        waited = 0.0
        while self._readers and waited < CLOSE_WAIT_S:
            time.sleep(0.01)
            waited += 0.01
        if self._readers:
            log.warning("segments closed with reads under way: their mappings stay")
            return
        self._reads.close()

    # ------------------------------------------------------------------
    # appends

    def append(
        self, pages: Sequence[memoryview], prepare: Callable[[int], object] | None = None
    ) -> list[Location]:
        """Write `pages` durably past the committed end; see the module contract."""
        start = self._committed
        if start.end >= self._segment_bytes:
            start = Tail(start.segment + 1, 0)
        try:
            locations, end = self._write(start, pages, prepare)
        except OSError as exc:
            self.discard()
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ResourceExhausted(
                    f"the disk holding {self.directory} is full; nothing was written. Free "
                    "disk space or delete artifacts (kvgraft rm ID)."
                ) from None
            raise
        self.pending = Tail(start.segment, end)
        return locations

    def commit(self) -> None:
        """The index holds what the last `append` wrote: it is the store's now."""
        segment = self.pending.segment
        with self._lock:
            self._live[segment] += self.pending.end - (
                self._committed.end if segment == self._committed.segment else 0
            )  # an upper bound: alignment padding counts as live until freed with its page
        self._committed = self.pending

    def discard(self) -> None:
        """Forget the last `append`: its bytes are cut off."""
        self.pending = self._committed
        if self._fd is not None and self._fd_segment != self._committed.segment:
            self._close_fds()
            self._path(self._fd_segment).unlink(missing_ok=True)
        try:
            os.truncate(self._path(self._committed.segment), self._committed.end)
        except OSError as exc:  # e.g. the data directory deleted: said in one line
            log.warning("could not cut segment %d back: %s", self._committed.segment, exc)

    def _write(
        self, start: Tail, pages: Sequence[memoryview], prepare: Callable[[int], object] | None
    ) -> tuple[list[Location], int]:
        fd = self._append_fd(start.segment)
        direct = self._direct_fd
        if direct is not None and not all(map(is_aligned, pages)):
            direct = None  # the page cache takes what the device cannot read in place
        tails = None if direct is None else TailBlocks(sum(len(p) % BLOCK_BYTES > 0 for p in pages))
        limit = WRITEBACK_BYTES if direct is None else DIRECT_WRITE_BYTES
        locations: list[Location] = []
        pieces: list[memoryview] = []  # the next write: up to `limit` bytes of pages
        queued = 0
        at = written = start.end

        in_flight: deque[Future] = deque()  # writes the writer thread has not finished

        def write_queued() -> None:  # on the writer thread, while the next pages are checked
            nonlocal pieces, queued, written
            if len(in_flight) == WRITES_IN_FLIGHT:
                in_flight.popleft().result()  # raises: the finally below waits for the rest
            in_flight.append(self._writer.submit(write, pieces, written, queued))
            written += queued
            pieces, queued = [], 0

        def write(pieces: list[memoryview], offset: int, length: int) -> None:
            pwritev_all(fd if direct is None else direct, pieces, offset)
            if direct is None:
                start_writeback(fd, offset, length)

        def queue(data: memoryview) -> None:
            nonlocal queued
            while data:  # pieces stay whole blocks where they are direct (limit: blocks)
                piece = data[: limit - queued]
                pieces.append(piece)
                queued += len(piece)
                data = data[len(piece) :]
                if queued == limit or len(pieces) == IOV_MAX:
                    write_queued()

        try:
            for index, page in enumerate(pages):
                if prepare is not None:
                    prepare(index)
                locations.append(Location(start.segment, at, len(page)))
                if direct is None:
                    queue(page)
                    queue(_ZEROS[: block_aligned(at + len(page)) - at - len(page)])
                else:
                    for piece in direct_pieces(page, tails):  # the tail block pads it
                        queue(piece)
                at = block_aligned(at + len(page))
            if queued:
                write_queued()
        finally:  # nothing may still write once this returns or raises (discard cuts)
            wait(in_flight)
        for future in in_flight:
            future.result()  # the first write's error, if one failed
        os.fdatasync(fd)
        return locations, at

    def _append_fd(self, segment: int) -> int:
        if self._fd is not None and self._fd_segment == segment:
            return self._fd
        self._close_fds()
        path = self._path(segment)
        created = not path.exists()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        self._fd_segment = segment
        self._direct_fd = open_direct(path)
        if created:
            sync_directory(self.directory)
        return self._fd

    def _close_fds(self) -> None:
        for fd in (self._fd, self._direct_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._direct_fd = None

    # ------------------------------------------------------------------
    # reads

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Pages the index named when it began keep their bytes until it ends (see `free`)."""
        with self._lock:
            epoch = self._epoch
            self._readers[epoch] += 1
        try:
            yield
        finally:
            with self._lock:
                self._readers[epoch] -= 1
                if not self._readers[epoch]:
                    del self._readers[epoch]
            if self._freed:
                self._reclaim()

    def read(
        self,
        locations: Sequence[Location],
        dests: Sequence[WritableBuffer],
        checksums: Sequence[bytes] | None = None,
    ) -> int | None:
        """Copy each page into its buffer, checked given `checksums`: the first page that
        fails, or None (kvgraftd.store.segment_reads)."""
        return self._reads.read(locations, dests, checksums)

    def addresses(self, locations: Sequence[Location]) -> list[int] | None:
        """Where each page lies in its segment's mapping, for guarded native code inside
        this `reading()` (kvgraftd.store.segment_maps); None where reads are not mapped.
        UnreadPage names the first page whose segment cannot be mapped."""
        if not isinstance(self._reads, MappedSegmentReads):
            return None
        return [self._reads.address(location, i) for i, location in enumerate(locations)]

    def read_bytes(self, location: Location) -> bytes:
        """One page's bytes (kvgraftd.store.segment_reads)."""
        return self._reads.read_bytes(location)

    # ------------------------------------------------------------------
    # freeing space

    def free(self, locations: list[Location], defer: bool = False) -> None:
        """Give back the space of pages the index has dropped (once no reader can see them).
        `defer` (eviction's): their holes are punched with others, PUNCH_BATCH_BYTES at a
        time or at `give_back`; otherwise at once."""
        if not locations:
            return
        with self._lock:
            self._freed.append((self._epoch, locations, defer))
            self._epoch += 1
        self._reclaim()

    def _reclaim(self) -> None:
        with self._reclaiming:  # one reclaimer gives space back at a time, outside `_lock`
            with self._lock:
                oldest = min(self._readers, default=self._epoch + 1)
                ready = [locations for epoch, locations, _ in self._freed if epoch < oldest]
                at_once = any(not defer for epoch, _, defer in self._freed if epoch < oldest)
                self._freed = [entry for entry in self._freed if entry[0] >= oldest]
                emptied: set[int] = set()
                for locations in ready:
                    for location in locations:
                        self._live[location.segment] -= block_aligned(location.length)
                        if self._live[location.segment] <= 0:
                            emptied.add(location.segment)
                active = {self._committed.segment, self.pending.segment}
                removed = emptied - active
                for segment in removed:
                    del self._live[segment]
                    # no reader can reach it: the index names none of its pages, and every
                    # read that could has ended
                    self._reads.forget(segment)
            self._unpunched += [loc for locs in ready for loc in locs]
            try:  # the index no longer names these bytes: failing here loses no data
                for segment in removed:
                    self._path(segment).unlink(missing_ok=True)
                    log.info("segment %d emptied and removed", segment)
                self._unpunched = [loc for loc in self._unpunched if loc.segment not in removed]
                if at_once or sum(loc.length for loc in self._unpunched) >= PUNCH_BATCH_BYTES:
                    self._punch_unpunched()
            except OSError as exc:  # e.g. the data directory deleted: one line, no traceback
                log.warning("could not give freed page space back (%s); the next start will", exc)

    def give_back(self) -> None:
        """Punch out every freed page's blocks now (they go in batches of PUNCH_BATCH_BYTES:
        one range for neighbours, fewer calls that each cost the filesystem a journal
        entry; a crash before leaves them to the next start, which punches every gap)."""
        with self._reclaiming:
            try:
                self._punch_unpunched()
            except OSError as exc:  # e.g. the data directory deleted: one line, no traceback
                log.warning("could not give freed page space back (%s); the next start will", exc)

    def _punch_unpunched(self) -> None:
        pending, self._unpunched = self._unpunched, []
        self._punch(pending)

    def _punch(self, locations: list[Location]) -> None:
        by_segment: dict[int, list[tuple[int, int]]] = {}
        for location in locations:
            span = (location.offset, block_aligned(location.length))
            by_segment.setdefault(location.segment, []).append(span)
        for segment, spans in by_segment.items():
            punch_spans(self._path(segment), spans)

    def _punch_gaps(self, segment: int, live: list[Location], end: int | None) -> None:
        spans = [(location.offset, block_aligned(location.length)) for location in live]
        punch_gaps(self._path(segment), spans, end)

    def live_bytes(self) -> int:
        """Bytes of the pages the index names (block-aligned): freed pages not counted, even
        while a read that began before their delete keeps their space a little longer."""
        with self._lock:
            freeing = sum(block_aligned(loc.length) for _, locs, _ in self._freed for loc in locs)
            return sum(self._live.values()) - freeing

    def disk_bytes(self) -> int:
        """What the segment files take on disk (blocks allocated: holes not counted)."""
        total = 0
        for segment in self._existing():
            with suppress(FileNotFoundError):  # removed since it was listed
                total += os.stat(self._path(segment)).st_blocks * 512
        return total

    def _existing(self) -> list[int]:
        names = map(_NAME.match, os.listdir(self.directory))
        return sorted(int(match.group(1)) for match in names if match is not None)

    def _path(self, segment: int) -> Path:
        return self.directory / f"{segment:08d}.seg"
