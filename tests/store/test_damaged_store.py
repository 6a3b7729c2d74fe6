"""A store damaged under a running daemon: the daemon goes on, and acts on what a read found.

One real daemon with the tiny model (attention reads stored pages one by one, where the
store used to hand out views of its segments' mappings):

* a segment file truncated under it: a Graft reading a page past the new end fails with
  DATA_LOSS (it used to die of SIGBUS), the daemon answers on, and the artifact is
  quarantined, so GetArtifact refuses it and a Generate over its tokens computes them;
* a byte flipped in a stored page: the first Generate over it fails with DATA_LOSS, the
  read quarantines the artifact, so the same Generate then computes afresh (a fresh run's
  receipt), Lookup offers nothing, the metrics count it and `kvgraft ls` says so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgraft import Client
from kvgraft.errors import DataLoss
from kvgraftd.testing.daemon_process import DaemonProcess, wait_model_ready
from tests.support.on_disk import flip_stored_page, segment_files

TINY = ["--model", "tiny:0", "--page-tokens", "16", "--block-tokens", "16"]
DAMAGED = list(range(100, 164))  # four whole pages
CORRUPT = list(range(200, 264))


def _receipt(result) -> tuple:
    r = result.receipt
    return (r.input_sha256, r.prompt_logits_sha256, r.generated_logits_sha256,
            r.generated_token_ids)  # fmt: skip


def _metric(daemon: DaemonProcess, name: str) -> float:
    with urllib.request.urlopen(daemon.metrics_url, timeout=10) as response:
        text = response.read().decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    return next(s.value for s in samples if s.name == name)


@pytest.fixture
def tiny(start_daemon) -> DaemonProcess:
    daemon = start_daemon(extra_args=[*TINY, "--metrics-listen", "127.0.0.1:0"])
    wait_model_ready(daemon.address)
    return daemon


def test_a_damaged_store_fails_one_artifact_and_quarantines_it(tiny: DaemonProcess) -> None:
    store = tiny.data_dir / "store"
    with Client(tiny.address) as client:
        kept = client.deposit(token_ids=CORRUPT)
        [segment] = segment_files(store)
        intact_end = segment.stat().st_size  # the second deposit's pages lie past it
        cut = client.deposit(token_ids=DAMAGED)
        stored = client.get_artifact(kept.artifact_id)  # read whole, before any damage
        first_page = bytes(stored.pages[stored.manifest.page_sha256[0]])
        prompt = [*CORRUPT, 7, 8]
        fresh = client.generate(token_ids=prompt, max_new_tokens=3, no_cache=True)

        # A segment cut short: the read past its end is DATA_LOSS for that artifact only.
        os.truncate(segment, intact_end + 4096)  # the first page of the second deposit stays
        with pytest.raises(DataLoss, match="quarantined"):  # cut short, or dropped meanwhile
            client.graft(cut.artifact_id, token_ids=[5, 6], max_new_tokens=2)
        assert tiny.proc.poll() is None and client.info().version  # still answering
        with pytest.raises(DataLoss, match="quarantined"):
            client.get_artifact(cut.artifact_id)
        again = client.generate(token_ids=[*DAMAGED, 5, 6], max_new_tokens=2)
        assert again.reused_tokens == 0  # computed, not grafted from the damaged pages
        cut_pages = _metric(tiny, "kvgraft_store_corrupt_reads_total")  # those batches met
        assert 1 <= cut_pages <= 7 and _metric(tiny, "kvgraft_store_read_quarantines_total") == 1

        # A flipped byte: found by the first Generate over it, which fails; acted on.
        assert flip_stored_page(store, first_page) == 1
        assert client.lookup(token_ids=prompt).matched_tokens == len(CORRUPT)
        with pytest.raises(DataLoss, match="corrupt on disk"):
            client.generate(token_ids=prompt, max_new_tokens=3)
        retried = client.generate(token_ids=prompt, max_new_tokens=3)
        assert _receipt(retried) == _receipt(fresh) and retried.reused_tokens == 0
        assert client.lookup(token_ids=prompt).matched_tokens == 0
        assert client.info().cache.quarantined_artifacts == 2

    assert _metric(tiny, "kvgraft_store_corrupt_reads_total") == cut_pages + 1
    assert _metric(tiny, "kvgraft_store_read_quarantines_total") == 2
    listed = subprocess.run(
        [sys.executable, "-m", "kvgraft", "--server", tiny.address, "ls"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0
    rows = [line for line in listed.stdout.splitlines() if "quarantined" in line]
    assert sorted(row.split()[0] for row in rows) == sorted(
        [kept.artifact_id[:16], cut.artifact_id[:16]]
    )
    assert "Traceback" not in tiny.log()
