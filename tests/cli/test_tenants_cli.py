"""The command line with tenants: `--token-file` names who acts; publish, ls, stat, info, rm.

A store-only daemon with tenants alice and bob; alice puts two artifacts (labelled as
hers) with the client, the operator one of its own, then the real `kvgraft` CLI
publishes one, lists, shows, refuses and withdraws, each as the token given says. A
receipt's grafted artifacts name their owner (receipt_detail_lines: the lines that
generate, graft and `stat --manifest` print).
"""

from __future__ import annotations

import json
import random

from kvgraft import Client
from kvgraft.cli.engine import receipt_detail_lines
from kvgraft.tenancy import SHARED_LABEL, TENANT_LABEL
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.testing.tenants import write_tenants
from tests.cli.test_cli import kvgraft
from tests.support.factory import random_artifact


def test_publish_ls_stat_info_and_refusals_act_as_the_tokens_tenant(start_daemon, tmp_path) -> None:
    config, tokens = write_tenants(tmp_path / "etc", {"alice": {}, "bob": {}})
    daemon = start_daemon(extra_args=["--config", str(config)])
    rng = random.Random(21)
    published_one = random_artifact(rng, labels={TENANT_LABEL: "alice", "topic": "law"})
    private_one = random_artifact(rng, labels={TENANT_LABEL: "alice"})
    with Client(daemon.address, token_file=tokens["alice"]) as alice:
        alice.put_artifact(published_one)
        alice.put_artifact(private_one)
    operators = random_artifact(rng)
    with Client(daemon.address, token_file=tokens["operator"]) as operator:
        operator.put_artifact(operators)

    def cli(tenant: str, *args: str):
        return kvgraft("--token-file", str(tokens[tenant]), *args, server=daemon.address)

    def cli_json(tenant: str, *args: str):
        result = cli(tenant, "--json", *args)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    # Nobody but alice sees her artifacts: to bob her id is an unknown one.
    refused = cli("bob", "--json", "publish", published_one.id[:16])
    assert refused.returncode == 1
    assert json.loads(refused.stdout)["error"]["code"] == "NOT_FOUND"
    assert f"no artifact id starts with {published_one.id[:16]}" in refused.stderr
    assert cli_json("bob", "ls") == {"artifacts": []}

    published = cli("alice", "publish", published_one.id[:16])
    assert published.returncode == 0, published.stderr
    shared_id = published.stdout.split()[1]
    assert published.stdout == (
        f"published {shared_id} (alice's), a new artifact over the pages of "
        f"{published_one.id[:16]}: every tenant may graft it by this id and reuse its pages; "
        "only its owner may delete it\n"
    )
    assert shared_id != published_one.id  # a second artifact over the same pages

    listed = cli_json("bob", "ls")["artifacts"]
    assert [(a["artifact_id"], a["owner"], a["shared"]) for a in listed] == [
        (shared_id, "alice", True)
    ]
    assert listed[0]["labels"] == {TENANT_LABEL: "alice", SHARED_LABEL: "true", "topic": "law"}
    lines = cli("bob", "ls").stdout.splitlines()
    assert lines[0].split()[-3:] == ["state", "owner", "labels"]
    assert lines[1].startswith(shared_id[:16]) and lines[1].endswith("  shared  alice  topic=law")
    alices = cli_json("alice", "ls")["artifacts"]
    assert {a["artifact_id"]: (a["owner"], a["shared"]) for a in alices} == {
        published_one.id: ("alice", False),
        private_one.id: ("alice", False),
        shared_id: ("alice", True),
    }
    stat = cli("bob", "stat", shared_id[:16]).stdout.splitlines()
    assert "owner alice, published: every tenant may graft it" in stat
    assert cli_json("alice", "stat", private_one.id)["owner"] == "alice"

    private = cli("bob", "publish", private_one.id)
    assert private.returncode == 1
    assert private.stderr.startswith("kvgraft: error: NOT_FOUND: ")
    assert f"no artifact id starts with {private_one.id}" in private.stderr
    removed = cli("bob", "rm", shared_id)
    assert removed.returncode == 1
    assert removed.stderr.startswith("kvgraft: error: PERMISSION_DENIED: ")
    assert "only its owner may change or delete it" in removed.stderr

    assert cli_json("bob", "info")["info"]["tenant"] == "bob"
    bobs = cli("bob", "info").stdout.splitlines()
    assert "tenant: bob (the store and engine figures are this tenant's)" in bobs
    operator = cli("operator", "info").stdout.splitlines()
    assert "tenants: alice, bob" in operator
    assert operator[-2].startswith("tenant: operator (")
    header, *rows = cli("operator", "ls").stdout.splitlines()  # it sees every tenant's
    owners = {row[:16]: row[header.index("owner") :].split()[0] for row in rows}
    assert owners == {
        published_one.id[:16]: "alice",
        private_one.id[:16]: "alice",
        shared_id[:16]: "alice",
        operators.id[:16]: "-",
    }
    assert cli_json("operator", "stat", operators.id)["owner"] == ""

    withdrawn = cli("alice", "--json", "publish", published_one.id[:16], "--withdraw")
    assert withdrawn.returncode == 0, withdrawn.stderr
    assert json.loads(withdrawn.stdout)["artifact_id"] == shared_id
    assert cli_json("bob", "ls") == {"artifacts": []}
    assert cli("alice", "publish", shared_id, "--withdraw").returncode == 1  # gone


def test_a_receipt_names_the_owner_of_what_it_grafted() -> None:
    receipt = pb.Receipt(
        grafted=[
            pb.GraftedArtifact(artifact_id="ab" * 32, tokens=40, owner="alice"),
            pb.GraftedArtifact(artifact_id="cd" * 32, tokens=8, vouched_by=b"\x01" * 32),
        ]
    )
    lines = receipt_detail_lines(receipt)
    assert lines[-2:] == [
        f"  grafted {'ab' * 8} (alice's): 40 tokens, untrusted",
        f"  grafted {'cd' * 8}: 8 tokens, vouched for by {'01' * 8}",
    ]
