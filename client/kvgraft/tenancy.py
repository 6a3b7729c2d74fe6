"""Who owns an artifact, and who else may see it: tenants, as a manifest's labels say.

A daemon configured with tenants stores each tenant's artifacts with the label
`kvgraft.tenant = NAME` (its owner), so two tenants' artifacts of the same tokens are
two artifacts with two ids, and an artifact's owner travels with it wherever its
manifest goes (exports, replication, the remote tier). An artifact its owner published
also carries `kvgraft.shared = true`: every tenant may read and graft it, only its
owner (or the operator) may change or delete it. An artifact without the label is the
operator's (a daemon without tenants stores only those).

Each artifact's pages are indexed for prefix reuse under its *namespace*: its owner's,
or the shared one. A prompt is matched in the caller's namespace and the shared one,
never in another tenant's (kvgraftd.store.chains salts the chain root with it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

TENANT_LABEL = "kvgraft.tenant"
SHARED_LABEL = "kvgraft.shared"
SHARED_NAMESPACE = "shared"  # the namespace of published artifacts' pages
OPERATOR = ""  # the operator: the daemon's own token, artifacts without a tenant label
TENANT_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")


def check_tenant_name(name: str) -> str:
    """`name` if it can name a tenant (lowercase letters, digits, '-' and '_', at most 63
    characters, not "shared"); ValueError saying what is allowed otherwise."""
    if not TENANT_NAME.fullmatch(name) or name == SHARED_NAMESPACE:
        raise ValueError(
            f"{name!r} cannot name a tenant: use 1-63 lowercase letters, digits, '-' or '_', "
            f"starting with a letter or digit, other than {SHARED_NAMESPACE!r}"
        )
    return name


def owner_of(labels: Mapping[str, str]) -> str:
    """The tenant owning an artifact with these labels ("" : the operator)."""
    return labels.get(TENANT_LABEL, OPERATOR)


def is_shared(labels: Mapping[str, str]) -> bool:
    return labels.get(SHARED_LABEL) == "true"


def namespace_of(labels: Mapping[str, str]) -> str:
    """Where an artifact's pages are indexed for reuse: "shared" once published, else its
    owner's namespace ("" for the operator's: the chain keys of a daemon without tenants)."""
    if is_shared(labels):
        return SHARED_NAMESPACE
    owner = owner_of(labels)
    return f"tenant:{owner}" if owner else OPERATOR


def owner_in(namespace: str) -> str | None:
    """The owner every artifact of a namespace has ("": the operator's), or None for the
    shared one (each published artifact keeps its own owner)."""
    if namespace == SHARED_NAMESPACE:
        return None
    return namespace.removeprefix("tenant:")


def tenant_namespace(tenant: str) -> str:
    """A caller's own namespace (the operator's is "")."""
    return f"tenant:{tenant}" if tenant else OPERATOR


def visible_to(tenant: str, labels: Mapping[str, str]) -> bool:
    """Whether `tenant` ("": the operator, who sees everything) may read the artifact."""
    return tenant == OPERATOR or owner_of(labels) == tenant or is_shared(labels)


def writable_by(tenant: str, labels: Mapping[str, str]) -> bool:
    """Whether `tenant` ("": the operator) may delete, pin or publish the artifact."""
    return tenant == OPERATOR or owner_of(labels) == tenant


def content_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """`labels` without who owns the artifact and whether it is published: what its writer
    chose (the library recognises its entries by these)."""
    return {k: v for k, v in labels.items() if k not in (TENANT_LABEL, SHARED_LABEL)}


def owned_labels(labels: Mapping[str, str], tenant: str, shared: bool = False) -> dict[str, str]:
    """`labels` as `tenant` stores them: its name as the owner, published or not."""
    out = content_labels(labels)
    if tenant:
        out[TENANT_LABEL] = tenant
    if shared:
        out[SHARED_LABEL] = "true"
    return out
