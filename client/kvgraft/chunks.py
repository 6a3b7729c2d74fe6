"""Pages that arrive in chunks (GetArtifact), checked as they pass: the one reassembly check.

`PageChunks(sizes)` takes the chunks of a stream in order. A chunk must name a
page still expected (by its SHA-256) at that page's size, and continue it where
its last piece stopped; each page is hashed piece by piece
(kvgraft.page_checks.PageHash: the xxh3-128 the sender gave, SHA-256 when it
gave none or `also_sha256` is asked for). `add(chunk)` returns True once the
page's last byte has arrived intact, and raises DataLoss naming the page
otherwise; a page completes once, so a second copy of it is refused too.

Both readers of GetArtifact use it: kvgraft.Client.get_artifact, which copies
the bytes into the artifact's slots, and replication's page relay
(kvgraft.replication.page_relay), which forwards them. Memory: one hash state
per page in flight.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvgraft import wire
from kvgraft.errors import DataLoss
from kvgraft.page_checks import PageHash


class PageChunks:
    def __init__(
        self, sizes: Mapping[bytes, int], *, also_sha256: bool = False, hint: str = ""
    ) -> None:
        self._sizes = sizes
        self._also_sha256 = also_sha256
        self._hint = hint  # appended to every error: where the pages came from, what to do
        self.pending = set(sizes)  # pages not yet complete
        self._partial: dict[bytes, tuple[PageHash, int]] = {}  # digest -> (hash, bytes so far)

    def add(self, chunk: wire.Chunk) -> bool:
        """Check one chunk; True when it completed its page, intact."""
        digest = chunk.sha256
        if digest not in self.pending or chunk.page_bytes != self._sizes[digest]:
            raise DataLoss(
                f"page {digest.hex()[:16]} arrived unasked or at another size "
                f"({chunk.page_bytes} bytes){self._hint}"
            )
        page_hash, received = self._partial.pop(digest, (None, 0))
        if chunk.offset != received or received + len(chunk.data) > chunk.page_bytes:
            raise DataLoss(f"page {digest.hex()[:16]} arrived in pieces out of order{self._hint}")
        if page_hash is None:
            page_hash = PageHash(digest, chunk.xxh3, also_sha256=self._also_sha256)
        page_hash.update(chunk.data)
        received += len(chunk.data)
        if received < chunk.page_bytes:
            self._partial[digest] = (page_hash, received)
            return False
        if not page_hash.intact():
            raise DataLoss(f"page {digest.hex()[:16]} arrived corrupt{self._hint}")
        self.pending.discard(digest)
        return True
