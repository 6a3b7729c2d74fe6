"""The store taken away under a running daemon: its directory deleted, its disk filled.

* The data directory deleted under a running daemon (the probe's `rm -rf`): Info and
  Stats answered INTERNAL ("internal error (FileNotFoundError)") with a traceback in
  the log, so did PutArtifact, a scrape of /metrics answered 500 with a traceback on
  stderr, and the shutdown logged one more. Now Info, Stats and PutArtifact answer
  FAILED_PRECONDITION saying what is wrong and what to do, /metrics serves all that
  does not come from the store with kvgraft_store_reachable 0, and the shutdown says
  in one line that the last uses could not be written; the segments' clean-up after the
  refused write says in one line that it could not cut back a file that is gone.
* A shutdown on a full disk (issue 31 made the last-use flush's failure one warning):
  exit 0, that line, no traceback; /metrics answers on the full disk.

* In-process, the freed pages' space given back after the directory went: one
  WARNING line (it was a traceback).

Store-only daemons (no model): nothing here needs one.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgraft import Client
from kvgraft.errors import FailedPrecondition
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.page_records import page_records_of
from kvgraftd.testing.daemon_process import DaemonProcess
from tests.support.factory import random_artifact
from tests.support.small_disks import fill

METRICS = ["--metrics-listen", "127.0.0.1:0"]
LAST_USES_LOST = "could not record the artifacts' last uses"
_LOGGED_AT = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")


def _records(lines: list[str]) -> list[str]:
    """The daemon's log as records: a line with a time, and the lines (a traceback) after it."""
    records: list[str] = []
    for line in lines:
        if _LOGGED_AT.match(line) or not records:
            records.append(line)
        else:
            records[-1] += "\n" + line
    return records


def _scrape(daemon: DaemonProcess) -> dict[tuple[str, tuple], float]:
    """Every sample of a scrape: (name, sorted label items) -> value."""
    with urllib.request.urlopen(daemon.metrics_url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _unreachable(path: Path) -> str:
    return (
        f"the store's files cannot be reached (No such file or directory: {path}): was the "
        "data directory deleted, unmounted or made unreadable while kvgraftd ran? Restore it, "
        "then restart kvgraftd (on an empty data directory it starts an empty store)"
    )


def test_a_data_directory_deleted_under_the_daemon(start_daemon, tmp_path: Path, rng) -> None:
    data = tmp_path / "data"
    daemon = start_daemon(data_dir=data, extra_args=METRICS)
    stored = random_artifact(rng)
    with Client(daemon.address, timeout_s=30) as client:
        client.put_artifact(stored)
        client.get_artifact(stored.id)  # a use, to be written at shutdown
        assert _scrape(daemon)[("kvgraft_store_reachable", ())] == 1
        shutil.rmtree(data)

        for call in (client.info, client.stats):
            with pytest.raises(FailedPrecondition) as caught:
                call()
            assert str(caught.value) == _unreachable(data.resolve() / "store" / "segments")
        samples = _scrape(daemon)  # was: 500, a traceback on stderr
        assert samples[("kvgraft_store_reachable", ())] == 0
        assert ("kvgraft_store_artifacts", ()) not in samples  # left out, not made up
        for method in ("Info", "Stats"):
            labels = (("code", "FAILED_PRECONDITION"), ("method", method))
            assert samples[("kvgraft_rpc_requests_total", labels)] == 1
        with pytest.raises(FailedPrecondition) as caught:
            client.put_artifact(random_artifact(rng))
        assert str(caught.value) == _unreachable(data.resolve() / "store")  # was: INTERNAL

    assert daemon.terminate() == 0
    records = _records(daemon.log_lines)
    stopping = next(i for i, record in enumerate(records) if "received SIGTERM" in record)
    serving, shutdown = records[:stopping], records[stopping:]
    assert not [record for record in serving if "internal error" in record]
    assert len([record for record in serving if "store's figures are left out" in record]) == 1
    assert not [record for record in serving if "Traceback" in record]
    # the segments' clean-up after the refused write cuts a file that is gone: one line
    [cut] = [record for record in serving if "could not cut segment 1 back" in record]
    assert " WARNING " in cut and "No such file or directory" in cut and "\n" not in cut
    assert not [record for record in shutdown if "Traceback" in record]
    assert len([record for record in shutdown if LAST_USES_LOST in record]) == 1


def test_a_shutdown_on_a_full_disk_says_one_line(small_disk: Path, rng) -> None:
    daemon = DaemonProcess.start(small_disk / "data", ["--min-free-bytes", "0", *METRICS])
    try:
        stored = random_artifact(rng)
        with Client(daemon.address, timeout_s=30) as client:
            client.put_artifact(stored)
            client.get_artifact(stored.id)  # a use, to be written at shutdown
            fill(small_disk)
            assert client.stats().disk_free_bytes == 0
        samples = _scrape(daemon)
        assert samples[("kvgraft_store_reachable", ())] == 1
        assert samples[("kvgraft_store_disk_free_bytes", ())] == 0
        assert daemon.terminate() == 0
        log = daemon.log()
        assert "Traceback" not in log  # was: the last-use flush's (before issue 31)
        [said] = [line for line in daemon.log_lines if LAST_USES_LOST in line]
        assert " WARNING " in said and "has 0.0 MiB free" in said
    finally:
        daemon.stop()


def test_freed_space_of_a_deleted_store_is_one_warning(tmp_path: Path, rng, caplog) -> None:
    """In-process, the keeper's give-back (kvgraftd.store.segments) after the data directory
    went: was a traceback; now one WARNING line, and the store goes on."""
    store = Store(tmp_path / "store", initial_map_bytes=1 << 22, min_free_bytes=0)
    kept, freed = random_artifact(rng), random_artifact(rng)
    for artifact in (kept, freed):
        store.commit_artifact(artifact.manifest, page_records_of(artifact.pages))
    evicted = store.remove([bytes.fromhex(freed.id)], pb.ChangeRecord.REASON_EVICTED)
    assert evicted[0] == 1  # no byte budget: its holes wait for the keeper's give-back
    shutil.rmtree(tmp_path / "store")
    with caplog.at_level(logging.WARNING, logger="kvgraftd.store.segments"):
        store.give_back()
    [said] = [r for r in caplog.records if "could not give freed page space back" in r.message]
    assert said.levelno == logging.WARNING and said.exc_info is None
    assert "No such file or directory" in said.getMessage()
    assert store.usage(kept.id) is not None
    with contextlib.suppress(FailedPrecondition):  # the last uses cannot be written: said
        store.close()
