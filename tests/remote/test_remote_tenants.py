"""The S3 tier keeps each artifact's tenant: a fleet with the same tenants serves each its own.

Daemon A (tenants alice and bob, write-through to the bucket) stores one artifact of
each; daemon B, empty, on the same bucket and configured with the same tenant tokens,
pulls the bucket (the operator's RemoteSync; a tenant may not call it) and then serves
alice hers, byte for byte, and bob his alone.
"""

from __future__ import annotations

import random

import pytest

from kvgraft import Client
from kvgraft.errors import NotFound, PermissionDenied
from kvgraft.tenancy import TENANT_LABEL
from kvgraftd.testing.s3_server import s3_env
from kvgraftd.testing.tenants import write_tenants
from tests.remote.test_remote import prefix_of, remote_args
from tests.support.factory import random_artifact
from tests.support.store_audit import assert_served_whole


def test_the_bucket_keeps_each_artifacts_tenant(s3, start_daemon, tmp_path, request) -> None:
    config, tokens = write_tenants(tmp_path / "etc", {"alice": {}, "bob": {}})
    args = ["--config", str(config), *remote_args(s3, prefix_of(request))]
    a = start_daemon(extra_args=args, env=s3_env())
    rng = random.Random(11)
    hers = random_artifact(rng, labels={TENANT_LABEL: "alice"})
    his = random_artifact(rng, labels={TENANT_LABEL: "bob"})
    with Client(a.address, token_file=tokens["alice"]) as alice:
        alice.put_artifact(hers)
    with Client(a.address, token_file=tokens["bob"]) as bob:
        bob.put_artifact(his)
        with pytest.raises(PermissionDenied):
            bob.remote_sync()
    b = start_daemon(extra_args=args, env=s3_env())
    with Client(b.address, token_file=tokens["operator"]) as operator:
        assert operator.remote_sync(push=False).pulled_artifacts == 2
    with Client(b.address, token_file=tokens["alice"]) as alice:
        assert [i.artifact_id for i in alice.list_artifacts()] == [hers.id]
        assert_served_whole(alice.get_artifact(hers.id), hers)
    with Client(b.address, token_file=tokens["bob"]) as bob:
        assert [i.artifact_id for i in bob.list_artifacts()] == [his.id]
        with pytest.raises(NotFound):
            bob.get_artifact(hers.id)
