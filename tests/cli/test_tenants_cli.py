"""The command line with tenants: `--token-file` names who acts; publish, ls, info, rm.

A store-only daemon with tenants alice and bob; alice puts an artifact (labelled as
hers) with the client, then the real `kvgraft` CLI publishes, lists, refuses and
withdraws, each as the token given says.
"""

from __future__ import annotations

import json
import random

from kvgraft import Client
from kvgraft.tenancy import SHARED_LABEL, TENANT_LABEL
from tests.cli.test_cli import kvgraft
from tests.support.factory import random_artifact
from tests.support.tenant_config import write_tenants


def test_publish_ls_info_and_refusals_act_as_the_tokens_tenant(start_daemon, tmp_path) -> None:
    config, tokens = write_tenants(tmp_path / "etc", {"alice": {}, "bob": {}})
    daemon = start_daemon(extra_args=["--config", str(config)])
    artifact = random_artifact(random.Random(21), labels={TENANT_LABEL: "alice"})
    with Client(daemon.address, token_file=tokens["alice"]) as alice:
        alice.put_artifact(artifact)

    def cli(tenant: str, *args: str):
        return kvgraft("--token-file", str(tokens[tenant]), *args, server=daemon.address)

    refused = cli("bob", "publish", artifact.id[:16])
    assert refused.returncode == 1
    assert f"no artifact id starts with {artifact.id[:16]}" in refused.stderr
    published = cli("alice", "--json", "publish", artifact.id[:16])
    assert published.returncode == 0, published.stderr
    shared = json.loads(published.stdout)
    assert shared["labels"] == {TENANT_LABEL: "alice", SHARED_LABEL: "true"}
    listed = json.loads(cli("bob", "--json", "ls").stdout)["artifacts"]
    assert [a["artifact_id"] for a in listed] == [shared["artifact_id"]]
    assert "shared by alice" in cli("bob", "ls").stdout
    removed = cli("bob", "rm", shared["artifact_id"])
    assert removed.returncode == 1 and "only its owner may change or delete it" in removed.stderr
    info = json.loads(cli("bob", "--json", "info").stdout)["info"]
    assert info["tenant"] == "bob"
    assert "tenants: alice, bob" in cli("operator", "info").stdout
    withdrawn = cli("alice", "publish", artifact.id[:16], "--withdraw")
    assert withdrawn.returncode == 0 and "withdrew" in withdrawn.stdout
    assert json.loads(cli("bob", "--json", "ls").stdout)["artifacts"] == []
