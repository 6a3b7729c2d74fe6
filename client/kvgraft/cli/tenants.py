"""`kvgraft publish`, and what `kvgraft info` says of tenants.

    kvgraft [--json] publish ID [--withdraw]

With tenants configured on the daemon, the token (`--token-file`, KVGRAFT_TOKEN_FILE)
names who the commands act as: a tenant sees, reuses and changes its own artifacts
and grafts the published ones; the daemon's own token is the operator's, who sees
every tenant's. publish makes one of the caller's artifacts readable and graftable by
every tenant (a second artifact over the same pages, labelled kvgraft.shared=true,
that only its owner may delete); --withdraw deletes that published artifact again (ID:
the published one, or the one it was published from).
"""

from __future__ import annotations

import argparse

from kvgraft.cli.render import emit, message_to_json
from kvgraft.client.client import Client
from kvgraft.tenancy import owner_of
from kvgraft.v1 import kvgraft_pb2 as pb


def cmd_publish(client: Client, args: argparse.Namespace) -> None:
    info = client.publish(args.id, withdraw=args.withdraw)
    owner = owner_of(info.labels) or "the operator"
    if args.withdraw:
        text = f"withdrew {info.artifact_id}: other tenants can no longer graft it"
    else:
        text = (
            f"published {info.artifact_id} ({owner}'s): every tenant may graft it and reuse "
            "its pages; only its owner may delete it"
        )
    emit(args.json, message_to_json(info), text)


def tenant_lines(info: pb.InfoResponse) -> list[str]:
    """`kvgraft info`'s line on who the caller is (none on a daemon without tenants)."""
    if info.tenant:
        return [f"tenant: {info.tenant} (the store and engine figures are this tenant's)"]
    if info.tenants:
        return [f"tenants: {', '.join(info.tenants)} (this token is the operator's: sees all)"]
    return []


def add_publish_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", help="artifact id or unique prefix (8+ hex characters)")
    parser.add_argument(
        "--withdraw",
        action="store_true",
        help="delete the published artifact (ID: it, or the one it was published from)",
    )
