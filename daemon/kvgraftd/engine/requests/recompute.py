"""Recomputing a stored artifact from nothing: Verify, and Graft's fresh equivalent.

`Recompute` is the part the Engine (kvgraftd.engine.requests.engine) holds to replay an
artifact's tokens into a fresh context; it is built from what it uses: the model adapter,
the batcher, the request's `Passes` (kvgraftd.engine.requests.passes) and the engine's
fingerprint and profile, which a recomputed receipt carries. On the row-invariant forward
the tokens run in passes of max_batch_tokens whatever the segments, between the batcher's
steps, logits taken at the segments' ends only (a position's bits do not depend on the
passes); elsewhere segment by segment on the fixed schedule, as they were computed.

`verify(manifest)` recomputes and compares every page hash and the receipt's hashes with
what the manifest holds; the engine checks the artifact is compatible before, and vouches
for it (its trust becomes VERIFIED) when all are equal. It owns no state of its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from kvgraft.errors import Cancelled
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.engine.attention.kv_context import KvContext
from kvgraftd.engine.model.model_adapter import ModelAdapter
from kvgraftd.engine.requests.passes import Passes
from kvgraftd.engine.requests.receipts import input_sha256, logits_bytes, logits_sha256
from kvgraftd.engine.scheduling.batcher import Batcher

RECEIPT_HASHES = (
    "input_sha256",
    "prompt_logits_sha256",
    "generated_logits_sha256",
    "generated_token_ids",
)


class Recompute:
    def __init__(
        self,
        adapter: ModelAdapter,
        batcher: Batcher,
        passes: Passes,
        fingerprint: bytes,
        profile: pb.ComputeProfile,
    ) -> None:
        self.adapter = adapter
        self.batcher = batcher
        self.passes = passes
        self.fingerprint = fingerprint
        self.profile = profile

    def verify(
        self, manifest: pb.Manifest, is_active: Callable[[], bool] | None = None
    ) -> pb.VerifyResponse:
        """Recompute a (compatible) artifact fresh and compare every page and receipt hash
        (Cancelled once `is_active` turns false: the client left)."""
        layers = self.adapter.geometry.num_layers
        with self.passes.serving(is_active, len(manifest.token_ids)) as context:
            after_segment = self.replay(context, manifest)
            computed = [
                hashlib.sha256(context.page_bytes(*divmod(position, layers))).digest()
                for position in range(len(manifest.page_sha256))
            ]
        stored = manifest.receipt
        generated = len(stored.generated_token_ids)
        prompt_segments = len(manifest.segment_ends) - generated
        prompt_end = manifest.segment_ends[prompt_segments - 1] if prompt_segments > 0 else 0
        recomputed = pb.Receipt(
            input_sha256=input_sha256(
                manifest.token_ids[:prompt_end], manifest.segment_ends[:prompt_segments]
            ),
            prompt_logits_sha256=logits_sha256(after_segment[prompt_segments - 1])
            if prompt_segments
            else b"",
            generated_logits_sha256=hashlib.sha256(
                b"".join(logits_bytes(x) for x in after_segment[prompt_segments:])
            ).digest(),
            generated_token_ids=manifest.token_ids[prompt_end:],
            computed_tokens=len(manifest.token_ids),
            model_fingerprint=self.fingerprint,
            profile=self.profile,
        )
        mismatches = [
            f"page {position // layers} layer {position % layers}"
            for position, (digest, fresh) in enumerate(
                zip(manifest.page_sha256, computed, strict=True)
            )
            if fresh != digest
        ]
        if manifest.HasField("receipt"):
            mismatches += [
                name
                for name in RECEIPT_HASHES
                if getattr(stored, name) != getattr(recomputed, name)
            ]
        return pb.VerifyResponse(
            ok=not mismatches, stored=stored, recomputed=recomputed, mismatches=mismatches
        )

    def recompute(self, context: KvContext, manifest: pb.Manifest) -> None:
        """An artifact's tokens computed afresh into `context` (their logits unused)."""
        if not self.adapter.row_invariant:  # the fixed schedule: segment by segment
            self.replay(context, manifest)
            return
        self.batcher.forward(context, list(manifest.token_ids), context.wanted)
        context.segment_ends.extend(manifest.segment_ends)

    def replay(self, context: KvContext, manifest: pb.Manifest) -> list[torch.Tensor]:
        """Recompute an artifact's segments from nothing; logits after each segment.

        On the row-invariant forward the tokens run in passes of max_batch_tokens whatever
        the segments (a generated token is a segment of its own: a decode step each, before),
        with logits taken at the segments' ends only; elsewhere, segment by segment on the
        fixed schedule."""
        if not self.adapter.row_invariant:
            start, out = 0, []
            for end in manifest.segment_ends:
                out.append(self.passes.append(context, manifest.token_ids[start:end]))
                start = end
            return out
        tokens, ends, out = list(manifest.token_ids), list(manifest.segment_ends), []
        step = self.batcher.max_batch_tokens  # between steps: others wait no longer than that
        for first in range(0, len(tokens), step):
            if not context.wanted():
                raise Cancelled("the client went away; its request stopped")
            chunk = tokens[first : first + step]
            rows = [end - 1 - first for end in ends if first < end <= first + len(chunk)]
            logits = self.batcher.compute.run(self._forward_rows_here, context, chunk, rows)
            out.extend(logits)
        context.segment_ends.extend(ends)
        return out

    def _forward_rows_here(self, context: KvContext, chunk: list[int], rows: list[int]):
        assert torch.are_deterministic_algorithms_enabled()
        context.begin_chunk(context.length, chunk)
        logits = self.adapter.native.forward(chunk, context.length, context, rows=rows)
        context.end_chunk(chunk)
        return logits
