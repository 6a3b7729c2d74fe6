"""The graft engine: one canonical compute path, grafts at own positions, receipts.

On the row-invariant forward (CPU, docs/architecture.md) a position's bits depend on
the tokens up to it alone, so contexts are computed in whatever passes suit: every
request's passes go to the batcher (kvgraftd.engine.scheduling.batcher), whose steps hold the
rows of many contexts at once. Elsewhere every context is computed the same way: each
append of tokens runs as forward passes split at absolute positions that are
multiples of page_tokens; each generated token is its own forward pass. Either way a
fresh run and a grafted run give the same bits:

* Generate grafts the longest stored prefix whose chain matches the prompt (whole
  pages, and on the row-invariant forward to the token: the first rows of a stored
  page), leaving at least one prompt token to compute, then computes the rest.
* Graft restores one whole artifact, tail page included, at its own positions
  and appends the continuation as a new segment; its fresh equivalent replays
  the artifact's segments, then the continuation.
* Verify recomputes an artifact from nothing and compares every page hash and
  every receipt hash with what is stored (kvgraftd.engine.requests.recompute).

The Engine holds three parts, each built from what it uses: `Passes` (a request admitted,
its segments computed in the batcher's steps), `Recompute` (an artifact replayed fresh)
and `Deposits` (a finished context kept). `for_tenant` gives the engine as one tenant uses
it: the same model, batcher and tiers, its own store view, admission and labels.

A model fingerprint, compute profile or layout mismatch fails closed with
FailedPrecondition; a corrupt page fails with DataLoss (from the store).
Forward passes and token choices run on the engine's compute thread
(kvgraftd.engine.scheduling.compute_thread), in the batcher's steps;
requests in flight are bounded (max_running_contexts, and the live KV they reserve:
max_live_kv_bytes; beyond, they queue up to max_queued_requests, then are refused with
RESOURCE_EXHAUSTED) and stop when their client leaves (kvgraftd.engine.requests.passes).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import ExitStack

import torch

from kvgraft.errors import ContextLengthExceeded, FailedPrecondition, InvalidArgument, NotFound
from kvgraft.tenancy import owner_of
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.engine.attention.kv_context import KvContext
from kvgraftd.engine.model.model_adapter import ModelAdapter
from kvgraftd.engine.model.native_forward import FLOAT_PRODUCTS, INTEGER_PRODUCTS
from kvgraftd.engine.requests.decoding import DecodeOptions, ResultEvent, TokenEvent
from kvgraftd.engine.requests.deposits import Deposits
from kvgraftd.engine.requests.passes import Admitting, Passes
from kvgraftd.engine.requests.receipts import (
    compute_profile,
    input_sha256,
    logits_bytes,
    logits_sha256,
    logits_view,
    pin_determinism,
)
from kvgraftd.engine.requests.recompute import Recompute
from kvgraftd.engine.requests.token_choice import StopStrings, sampling_of, token_logprobs
from kvgraftd.engine.requests.token_stream import TokenStream
from kvgraftd.engine.scheduling.admission import Admission
from kvgraftd.engine.scheduling.batcher import Batcher
from kvgraftd.engine.scheduling.compute_thread import ComputeThread
from kvgraftd.engine.scheduling.forward_step import ForwardStep
from kvgraftd.store.interface import EngineStore
from kvgraftd.store.signing import Signer, TrustPolicy
from kvgraftd.store.trust_index import NO_MATCH, ChainMatch, is_trusted
from kvgraftd.tiers.device_pool import DevicePool
from kvgraftd.tiers.host_cache import HostCache
from kvgraftd.tiers.stack import Tiers

VERIFIED = pb.Provenance.TRUST_VERIFIED


class Engine:
    def __init__(
        self,
        adapter: ModelAdapter,
        store: EngineStore,
        *,
        page_tokens: int = 64,
        block_tokens: int = 4096,
        max_context_tokens: int = 32768,
        tiers: Tiers | None = None,
        trust: TrustPolicy | None = None,
        max_batch_tokens: int = 128,
        max_batch_rows: int = 64,
        max_running_contexts: int = 64,
        max_queued_requests: int = 256,
        max_live_kv_bytes: int = 0,
        auto_cache: bool = False,
        compute: ComputeThread | None = None,
    ) -> None:
        """`compute`: the thread its passes run on (the one the model was loaded on)."""
        pin_determinism()
        self.adapter = adapter
        # What it computes or verifies, it signs. Without the daemon's policy (tests that
        # build an engine alone), a key made for this engine.
        self.trust = trust or TrustPolicy(Signer.generate())
        g = adapter.geometry
        # Without explicit tiers: an unbounded pool (everything resident), no host cache.
        self.tiers = tiers or Tiers(
            DevicePool(0, (2, g.kv_heads, block_tokens, g.head_dim)), HostCache(store, 0)
        )
        # cache = "auto": every Generate keeps its finished context (never failing for it)
        self.auto_cache = auto_cache
        self._token_texts: dict[int, str] = {}  # each token's text alone, as TokenEvents say it
        self.page_tokens = page_tokens
        self.block_tokens = block_tokens
        self.max_context_tokens = max_context_tokens
        # Requests in flight, and their passes in the batcher's steps: on the row-invariant
        # forward many contexts a step, else one a step up to each page boundary.
        admission = Admission(max_running_contexts, max_queued_requests, max_live_kv_bytes)
        compute = compute or ComputeThread()
        step = ForwardStep(adapter, page_tokens)
        if adapter.row_invariant:
            self.batcher = Batcher(step, max_batch_tokens, max_batch_rows, compute)
        else:
            self.batcher = Batcher(step, page_tokens, 1, compute, step.page_room)
        self.fingerprint = adapter.fingerprint
        self.profile = compute_profile(
            page_tokens, block_tokens, g, self.tiers.pool.device, adapter.products
        )
        self.layout = pb.KvLayout(
            num_layers=g.num_layers,
            kv_heads=g.kv_heads,
            head_dim=g.head_dim,
            kv_dtype=pb.KV_DTYPE_FLOAT32,
        )
        self._assemble(store, admission, tenant="")

    def _assemble(self, store: EngineStore, admission: Admitting, tenant: str) -> None:
        """The parts over `store` and `admission`, depositing as `tenant`'s."""
        self.store = store
        self.admission = admission
        g = self.adapter.geometry
        # live KV (computed here, in host buffers) a position of a context holds: K and V
        live_bytes_per_token = 2 * g.num_layers * g.kv_heads * g.head_dim * 4
        self._passes = Passes(self.batcher, admission, self._context, live_bytes_per_token)
        self._recompute = Recompute(
            self.adapter, self.batcher, self._passes, self.fingerprint, self.profile
        )
        self._deposits = Deposits(
            store, self.trust, self.fingerprint, self.profile, self.layout, tenant
        )

    def for_tenant(self, store: EngineStore, tenant: str, admission: Admitting) -> Engine:
        """This engine as `tenant` uses it: every model, batcher and tier object shared, its
        own store view, admission and deposit counters, its deposits labelled as its."""
        scoped = copy.copy(self)
        scoped._assemble(store, admission, tenant)
        return scoped

    @property
    def auto_deposits(self) -> int:  # finished contexts kept by cache = "auto"
        return self._deposits.auto_deposits

    @property
    def auto_deposits_skipped(self) -> int:  # not kept by cache = "auto": the store had no room
        return self._deposits.auto_deposits_skipped

    def _context(self, live_tokens: int = 0) -> KvContext:
        """A fresh context whose live buffers hold `live_tokens` at once."""
        return KvContext(
            self.adapter.geometry,
            self.page_tokens,
            self.block_tokens,
            self.tiers,
            rows=self.adapter.row_invariant,
            live_tokens=live_tokens,
        )

    def _check_length(self, tokens: int) -> None:
        if tokens > self.max_context_tokens:
            raise ContextLengthExceeded(
                f"context of {tokens} tokens exceeds max_context_tokens={self.max_context_tokens}; "
                "shorten the prompt or raise max_context_tokens"
            )

    def _check_tokens(self, token_ids: Sequence[int]) -> None:
        vocab = self.adapter.geometry.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument(
                f"token id {bad} is outside the model's vocabulary (0..{vocab - 1})"
            )

    # ------------------------------------------------------------------
    # grafting

    def _check_compatible(self, manifest: pb.Manifest, artifact_id: str) -> None:
        theirs = manifest.model_fingerprint.hex()[:16]
        if manifest.model_fingerprint != self.fingerprint:
            raise FailedPrecondition(
                f"artifact {artifact_id[:16]} was computed by model {theirs}, this daemon serves "
                f"{self.fingerprint.hex()[:16]}: it cannot be grafted here"
            )
        profile = manifest.profile
        if profile.products != self.profile.products:
            # a daemon of this version computes it where the products are one of today's
            flag = {INTEGER_PRODUCTS: "int8-dot", FLOAT_PRODUCTS: "fp32"}.get(profile.products)
            elsewhere = f", or graft it on a daemon started with --products {flag}" if flag else ""
            raise FailedPrecondition(
                f"artifact {artifact_id[:16]} was computed with other products "
                f"({profile.products or 'torch'}) than this daemon's "
                f"({self.profile.products or 'torch'}): its bytes would not match a fresh run "
                f"here. Recompute it here (Generate with no_cache and deposit){elsewhere}"
            )
        if profile != self.profile or manifest.layout != self.layout:
            raise FailedPrecondition(
                f"artifact {artifact_id[:16]} was computed under another compute profile "
                f"({profile.attention}, page_tokens={profile.page_tokens}, torch "
                f"{profile.torch_version}, {profile.device_name}); its bytes would not match a "
                "fresh run here: recompute it (Generate with no_cache and deposit)"
            )

    def lookup(self, token_ids: Sequence[int]) -> pb.LookupResponse:
        """The longest trusted stored prefix of `token_ids`, and a longer one an untrusted
        artifact holds, if any (what verifying it would add)."""
        tokens = self._matched_pages(token_ids).tokens
        response = pb.LookupResponse(
            matched_tokens=tokens,
            matched_pages=tokens // self.page_tokens,
            model_fingerprint=self.fingerprint,
        )
        if tokens < len(token_ids):
            untrusted, artifact_id = self.store.longest_untrusted(
                self.fingerprint, self.profile, self.layout, token_ids
            )
            if untrusted > tokens:
                response.untrusted_tokens = untrusted
                response.untrusted_artifact_id = artifact_id
        return response

    def _matched_pages(self, token_ids: Sequence[int], hold: ExitStack | None = None) -> ChainMatch:
        return self.store.longest_chain(
            self.fingerprint, self.profile, self.layout, token_ids, hold
        )

    # ------------------------------------------------------------------
    # requests

    def generate(
        self,
        prompt_ids: Sequence[int],
        options: DecodeOptions,
        is_active: Callable[[], bool] | None = None,
    ) -> Iterator[TokenEvent | ResultEvent]:
        """Run a prompt as one segment, grafting its longest stored prefix: whole pages, and
        with row-invariant products any prefix of a stored page too (at least one token is
        left to compute, for the logits). `is_active`: whether the caller still wants it (a request
        queued behind max_running_contexts gives up when it turns false)."""
        prompt = list(prompt_ids)
        if not prompt:
            raise InvalidArgument("the prompt is empty: give text or at least one token id")
        self._check_tokens(prompt)
        self._check_length(len(prompt) + options.max_new_tokens)
        with ExitStack() as held:
            # its voucher leased: not evicted while its pages are read (computed if so)
            match = NO_MATCH if options.no_cache else self._matched_pages(prompt[:-1], held)
            reused = match.tokens
            live = len(prompt) - reused // self.page_tokens * self.page_tokens
            with self._passes.serving(is_active, live + options.max_new_tokens) as context:
                if match.entries:
                    hashes = [digest for entry in match.entries for digest in entry.page_sha256]
                    context.attach(prompt[:reused], hashes)
                logits = yield from self._passes.prompt(context, prompt[reused:], options, reused)
                auto = (self.auto_cache or options.keep) and not options.deposit
                result = yield from self._decode(
                    context,
                    logits,
                    options,
                    reused,
                    len(prompt) - reused,
                    match.grafted,
                    auto_deposit=auto,
                )
        yield result  # its context released and its admission slot free: a next call is let in

    def verify(
        self, artifact_id: str, is_active: Callable[[], bool] | None = None
    ) -> pb.VerifyResponse:
        """Recompute an artifact fresh and compare every page and receipt hash (Cancelled
        once `is_active` turns false: the client left); when all are equal this daemon
        vouches for it (its trust becomes VERIFIED)."""
        full_id = self.store.resolve(artifact_id)
        manifest = self.store.get_record(full_id).manifest()
        self._check_compatible(manifest, full_id)
        self._check_tokens(manifest.token_ids)
        self._check_length(len(manifest.token_ids))  # a recompute costs what a generate would
        response = self._recompute.verify(manifest, is_active)
        if response.ok:  # recomputed here, every hash equal: this daemon vouches for it
            self.store.trust_artifact(full_id, self.trust.computed(full_id, VERIFIED))
        return response

    def _lease(self, held: ExitStack, artifact_id: str, tokens: int) -> bool:
        """Lease a stored artifact for a graft; False if it was evicted meanwhile (DataLoss
        if it is quarantined)."""
        self.store.check_servable(artifact_id)
        try:
            held.enter_context(self.store.reading(artifact_id, tokens))
        except NotFound:
            return False
        return True

    def graft(
        self,
        artifact_id: str,
        continuation: Sequence[int],
        options: DecodeOptions,
        is_active: Callable[[], bool] | None = None,
    ) -> Iterator[TokenEvent | ResultEvent]:
        """Restore a whole artifact, append `continuation` as a new segment, generate."""
        if not continuation:
            raise InvalidArgument("Graft needs a continuation of at least one token")
        self._check_tokens(continuation)
        full_id = self.store.resolve(artifact_id)
        manifest = self.store.get_record(full_id).manifest()
        self._check_compatible(manifest, full_id)
        self._check_tokens(manifest.token_ids)
        self._check_length(len(manifest.token_ids) + len(continuation) + options.max_new_tokens)
        grafted = []
        if not options.no_cache:
            provenance = self.store.provenance(full_id)
            if not is_trusted(provenance) and not options.allow_untrusted:
                raise FailedPrecondition(
                    f"artifact {full_id[:16]} is untrusted ({provenance.origin}): nothing shows "
                    "its KV is what this model computes for its tokens. Verify it "
                    f"(kvgraft verify {full_id[:16]}), trust the key that signed it ([trust] "
                    "keys), or graft it anyway (--allow-untrusted: the receipt says so)"
                )
            grafted = [
                pb.GraftedArtifact(
                    artifact_id=full_id,
                    tokens=len(manifest.token_ids),
                    trust=provenance.trust,
                    vouched_by=provenance.vouched_by,
                    owner=owner_of(manifest.labels),
                )
            ]
        held = ExitStack()  # the artifact leased from here to the end: never evicted under us
        fresh = options.no_cache or not self._lease(held, full_id, len(manifest.token_ids))
        if fresh:
            grafted = []
        stored = 0 if fresh else len(manifest.token_ids) // self.page_tokens * self.page_tokens
        live = len(manifest.token_ids) - stored + len(continuation) + options.max_new_tokens
        with held, self._passes.serving(is_active, live) as context:
            if fresh:  # asked for, or evicted since it was found: recomputed, same receipt
                self._recompute.recompute(context, manifest)
                reused, computed = 0, len(manifest.token_ids)
            else:
                context.attach(manifest.token_ids, manifest.page_sha256)
                context.segment_ends = list(manifest.segment_ends)
                reused, computed = len(manifest.token_ids), 0
            logits = yield from self._passes.prompt(context, continuation, options, reused)
            computed += len(continuation)
            auto = options.keep and not options.deposit  # cache = "auto" is Generate's
            whole = full_id if reused else ""
            result = yield from self._decode(
                context, logits, options, reused, computed, grafted, whole, auto_deposit=auto
            )
        yield result  # released first, as Generate's

    def _decode(
        self,
        context: KvContext,
        logits: torch.Tensor,
        options: DecodeOptions,
        reused: int,
        computed: int,
        grafted: list[pb.GraftedArtifact],
        whole_artifact: str = "",  # Graft: the artifact restored whole
        auto_deposit: bool = False,  # keep the context if the store has room (cache = "auto")
    ) -> Generator[TokenEvent, None, ResultEvent]:
        """The tokens as they come; returns the result (the caller yields it once the context
        and its admission slot are released, so a client that saw the end may call again)."""
        receipt = pb.Receipt(
            input_sha256=input_sha256(context.token_ids, context.segment_ends),
            prompt_logits_sha256=logits_sha256(logits),
            model_fingerprint=self.fingerprint,
            profile=self.profile,
        )
        generated_digest = hashlib.sha256()
        prompt_logits = logits_bytes(logits) if options.return_logits else b""
        generated_logits: list[bytes] = []
        stream = TokenStream(options, frozenset(self.adapter.eos_token_ids), self._text)
        # the tokens chosen and computed in the batcher's steps (on the compute thread)
        item = self.batcher.decode(context, stream, logits, context.wanted)
        item.future.add_done_callback(stream.ended)
        end = len(context.token_ids)
        try:
            for step in stream.events():
                if step.computed is not None:  # the last token chosen, computed
                    end += 1  # each generated token a segment of its own
                    context.segment_ends.append(end)
                    generated_digest.update(logits_view(step.computed))
                    if options.return_logits:
                        generated_logits.append(logits_bytes(step.computed))
                    computed += 1
                if step.token is not None:
                    receipt.generated_token_ids.append(step.token)
                    yield self._token_event(step.token, step.logits, options)
        finally:
            if not item.future.done():  # closed at a token: its request is leaving
                self.batcher.withdraw(item)
        finish_reason = stream.finish_reason
        receipt.generated_logits_sha256 = generated_digest.digest()
        sampling = sampling_of(options)
        if sampling is not None:
            receipt.sampling.CopyFrom(sampling)
        artifact_id = self._deposits.keep(context, receipt, options, grafted, auto_deposit)
        receipt.reused_tokens, receipt.computed_tokens = reused, computed
        receipt.grafted.extend(grafted)
        receipt.grafted_artifact_id = whole_artifact
        text = StopStrings(options.stop, self._text).cut(
            self._text(list(receipt.generated_token_ids))
        )
        return ResultEvent(
            receipt, text, artifact_id, prompt_logits, tuple(generated_logits), finish_reason
        )

    def _text(self, token_ids: list[int]) -> str:
        return self.adapter.decode(token_ids, skip_special=True)

    def _token_event(self, token: int, logits: torch.Tensor, options: DecodeOptions) -> TokenEvent:
        text = self._token_texts.get(token)
        if text is None:  # a token's own text, decoded once
            text = self._token_texts[token] = self._text([token])
        if not options.logprobs:
            return TokenEvent(token, text)
        logprob, top = token_logprobs(logits, token, options.top_logprobs, self._text)
        return TokenEvent(token, text, logprob, tuple(top))
