"""Conversation contexts: what a daemon keeps by itself, told apart by a label.

A context the daemon keeps without being asked to deposit it (every HTTP chat's with
`chat_cache = "auto"`, the default; every Generate's with `cache = "auto"`; a request's
`keep`) is stored with the label `kvgraft.kind = conversation`. The daemon holds such
contexts within a bound of their own (`conversation_budget_bytes`) and evicts them before
any other unpinned artifact, whatever the policy (kvgraftd.store.eviction); `kvgraft ls`
leaves them out unless asked (kvgraft.cli.store). A deposit carries no such label. The
label is in the manifest, so it travels with the artifact (exports, replication) and a
context kept so and the same context deposited are two artifacts sharing every page.
Pinning one keeps it as any pinned artifact: neither evicted nor counted in the bound.
"""

from __future__ import annotations

from collections.abc import Mapping

KIND_LABEL = "kvgraft.kind"
CONVERSATION = "conversation"


def is_conversation(labels: Mapping[str, str]) -> bool:
    """Whether an artifact with these labels is a conversation context."""
    return labels.get(KIND_LABEL) == CONVERSATION


def conversation_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """`labels` with the conversation context's kind added."""
    return {**labels, KIND_LABEL: CONVERSATION}
