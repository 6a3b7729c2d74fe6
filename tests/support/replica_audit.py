"""Compare a replica with its source through the public API, for the replication tests.

`divergent_artifacts(source, replica)` lists every artifact id that is on one
side only or whose manifest or page bytes differ (each page also checked
against its SHA-256 on the way): the count the replication tests require to
be 0. `export_digests` does the same through exported safetensors bundles,
byte for byte. `wait_until` polls a condition with a generous bound (a hang
guard, not a timing assertion).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path

from kvgraft import Client
from kvgraft.artifact import canonical_bytes, page_sizes


def ids(client: Client) -> set[str]:
    return {info.artifact_id for info in client.list_artifacts()}


def divergent_artifacts(source: Client, replica: Client) -> list[str]:
    """Ids on one side only, or served with other bytes by the replica."""
    on_source, on_replica = ids(source), ids(replica)
    divergent = sorted(on_source ^ on_replica)
    for artifact_id in sorted(on_source & on_replica):
        a = source.get_artifact(artifact_id, check_sha256=True)
        b = replica.get_artifact(artifact_id, check_sha256=True)
        same = canonical_bytes(a.manifest) == canonical_bytes(b.manifest) and all(
            bytes(a.pages[d]) == bytes(b.pages[d]) for d in page_sizes(a.manifest)
        )
        if not same:
            divergent.append(artifact_id)
    return divergent


def export_digests(client: Client, artifact_ids: set[str], directory: Path) -> dict[str, str]:
    """SHA-256 of each artifact's exported bundle file."""
    directory.mkdir(parents=True, exist_ok=True)
    digests = {}
    for artifact_id in sorted(artifact_ids):
        path = directory / f"{artifact_id}.safetensors"
        client.export_bundle(artifact_id, path)
        digests[artifact_id] = hashlib.sha256(path.read_bytes()).hexdigest()
        path.unlink()
    return digests


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never reached: {what}"
        time.sleep(0.02)
