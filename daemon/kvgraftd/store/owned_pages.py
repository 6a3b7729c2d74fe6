"""Which pages each tenant's artifacts reference: the `owned_pages` sub-database.

A page is stored once whoever stores it (its SHA-256 names it), but a tenant is
told only about the pages its own artifacts reference: MissingPages and
PutArtifact's "pages you need not send" answer from here, so that no answer
says whether another tenant holds a page (kvgraft.tenancy). Key: 16 bytes naming
the tenant (a hash of its name), then the page's SHA-256; value: u64, the
tenant's artifacts that reference it. Counted in and out inside the transaction
that commits or removes the artifact (kvgraftd.store.artifact_store,
kvgraftd.store.lifecycle). The operator's artifacts are not counted: the
operator is told about every stored page.
"""

from __future__ import annotations

import hashlib
import struct

from kvgraft.tenancy import owner_of
from kvgraft.v1 import kvgraft_pb2 as pb

_U64 = struct.Struct("<Q")


def owned_key(tenant: str, digest: bytes) -> bytes:
    """A page's key in `owned_pages`: 16 bytes naming the tenant, then its SHA-256."""
    return hashlib.sha256(b"kvgraft-tenant\0" + tenant.encode()).digest()[:16] + digest


def count_owned(txn, db, manifest: pb.Manifest, delta: int) -> None:
    """Count an artifact's distinct pages in (+1) or out (-1) of its owner's (the operator's
    artifacts are not counted: the operator is told about every stored page)."""
    tenant = owner_of(manifest.labels)
    if not tenant:
        return
    for digest in dict.fromkeys(manifest.page_sha256):
        key = owned_key(tenant, digest)
        found = txn.get(key, db=db)
        count = (_U64.unpack(found)[0] if found is not None else 0) + delta
        if count > 0:
            txn.put(key, _U64.pack(count), db=db)
        elif found is not None:
            txn.delete(key, db=db)
