"""`kvgraft publish`, and what the other commands say of tenants.

    kvgraft [--json] publish ID [--withdraw]

With tenants configured on the daemon, the token (`--token-file`, KVGRAFT_TOKEN_FILE)
names who the commands act as: a tenant sees, reuses and changes its own artifacts
and grafts the published ones; the daemon's own token is the operator's, who sees
every tenant's. publish makes one of the caller's artifacts readable and graftable by
every tenant: a second artifact over the same pages, with a new id (labelled
kvgraft.shared=true, only its owner may delete it), which it prints (--json: the
published artifact's fields, and `published_from`, the id given in full); --withdraw
deletes that published artifact again (ID: the published one, or the one it was
published from).

Who owns an artifact is its labels' (kvgraft.tenancy): `ls` and `stat` show the owner
("-", or "the operator", for the operator's) and mark published ones shared, and their
JSON documents add "owner" ("" : the operator) and "shared" to the artifact's fields;
`info` names the caller's tenant, and to the operator the configured tenants; a
receipt's grafted artifacts name their owner ("alice's").
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from kvgraft.cli.render import emit, message_to_json
from kvgraft.client.client import Client
from kvgraft.tenancy import is_shared, owner_of
from kvgraft.v1 import kvgraft_pb2 as pb


def cmd_publish(client: Client, args: argparse.Namespace) -> None:
    if args.withdraw:
        info = client.publish(args.id, withdraw=True)
        text = f"withdrew {info.artifact_id}: other tenants can no longer graft it"
        emit(args.json, artifact_document(info), text)
        return
    source = client.stat(args.id).info.artifact_id  # the full id, to say what became what
    info = client.publish(source)
    text = (
        f"published {info.artifact_id} ({owner_name(info.labels)}'s), a new artifact over "
        f"the pages of {source[:16]}: every tenant may graft it by this id and reuse its "
        "pages; only its owner may delete it"
    )
    emit(args.json, {**artifact_document(info), "published_from": source}, text)


def artifact_document(info: pb.ArtifactInfo) -> dict:
    """An artifact as --json shows it: its ArtifactInfo's fields, its owner ("" : the
    operator) and whether it is published."""
    return {
        **message_to_json(info),
        "owner": owner_of(info.labels),
        "shared": is_shared(info.labels),
    }


def owner_name(labels: Mapping[str, str]) -> str:
    """Who owns an artifact with these labels, in words: a tenant's name, or "the operator"."""
    return owner_of(labels) or "the operator"


def has_owner(labels: Mapping[str, str]) -> bool:
    """Whether these labels say anything of tenants (an owner, or published): on a daemon
    without tenants none do, and the commands show no owner."""
    return bool(owner_of(labels)) or is_shared(labels)


def ownership_line(labels: Mapping[str, str]) -> list[str]:
    """`kvgraft stat`'s line on who owns the artifact (none for a daemon without tenants)."""
    if not has_owner(labels):
        return []
    shared = ", published: every tenant may graft it" if is_shared(labels) else ""
    return [f"owner {owner_name(labels)}{shared}"]


def grafted_owner(grafted: pb.GraftedArtifact) -> str:
    """What a receipt's line on a grafted artifact says of its owner: " (alice's)", or
    nothing for the operator's."""
    return f" ({grafted.owner}'s)" if grafted.owner else ""


def tenant_lines(info: pb.InfoResponse) -> list[str]:
    """`kvgraft info`'s lines on who the caller is (none on a daemon without tenants)."""
    if info.tenant:
        return [f"tenant: {info.tenant} (the store and engine figures are this tenant's)"]
    if info.tenants:
        return [
            "tenant: operator (the daemon's own token: sees and may change every tenant's "
            "artifacts)",
            f"tenants: {', '.join(info.tenants)}",
        ]
    return []


def add_publish_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", help="artifact id or unique prefix (8+ hex characters)")
    parser.add_argument(
        "--withdraw",
        action="store_true",
        help="delete the published artifact (ID: it, or the one it was published from)",
    )
