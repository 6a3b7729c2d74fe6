"""Intake of pages from an untrusted stream (a client, a peer).

Chunks are assembled into whole pages, and every whole page's SHA-256 is
recomputed before it is accepted: this is a trust boundary (docs/architecture.md). The
pages a message completes are hashed side by side, on two threads
(kvgraft.page_checks) and 16 to a call (kvgraftd.store.sha256_lanes). An
accepted page is held as a store record (its xxh3-128 and a view of the
received bytes, kvgraftd.store.page_records) ready to commit.

Memory is bounded per stream and across streams (kvgraftd.store.upload_limits):
when the held bytes pass `spill_bytes`, or the uploads in progress together
hold more than the daemon's upload memory, they are staged in the store, so
that memory stays bounded and a cut transfer can resume without resending
them. Pages still arriving in pieces cannot be staged: their bytes are bounded
by max(spill_bytes, MAX_PAGE_BYTES) per stream and by the upload memory
together, beyond which the upload is refused (ResourceExhausted). Staging is
charged to the stream's connection (at most so much staged disk each) before
the store bounds it in total; the pages a stream staged are not collected
while it runs, for at most as long as a call may run (Store.uploading). An
intake is a context manager: what it holds is given back when it ends.

Errors: malformed chunks are InvalidArgument; a page whose bytes do not hash
to its name is DataLoss (the sender should resend it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from contextlib import ExitStack

from kvgraft import wire
from kvgraft.artifact import DIGEST_BYTES, MAX_PAGE_BYTES, page_sizes, parse_manifest
from kvgraft.errors import DataLoss, InvalidArgument, ResourceExhausted
from kvgraft.page_buffers import block_aligned, page_slots
from kvgraft.page_checks import split_pages
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraft.wire import Chunk
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.page_records import PageRecord, page_record
from kvgraftd.store.sha256_lanes import LANES, sha256_digests
from kvgraftd.store.upload_limits import UploadBounds

RECORD_OVERHEAD_BYTES = 512  # a held page's record, views and dictionary entries, about
# SHA-256 runs at 1.2-2.5 GB/s a core here: a message's pages are worth two threads from 1 MiB.
SHA256_PARALLEL_MIN_BYTES = 1 << 20


class PageIntake:
    """Accumulates verified pages of one PutArtifact stream from `connection` (the peer's
    host; empty: the daemon's own pulls, charged to no one)."""

    def __init__(self, store: Store, bounds: UploadBounds, connection: str = "") -> None:
        self._store = store
        self._bounds = bounds
        self._connection = connection
        self._partial: dict[bytes, bytearray] = {}  # bytes received of pages still arriving
        self._page_bytes: dict[bytes, int] = {}  # the size each partial page announced
        self.records: dict[bytes, PageRecord] = {}  # verified, not yet staged
        self.staged: dict[bytes, int] = {}  # verified and staged: the disk charged for each
        self._held_bytes = 0  # what self.records cost in memory (counted in bounds.memory)
        self._partial_bytes = 0  # in self._partial: bounded, as it cannot be staged
        self._partial_limit = max(bounds.spill_bytes, MAX_PAGE_BYTES)
        self._exit = ExitStack()

    def __enter__(self) -> PageIntake:
        with ExitStack() as entering:
            entering.enter_context(self._store.uploading(self.staged, self._bounds.running_s))
            entering.callback(self._give_back)  # runs first on the way out
            self._exit = entering.pop_all()
        return self

    def __exit__(self, *exc_info) -> None:
        self._exit.close()

    def _give_back(self) -> None:
        """What the upload holds in memory goes back to the uploads' count."""
        self._partial.clear()
        self.records.clear()
        self._bounds.memory.release(self._held_bytes + self._partial_bytes)
        self._held_bytes = self._partial_bytes = 0

    def receive(self, parts: Iterable[wire.PutPart]) -> tuple[pb.Manifest | None, wire.PutPart]:
        """Every part's pages; the manifest (the last part), if sent, and that last part
        (its expected id, signatures and relay source)."""
        manifest: pb.Manifest | None = None
        last = wire.PutPart([])
        for part in parts:
            if manifest is not None:
                raise InvalidArgument("the manifest must be the last message of PutArtifact")
            if part.manifest is not None:
                manifest = parse_manifest(part.manifest)
                last = part
            self.add(part.chunks)
        return manifest, last

    def add(self, chunks: Sequence[Chunk]) -> None:
        """The chunks of one message; the pages they complete are verified side by side."""
        whole: dict[bytes, bytes | bytearray | memoryview] = {}
        for chunk in chunks:
            data = self._assemble(chunk, whole)
            if data is not None:
                whole[chunk.sha256] = data
        pages = list(whole.items())
        records: list[PageRecord | None] = [None] * len(pages)
        slots = page_slots({digest: len(data) for digest, data in pages})

        def verify(lo: int, hi: int) -> int | None:
            for start in range(lo, hi, LANES):
                group = range(start, min(start + LANES, hi))
                # Each page copied to its block-aligned slot (the store writes it with
                # direct I/O) and hashed in the same pass.
                actual = sha256_digests(
                    [pages[index][1] for index in group],
                    [slots[pages[index][0]] for index in group],
                )
                for index, got in zip(group, actual, strict=True):
                    digest = pages[index][0]
                    if got != digest:
                        return index
                    records[index] = page_record(slots[digest])
            return None

        nbytes = sum(len(data) for data in whole.values())
        bad = split_pages(len(pages), nbytes, verify, SHA256_PARALLEL_MIN_BYTES)
        if bad is not None:
            digest, data = pages[bad]
            raise DataLoss(
                f"page {digest.hex()[:16]} arrived corrupt (its bytes hash to "
                f"{hashlib.sha256(data).hexdigest()[:16]}); nothing was stored: resend it"
            )
        cost = 0
        for (digest, _), record in zip(pages, records, strict=True):
            self.records[digest] = record
            # what it costs to hold: its block-aligned slot and its record, not its length
            # (80,000 four-byte pages held 383 MiB when counted as 320 KB)
            cost += block_aligned(len(record.data)) + RECORD_OVERHEAD_BYTES
        self._held_bytes += cost
        # past this upload's spill_bytes, or the uploads' memory together: to disk
        fits = self._bounds.memory.hold(cost)
        if not fits or self._held_bytes >= self._bounds.spill_bytes:
            self.stage()

    def _assemble(
        self, chunk: Chunk, whole: dict[bytes, bytes | bytearray | memoryview]
    ) -> bytes | bytearray | memoryview | None:
        """The page's bytes once `chunk` completes it; None while it is incomplete or known."""
        digest, size = chunk.sha256, chunk.page_bytes
        if len(digest) != DIGEST_BYTES:
            raise InvalidArgument("every page chunk needs a 32-byte sha256")
        if not 1 <= size <= MAX_PAGE_BYTES:
            raise InvalidArgument(
                f"page {digest.hex()[:16]}: page_bytes {size} is outside 1..{MAX_PAGE_BYTES}"
            )
        if digest in self.records or digest in self.staged or digest in whole:
            return None  # a page sent twice is accepted once
        data = chunk.data
        if chunk.offset == 0 and len(data) == size:
            return data
        buffer = self._partial.get(digest)
        if buffer is None:
            if chunk.offset != 0:
                raise InvalidArgument(f"page {digest.hex()[:16]}: first chunk must have offset 0")
            # Grown as bytes arrive, not allocated at page_bytes: a few bytes
            # announcing a 64 MiB page must not cost 64 MiB of memory.
            buffer = self._partial[digest] = bytearray()
            self._page_bytes[digest] = size
        filled = len(buffer)
        if self._page_bytes[digest] != size or chunk.offset != filled or filled + len(data) > size:
            raise InvalidArgument(
                f"page {digest.hex()[:16]}: chunks must arrive in order, with one page_bytes, "
                "and cover the page exactly"
            )
        if self._partial_bytes + len(data) > self._partial_limit:
            raise ResourceExhausted(
                f"this upload holds {self._partial_bytes + len(data)} bytes of pages it has not "
                f"finished, more than the daemon allows ({self._partial_limit}, from "
                "spill_bytes); send each page's chunks one after the other"
            )
        self._hold_partial(digest, len(data))
        buffer += data
        if len(buffer) < size:
            return None
        del self._partial[digest], self._page_bytes[digest]
        self._partial_bytes -= size
        self._bounds.memory.release(size)  # held as a record from here (add)
        return buffer

    def _hold_partial(self, digest: bytes, nbytes: int) -> None:
        """Count `nbytes` more of an unfinished page in the uploads' memory: after staging
        this upload's verified pages if need be; refused if even that leaves no room."""
        memory = self._bounds.memory
        if not memory.try_hold(nbytes):
            self.stage()
            if not memory.try_hold(nbytes):
                raise ResourceExhausted(
                    f"the uploads in progress hold {memory.held} bytes of pages in memory, the "
                    f"daemon's limit (upload_memory_bytes = {memory.limit_bytes}); page "
                    f"{digest.hex()[:16]}'s next {nbytes} bytes do not fit: retry when other "
                    "uploads finish, and send each page's chunks one after the other"
                )
        self._partial_bytes += nbytes

    def stage(self) -> None:
        """Persist the verified pages held in memory (as unreferenced pages), charged to the
        connection first; refused (ResourceExhausted) past its limit or the store's."""
        if not self.records:
            return
        missing = set(self._store.missing_pages(list(self.records)))
        disk = {
            d: block_aligned(len(r.data)) if d in missing else 0 for d, r in self.records.items()
        }
        added = [d for d in disk if d not in self.staged]  # a page staged before keeps its charge
        charged = sum(disk[d] for d in added)
        self._bounds.staged.charge(self._connection, charged)
        for digest in added:  # before they are staged: no collection may take them
            self.staged[digest] = disk[digest]
        try:
            self._stage_records()
        except BaseException:
            self._bounds.staged.credit(self._connection, charged)
            for digest in added:  # those staged earlier stay protected
                del self.staged[digest]
            raise
        self.records.clear()
        self._bounds.memory.release(self._held_bytes)
        self._held_bytes = 0

    def _stage_records(self) -> None:
        bounds = self._bounds
        try:
            self._store.stage_pages(self.records, bounds.staged_max_bytes)
        except ResourceExhausted:
            # unclaimed pages past their TTL may hold the room: collected now, not at the
            # next housekeeping round (not for every refusal of a storm: paced)
            if not bounds.collections.due() or not self._store.collect_staged(bounds.staged_ttl_s):
                raise
            self._store.stage_pages(self.records, bounds.staged_max_bytes)

    def keep(self) -> str:
        """Stage what is held, so that a retry need not resend it (the stream ended before
        its manifest); why it could not be kept, or ''."""
        try:
            self.stage()
        except ResourceExhausted as exc:
            return str(exc)
        return ""

    def committed(self, manifest: pb.Manifest) -> None:
        """The manifest was committed: the staged pages it names are the artifact's now,
        off the connection's count."""
        sizes = page_sizes(manifest)
        claimed = sum(disk for digest, disk in self.staged.items() if digest in sizes)
        self._bounds.staged.credit(self._connection, claimed)

    def check_against(self, manifest: pb.Manifest) -> None:
        """Every page received must be whole, named by the manifest and of its size."""
        if self._partial:
            digest = next(iter(self._partial))
            raise InvalidArgument(
                f"page {digest.hex()[:16]} is incomplete: the stream ended "
                f"{self._page_bytes[digest] - len(self._partial[digest])} bytes short"
            )
        sizes = page_sizes(manifest)
        for digest, record in self.records.items():
            expected = sizes.get(digest)
            if expected is None:
                raise InvalidArgument(
                    f"page {digest.hex()[:16]} was sent but the manifest does not name it"
                )
            size = len(record.data)
            if size != expected:
                raise InvalidArgument(
                    f"page {digest.hex()[:16]} has {size} bytes; the manifest's layout needs "
                    f"{expected}"
                )
