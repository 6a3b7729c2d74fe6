"""Publishing an artifact to the shared namespace, and withdrawing it (the Publish RPC).

A published artifact is a second artifact over the same stored pages: the manifest
of the one published, its labels saying `kvgraft.shared = true` beside its owner's
`kvgraft.tenant` (kvgraft.tenancy). Every tenant may then read and graft it, and a
prompt of any tenant reuses its pages (they are indexed under the shared namespace);
only its owner, or the operator, may delete or withdraw it. Its id is the SHA-256 of
that manifest, so publishing twice is one artifact. It is as trusted as the artifact
it was published from: this daemon signs it when that one is trusted (the bytes are
the same pages), else it is stored untrusted. It counts in its owner's budget.

`store` is the caller's: a tenant's kvgraftd.store.tenant_view (which refuses
another tenant's artifact as it refuses an unknown id) or, for the operator, the
store itself.
"""

from __future__ import annotations

from kvgraft.artifact import artifact_id
from kvgraft.conversations import KIND_LABEL
from kvgraft.errors import FailedPrecondition, NotFound, PermissionDenied
from kvgraft.tenancy import is_shared, owned_labels, owner_of, writable_by
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store.signing import TrustPolicy
from kvgraftd.store.trust_index import is_trusted


def shared_manifest(manifest: pb.Manifest) -> pb.Manifest:
    """`manifest` as published: its owner's label kept, the shared label added, and no
    conversation kind (kvgraft.conversations): what is shared is kept as any artifact,
    not evicted first nor hidden from listings."""
    copy = pb.Manifest.FromString(manifest.SerializeToString())
    copy.labels.clear()
    labels = owned_labels(manifest.labels, owner_of(manifest.labels), shared=True)
    copy.labels.update({k: v for k, v in labels.items() if k != KIND_LABEL})
    return copy


def _writable(store, tenant: str, id_or_prefix: str) -> tuple[str, pb.Manifest]:
    full = store.resolve(id_or_prefix)
    manifest = store.get_record(full).manifest()
    if not writable_by(tenant, manifest.labels):
        owner = owner_of(manifest.labels) or "the operator"
        raise PermissionDenied(
            f"artifact {full[:16]} is shared by {owner}: only its owner may publish or withdraw it"
        )
    return full, manifest


def publish(store, tenant: str, trust: TrustPolicy, id_or_prefix: str) -> str:
    """Publish the caller's artifact; the published artifact's id."""
    full, manifest = _writable(store, tenant, id_or_prefix)
    if is_shared(manifest.labels):
        raise FailedPrecondition(
            f"artifact {full[:16]} is the published one already: every tenant may graft it"
        )
    published = shared_manifest(manifest)
    provenance = store.provenance(full)
    shared_id = artifact_id(published)
    if is_trusted(provenance):
        provenance = trust.computed(shared_id, provenance.trust)
        provenance.origin = "published"  # not the private id it came from
    else:
        provenance = pb.Provenance(trust=pb.Provenance.TRUST_UNTRUSTED, origin="published")
    return store.commit_artifact(published, {}, provenance).artifact_id


def withdraw(store, tenant: str, id_or_prefix: str) -> str:
    """Delete the published artifact `id_or_prefix` names (the published one, or the one it
    was published from); its id."""
    full, manifest = _writable(store, tenant, id_or_prefix)
    target = full if is_shared(manifest.labels) else artifact_id(shared_manifest(manifest))
    try:
        store.resolve(target)
    except NotFound:
        raise NotFound(
            f"artifact {full[:16]} is not published: nothing to withdraw (kvgraft publish "
            "publishes it)"
        ) from None
    return target
