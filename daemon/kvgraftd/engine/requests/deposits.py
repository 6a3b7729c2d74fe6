"""Keeping a finished context: Deposit, Generate with deposit, and cache = "auto".

`Deposits` is the part the Engine (kvgraftd.engine.requests.engine) holds to turn a
context into an artifact and commit it; it is built from what it uses: the store (the
daemon's, or a tenant's view), the trust policy that signs, the engine's fingerprint,
profile and layout, and the tenant whose contexts it keeps ("": the operator's). `keep`
deposits when the request asked to, or, with cache = "auto" (`auto`), every Generate's
context: then a deposit that fails (the store's budget has no room: everything pinned or
being read) is logged and counted in `auto_deposits_skipped`, never an error of the
request. A context kept so (not asked for by `deposit`) is labelled a conversation
context (kvgraft.conversations): the store keeps those within a bound of their own and
evicts them first. It owns the two counters.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kvgraft.artifact import Artifact, page_sizes
from kvgraft.conversations import conversation_labels
from kvgraft.errors import InvalidArgument, KvgraftError
from kvgraft.page_buffers import slot_copies
from kvgraft.tenancy import owned_labels
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.engine.attention.kv_context import KvContext
from kvgraftd.engine.requests.decoding import DecodeOptions
from kvgraftd.store.interface import EngineStore
from kvgraftd.store.page_records import page_records_of
from kvgraftd.store.signing import TrustPolicy
from kvgraftd.store.trust_index import is_trusted

log = logging.getLogger(__name__)

COMMIT_ATTEMPTS = 3


class Deposits:
    def __init__(
        self,
        store: EngineStore,
        trust: TrustPolicy,
        fingerprint: bytes,
        profile: pb.ComputeProfile,
        layout: pb.KvLayout,
        tenant: str = "",
    ) -> None:
        self.store = store
        self.trust = trust
        self.fingerprint = fingerprint
        self.profile = profile
        self.layout = layout
        self.tenant = tenant  # whose contexts it keeps: labelled so (kvgraft.tenancy)
        self.auto_deposits = 0
        self.auto_deposits_skipped = 0

    def keep(
        self,
        context: KvContext,
        receipt: pb.Receipt,
        options: DecodeOptions,
        grafted: list[pb.GraftedArtifact],
        auto: bool,
    ) -> str:
        """The id of the deposited context, or "" where none was asked for or kept."""
        if options.deposit:
            return self._deposit(context, receipt, options.labels, grafted)
        if not auto:
            return ""
        try:
            labels = conversation_labels(options.labels)
            artifact_id = self._deposit(context, receipt, labels, grafted)
        except KvgraftError as exc:  # the request does not fail for the cache
            self.auto_deposits_skipped += 1
            log.warning("the finished context was not kept (cache = auto): %s", exc)
            return ""
        self.auto_deposits += 1
        return artifact_id

    def _deposit(
        self,
        context: KvContext,
        receipt: pb.Receipt,
        labels: Mapping[str, str],
        grafted: list[pb.GraftedArtifact],
    ) -> str:
        """Store the context. The manifest keeps the run-independent part of the receipt,
        so the same context deposited by a fresh or a grafted run has one id. It is as
        trusted as what it grafted: computed here on untrusted pages (a Graft with
        allow_untrusted) it is stored untrusted, never signed."""
        pages = [
            context.page_bytes(page, layer)
            for page in range(context.page_count())
            for layer in range(self.layout.num_layers)
        ]
        artifact = Artifact.build(
            model_fingerprint=self.fingerprint,
            layout=self.layout,
            profile=self.profile,
            token_ids=context.token_ids,
            page_bytes=pages,
            segment_ends=context.segment_ends,
            labels=owned_labels(labels, self.tenant) if self.tenant else labels,
            receipt=receipt,
        )
        if all(is_trusted(pb.Provenance(trust=g.trust)) for g in grafted):
            provenance = self.trust.computed(artifact.id)
        else:
            provenance = pb.Provenance(
                trust=pb.Provenance.TRUST_UNTRUSTED, origin="computed on untrusted pages"
            )
        for attempt in range(1, COMMIT_ATTEMPTS + 1):
            missing = self.store.missing_pages(list(page_sizes(artifact.manifest)))
            # block-aligned copies: the store writes them to disk with direct I/O
            copies = slot_copies({d: artifact.pages[d] for d in missing}) if missing else {}
            try:
                commit = self.store.commit_artifact(
                    artifact.manifest, page_records_of(copies), provenance
                )
                return commit.artifact_id
            except InvalidArgument:
                # a page stored when asked was evicted before the commit: ask again
                if attempt == COMMIT_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")
