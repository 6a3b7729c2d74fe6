"""Intake of pages from an untrusted stream (a client, a peer).

Chunks are assembled into whole pages, and every whole page's SHA-256 is
recomputed before it is accepted: this is a trust boundary (docs/architecture.md). The
pages a message completes are hashed side by side, on two threads
(kvgraft.page_checks) and 16 to a call (kvgraftd.store.sha256_lanes). An
accepted page is held as a store record (its xxh3-128 and a view of the
received bytes, kvgraftd.store.page_records) ready to commit.
When the held bytes pass `spill_bytes`, they are staged in the store so that
memory stays bounded and a cut transfer can resume without resending them.
Pages still arriving in pieces cannot be staged: their bytes are bounded by
max(spill_bytes, MAX_PAGE_BYTES), beyond which the upload is refused
(ResourceExhausted), so no stream can grow the daemon without bound.

Errors: malformed chunks are InvalidArgument; a page whose bytes do not hash
to its name is DataLoss (the sender should resend it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvgraft.artifact import DIGEST_BYTES, MAX_PAGE_BYTES, page_sizes
from kvgraft.errors import DataLoss, InvalidArgument, ResourceExhausted
from kvgraft.page_buffers import block_aligned, page_slots
from kvgraft.page_checks import split_pages
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraft.wire import Chunk
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.page_records import PageRecord, page_record
from kvgraftd.store.sha256_lanes import LANES, sha256_digests

RECORD_OVERHEAD_BYTES = 512  # a held page's record, views and dictionary entries, about
# SHA-256 runs at 1.2-2.5 GB/s a core here: a message's pages are worth two threads from 1 MiB.
SHA256_PARALLEL_MIN_BYTES = 1 << 20


class PageIntake:
    """Accumulates verified pages of one PutArtifact stream."""

    def __init__(self, store: Store, spill_bytes: int, staged_max_bytes: int = 0) -> None:
        self._store = store
        self._spill_bytes = spill_bytes
        self._staged_max_bytes = staged_max_bytes
        self._partial: dict[bytes, bytearray] = {}  # bytes received of pages still arriving
        self._page_bytes: dict[bytes, int] = {}  # the size each partial page announced
        self.records: dict[bytes, PageRecord] = {}  # verified, not yet staged
        self.staged: set[bytes] = set()  # verified and staged in the store
        self._held_bytes = 0
        self._partial_bytes = 0  # in self._partial: bounded, as it cannot be staged
        self._partial_limit = max(spill_bytes, MAX_PAGE_BYTES)

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
        for (digest, _), record in zip(pages, records, strict=True):
            self.records[digest] = record
            # what it costs to hold: its block-aligned slot and its record, not its length
            # (80,000 four-byte pages held 383 MiB when counted as 320 KB)
            self._held_bytes += block_aligned(len(record.data)) + RECORD_OVERHEAD_BYTES
        if self._held_bytes >= self._spill_bytes:
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
        self._partial_bytes += len(data)
        if self._partial_bytes > self._partial_limit:
            raise ResourceExhausted(
                f"this upload holds {self._partial_bytes} bytes of pages it has not finished, "
                f"more than the daemon allows ({self._partial_limit}, from spill_bytes); send "
                "each page's chunks one after the other"
            )
        buffer += data
        if len(buffer) < size:
            return None
        del self._partial[digest], self._page_bytes[digest]
        self._partial_bytes -= size
        return buffer

    def stage(self) -> None:
        """Persist the verified pages held in memory (as unreferenced pages)."""
        if self.records:
            self._store.stage_pages(self.records, self._staged_max_bytes)
            self.staged.update(self.records)
            self.records.clear()
            self._held_bytes = 0

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
