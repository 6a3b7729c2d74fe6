"""Relaying one artifact's pages from a source's GetArtifact into a target's PutArtifact.

The relay checks every chunk as it passes (kvgraft.chunks): a page that was
asked for, at its size, its pieces in order; each whole page against the
xxh3-128 the source sends (SHA-256 when it sends none). Each message's chunks
become one PutArtifactRequest, decoded (`parts`: a target across the network
frames them anew, one in this process takes them as they are), and the
manifest goes last with the id it must hash to and the source's address (a target
across the network records it as the artifact's origin). The target recomputes SHA-256
of everything anyway: the check here stops a corrupt page before it travels
further, and says which side failed.

A failure on the source side (a cut stream, a corrupt or missing page) is
kept in `source_error` and ends the put without a manifest, so the target
stages the pages it verified instead of committing anything, and a retry
sends only the rest. Memory: the message in hand.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

from kvgraft import wire
from kvgraft.chunks import PageChunks
from kvgraft.errors import DataLoss, KvgraftError
from kvgraft.stream import Stream
from kvgraft.v1 import kvgraft_pb2 as pb

# on_message(page bytes forwarded, digests of the pages that message completed)
MessageHook = Callable[[int, list[bytes]], None]


class PageRelay:
    """The PutArtifact stream of one copy attempt."""

    def __init__(
        self,
        artifact_id: str,
        manifest_bytes: bytes,
        signatures: list[pb.ArtifactSignature],
        sizes: dict[bytes, int],
        wanted: list[bytes],
        stream: Stream[bytes] | None,
        on_message: MessageHook,
        relayed_from: str = "",
    ) -> None:
        self._artifact_id = artifact_id
        self._manifest_bytes = manifest_bytes
        self._signatures = tuple(signatures)
        self._chunks = PageChunks({d: sizes[d] for d in wanted}, hint=" from the source")
        self._stream = stream  # GetArtifact(only_pages=wanted); None when nothing is wanted
        self._on_message = on_message
        self._relayed_from = relayed_from
        self.source_error: KvgraftError | None = None

    def parts(self) -> Iterator[wire.PutPart]:
        """The wanted pages, then the manifest; a failure on the source's side ends them
        before the manifest."""
        if self._stream is not None:
            try:
                yield from self._pages(self._stream)
            except KvgraftError as exc:
                self.source_error = exc
                return
        yield wire.PutPart(
            [], self._manifest_bytes, self._artifact_id, self._signatures, self._relayed_from
        )

    def _pages(self, stream: Stream[bytes]) -> Iterator[wire.PutPart]:
        if manifest_of(next(stream, None), self._artifact_id) != self._manifest_bytes:
            raise DataLoss(f"the manifest of {self._artifact_id[:16]} changed between two reads")
        for raw in stream:
            chunks, manifest = wire.decode_envelope(raw, wire.GET_PAGES, wire.GET_MANIFEST)
            if manifest is not None:
                raise DataLoss("GetArtifact sent a second manifest")
            done = [chunk.sha256 for chunk in chunks if self._chunks.add(chunk)]
            yield wire.PutPart(chunks)
            self._on_message(sum(len(c.data) for c in chunks), done)
        if self._chunks.pending:
            raise DataLoss(
                f"GetArtifact of {self._artifact_id[:16]} ended without page "
                f"{next(iter(self._chunks.pending)).hex()[:16]}"
            )


def manifest_of(raw: bytes | None, artifact_id: str) -> bytes:
    """The manifest bytes of GetArtifact's first message, checked against the id."""
    if raw is None:
        raise DataLoss(f"GetArtifact {artifact_id[:16]} sent no manifest")
    _, manifest = wire.decode_envelope(raw, wire.GET_PAGES, wire.GET_MANIFEST)
    if manifest is None or hashlib.sha256(manifest).hexdigest() != artifact_id:
        raise DataLoss(f"the manifest of {artifact_id[:16]} arrived altered")
    return manifest
