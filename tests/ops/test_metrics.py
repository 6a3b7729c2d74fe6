"""Prometheus metrics and the structured artifact log lines, after real traffic.

A scrape of --metrics-listen before and after known calls shows exactly
those calls (by method and code), the exact bytes of the messages that
crossed the wire, the store and tier figures, and — with a (tiny) model —
the receipts' computations, grafts and reused vs computed tokens. Every
artifact written or deleted leaves one logfmt line.
"""

from __future__ import annotations

import os
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgraft import Client
from kvgraft.artifact import page_sizes
from kvgraft.errors import NotFound
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.testing.daemon_process import DaemonProcess, wait_model_ready
from tests.support.factory import random_artifact

SERVICE = "kvgraft.v1.Kvgraft"


def _scrape(daemon: DaemonProcess) -> dict[tuple[str, tuple], float]:
    """Every sample: (name, sorted label items) -> value."""
    with urllib.request.urlopen(daemon.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _get(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_scrape_after_traffic_shows_the_counters_moving(start_daemon, rng) -> None:
    daemon = start_daemon(extra_args=["--metrics-listen", "127.0.0.1:0"])
    assert daemon.metrics_url.startswith("http://127.0.0.1:")
    before = _scrape(daemon)
    assert _get(before, "kvgraft_store_artifacts") == 0
    assert _get(before, "kvgraft_rpc_requests_total", method="PutArtifact", code="OK") == 0
    assert _get(before, "kvgraft_rpc_limit") == 64
    assert _get(before, "process_resident_memory_bytes") > 0

    artifact = random_artifact(rng, num_layers=2, kv_heads=2, head_dim=32, tokens=100)
    sizes = page_sizes(artifact.manifest)
    missing = pb.MissingPagesRequest(sha256=list(sizes)).SerializeToString()
    with Client(daemon.address) as client:
        client.put_artifact(artifact)
        with pytest.raises(NotFound):
            client.stat("ab" * 32)
        with grpc.insecure_channel(daemon.address) as channel:
            ask = channel.unary_unary(f"/{SERVICE}/MissingPages", request_serializer=None)
            assert ask(missing, timeout=10) == b""  # nothing missing: the empty message
            get = channel.unary_stream(
                f"/{SERVICE}/GetArtifact",
                request_serializer=pb.GetArtifactRequest.SerializeToString,
                response_deserializer=None,
            )
            got_bytes = sum(map(len, get(pb.GetArtifactRequest(artifact_id=artifact.id))))
        after = _scrape(daemon)
        client.delete(artifact.id)
        deleted = _scrape(daemon)

    def calls(samples, method: str, code: str = "OK") -> float:
        return _get(samples, "kvgraft_rpc_requests_total", method=method, code=code)

    assert calls(after, "PutArtifact") == 1
    assert calls(after, "MissingPages") == 2  # the client's, then ours
    assert calls(after, "Stat", "NOT_FOUND") == 1
    assert calls(after, "GetArtifact") == 1
    assert calls(deleted, "Delete") == 1
    received = "kvgraft_rpc_received_bytes_total"
    assert _get(after, received, method="MissingPages") == 2 * len(missing)
    page_bytes = sum(sizes.values())
    assert page_bytes < _get(after, received, method="PutArtifact") < page_bytes + 64 * 1024
    assert _get(after, "kvgraft_rpc_sent_bytes_total", method="GetArtifact") == got_bytes
    assert _get(after, "kvgraft_rpc_in_progress") == 0

    assert _get(after, "kvgraft_store_artifacts") == 1
    assert _get(after, "kvgraft_store_pages") == len(sizes)
    assert _get(after, "kvgraft_store_page_bytes") == page_bytes
    assert _get(after, "kvgraft_store_last_sequence") == 1
    assert _get(after, "kvgraft_tier_used_bytes", tier="lmdb") == page_bytes
    map_used, map_size = (
        _get(after, f"kvgraft_store_map_{what}_bytes") for what in ("used", "size")
    )
    assert 0 < map_used <= map_size
    assert _get(after, "kvgraft_store_map_usage_ratio") == map_used / map_size
    assert _get(deleted, "kvgraft_store_artifacts") == 0
    assert _get(deleted, "kvgraft_store_page_bytes") == 0
    assert _get(deleted, "kvgraft_store_last_sequence") == 2

    # One structured (logfmt) line per artifact written and per artifact deleted.
    events = [line.split(": ", 1)[1] for line in daemon.log_lines if ": event=artifact_" in line]
    assert events == [
        f"event=artifact_written artifact_id={artifact.id} sequence=1 "
        f"pages_written={len(sizes)} bytes_written={page_bytes} tokens=100",
        f"event=artifact_deleted artifact_id={artifact.id} pages_freed={len(sizes)} "
        f"bytes_freed={page_bytes}",
    ]


def test_receipts_count_grafts_and_reused_tokens(start_daemon) -> None:
    daemon = start_daemon(extra_args=["--model", "tiny:1", "--metrics-listen", "127.0.0.1:0"])
    wait_model_ready(daemon.address)
    prompt = [(7 * i) % 500 + 1 for i in range(130)]  # two whole pages of 64, and a tail
    with Client(daemon.address) as client:
        deposited = client.deposit(token_ids=prompt).receipt
        grafted = client.generate(token_ids=[*prompt, 3, 4], max_new_tokens=2)
        stats = client.stats()
    tiers = stats.tiers
    receipts = [deposited, grafted.receipt]
    # the whole deposit, its tail page too (row-invariant products; whole pages without)
    expected = 130 if grafted.receipt.raw.profile.products else 128
    assert grafted.receipt.reused_tokens == expected
    # The disk moves between the two reads, as on a busy machine (issue 47: the lmdb
    # tier's capacity, free disk included, was compared across them): 8 MiB written
    # beside the store.
    with open(daemon.data_dir.parent / "neighbour", "wb") as neighbour:
        neighbour.write(os.urandom(8 << 20))
        os.fsync(neighbour.fileno())
    samples = _scrape(daemon)
    # Every tier Stats reports (the engine's device and host tiers too), figure for figure,
    # but the lmdb tier's disk figures: each read says them as the disk is then.
    assert {"device", "host", "lmdb"} <= {tier.name for tier in tiers}
    for tier in tiers:
        for field in ("hits", "misses", "evictions"):
            metric = f"kvgraft_tier_{field}_total"
            assert _get(samples, metric, tier=tier.name) == getattr(tier, field), (tier, field)
        moving = ("capacity_bytes", "peak_bytes") if tier.name == "lmdb" else ()
        for field in {"used_bytes", "capacity_bytes", "peak_bytes"} - set(moving):
            metric = f"kvgraft_tier_{field}"
            assert _get(samples, metric, tier=tier.name) == getattr(tier, field), (tier, field)
    # The lmdb tier's disk figures are those of the same read: the store's files, and
    # the free disk beside them.
    lmdb = next(tier for tier in tiers if tier.name == "lmdb")
    footprint = stats.segment_disk_bytes + stats.map_used_bytes
    assert (lmdb.peak_bytes, lmdb.capacity_bytes) == (footprint, footprint + stats.disk_free_bytes)
    scraped = sum(_get(samples, f"kvgraft_store_{f}_bytes") for f in ("segment_disk", "map_used"))
    assert _get(samples, "kvgraft_tier_peak_bytes", tier="lmdb") == scraped > 0
    assert _get(samples, "kvgraft_tier_capacity_bytes", tier="lmdb") == scraped + _get(
        samples, "kvgraft_store_disk_free_bytes"
    )
    # The grafted pages moved through the engine's tiers: the counters moved.
    assert sum(tier.hits + tier.misses for tier in tiers if tier.name != "lmdb") > 0
    assert _get(samples, "kvgraft_computations_total", method="Deposit") == 1
    assert _get(samples, "kvgraft_computations_total", method="Generate") == 1
    assert _get(samples, "kvgraft_grafts_total", method="Deposit") == 0
    assert _get(samples, "kvgraft_grafts_total", method="Generate") == 1
    assert _get(samples, "kvgraft_reused_tokens_total") == sum(r.reused_tokens for r in receipts)
    assert _get(samples, "kvgraft_computed_tokens_total") == sum(
        r.computed_tokens for r in receipts
    )
    # Every computed token went through the batcher's steps; nothing is left in flight.
    assert _get(samples, "kvgraft_batch_tokens_total") == sum(r.computed_tokens for r in receipts)
    # the deposit's prompt, the generate's prompt, its decoding pass (all its tokens)
    assert _get(samples, "kvgraft_batch_passes_total") == 1 + 1 + 1
    steps = _get(samples, "kvgraft_batch_steps_total")
    assert _get(samples, "kvgraft_batch_contexts_total") >= steps > 0
    for idle in ("kvgraft_batch_waiting_passes", "kvgraft_requests_running"):
        assert _get(samples, idle) == 0, idle
    assert _get(samples, "kvgraft_requests_queued") == 0


def test_the_cache_and_the_scrub_in_a_scrape(start_daemon, rng) -> None:
    """Budget, evictions and the last scrub, as Info says them, in a scrape."""
    daemon = start_daemon(
        extra_args=["--metrics-listen", "127.0.0.1:0", "--store-budget-artifacts", "2"]
    )
    with Client(daemon.address) as client:
        for _ in range(4):
            client.put_artifact(random_artifact(rng, tokens=16))
        found = client.scrub()
        info = client.info()
    samples = _scrape(daemon)
    assert _get(samples, "kvgraft_cache_budget_artifacts") == 2
    assert _get(samples, "kvgraft_cache_evicted_artifacts_total") == info.cache.evicted_artifacts
    assert info.cache.evicted_artifacts >= 2
    assert _get(samples, "kvgraft_scrub_pages_done") == found.pages_done > 0
    assert _get(samples, "kvgraft_scrub_corrupt_pages") == 0
    assert _get(samples, "kvgraft_scrub_running") == 0
    finished = _get(samples, "kvgraft_scrub_last_finished_unix_seconds")
    assert finished == found.finished_unix_ms / 1000
