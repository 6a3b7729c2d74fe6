"""Replication bench: a store copied between two daemons against a raw TCP socket.

What it measures, each in the same run, >= 1 GiB of artifacts of the default
model's geometry (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, float32,
64-token pages of 98,304 bytes; 2,048-token artifacts of 94 MB), random bytes
built into artifacts with the real `Artifact.build`:

* one-shot: `Client.replicate_to(pull=False)` (the relay that `kvgraft replicate
  --from A --to B` runs, and replicate_to's fallback) from a source kvgraftd
  holding the corpus to a fresh, empty target kvgraftd, both on loopback, each
  in its own process, the replicator in this one: source GetArtifact -> this
  process (every page's xxh3-128 checked) -> target PutArtifact (every page's
  SHA-256 checked, committed and synced to LMDB). Timed from the call to its
  return; the target's daemon start and the source's load are excluded. Every
  trial checks that the target holds every artifact and that exactly the
  corpus's bytes were moved.
* one-shot pull: `Client.pull_from` (what `kvgraft replicate --pull` runs):
  the fresh target daemon copies from the source itself (the Replicate RPC),
  the bytes going from the source to the target only. Timed the same way.
* follow-mode catch-up: a fresh target daemon started with
  `--replication-follow SOURCE` copies the same corpus by itself (the
  replicator inside the target daemon, writing its own store without a gRPC
  hop). Timed between two lines of its log: "following ... from sequence 1"
  and the last "replica of ...: added ID" (the daemon's clock, ms resolution).
* ceiling: `Client.put_artifact` of the corpus, from this process's memory,
  into a fresh daemon: the target's own intake (SHA-256 of every page, LMDB
  commit and sync), which bounds any replication into it.
* baseline: the same bytes over a raw TCP socket on loopback: a sender process
  (forked from this one before any gRPC channel, holding the very same bytes)
  sends each artifact's bytes from memory in 4 MiB writes and this process
  `recv_into`s a preallocated buffer. This is the plainest way to move the
  bytes: no framing, no checks, nothing durable. A second row writes the
  received bytes to a file (1 MiB writes, the faster way here: see
  store_bench) with an fsync per artifact (durable, unverified), to show
  what durability alone costs.
* catchup_lag_s: with a target following the source, the time from a write
  on the source (PutArtifact of a 128-token artifact, 5.9 MB, returned) to
  its appearance on the target (the ADDED record of that id on the target's
  Watch stream), median over --lag-writes writes.

Hygiene: every measurement has an untimed warm-up; the trials of ours and the
baselines are interleaved (order alternating), because disk and memory
bandwidth on a shared machine drift. The table gives the median and best
GB/s (1 GB = 1e9 bytes); a ratio is the median of per-trial ratios (pairs ran
back to back). Clocks are time.perf_counter. The last stdout line is one JSON
object with replication_vs_tcp (one-shot / raw TCP), pull_vs_tcp and catchup_lag_s.

Run: .venv/bin/python bench/replication_bench.py [--gib 1.0] [--trials 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import numpy as np
from store_bench import (
    Corpus,
    Geometry,
    Row,
    TcpBaseline,
    interleaved,
    make_corpus,
    paired_ratio,
    print_table,
    write_in_pieces,
)

from kvgraft import Client
from kvgraft.artifact import Artifact
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.testing.daemon_process import DaemonProcess

LAG_TOKENS = 128
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _daemon_args(n: int, *extra: str) -> list[str]:
    return ["--map-initial-bytes", str(2 * n + (1 << 30)), "--log-level", "info", *extra]


def _log_time(line: str) -> float:
    match = _LOG_TIME.match(line)
    if match is None:
        raise ValueError(f"no timestamp in {line!r}")
    return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def bench_one_shot(
    corpus: Corpus, work: Path, source: DaemonProcess, tcp: TcpBaseline, trials: int
) -> list[Row]:
    n = corpus.total_bytes
    ids = {a.id for a in corpus.artifacts}
    dest = np.empty(n, np.uint8)
    into = memoryview(dest).cast("B")
    ours = Row("copy", "one-shot Client.replicate_to (2 workers)", n)
    follow = Row("copy", "follow-mode catch-up (replicator in the target daemon)", n)
    pull = Row("copy", "one-shot pull Client.pull_from (Replicate)", n)
    raw = Row("copy", "raw TCP socket, recv_into  [baseline]", n)
    durable = Row("copy", "raw TCP + file write + fsync per artifact", n)
    put = Row("copy", "PutArtifact from memory into a fresh daemon (ceiling)", n)
    counter = iter(range(1_000_000))

    def fresh_target(*extra: str) -> DaemonProcess:
        return DaemonProcess.start(work / f"target-{next(counter)}", _daemon_args(n, *extra))

    def discard(target: DaemonProcess) -> None:
        target.stop()
        shutil.rmtree(target.data_dir, ignore_errors=True)

    def filled(copy: Callable[[Client], object], *extra: str) -> float:
        """Seconds `copy(target client)` takes to give a fresh target the corpus (checked)."""
        target = fresh_target(*extra)
        try:
            with Client(target.address, timeout_s=60, transfer_timeout_s=900) as b:
                start = time.perf_counter()
                summary = copy(b)
                seconds = time.perf_counter() - start
                held = {info.artifact_id for info in b.list_artifacts()}
            if held != ids or summary.bytes_moved != n or summary.artifacts_failed:
                raise AssertionError(f"the replica is incomplete: {summary}")
            return seconds
        finally:
            discard(target)

    def one_shot() -> float:
        with Client(source.address, timeout_s=60, transfer_timeout_s=900) as a:
            return filled(lambda b: a.replicate_to(b, pull=False))  # the relay, measured alone

    def pull_once() -> float:
        return filled(
            lambda b: b.pull_from(source.address), "--replication-pull-from", source.address
        )

    def catch_up() -> float:
        target = fresh_target("--replication-follow", source.address)
        try:
            with Client(target.address, timeout_s=60) as b:
                deadline = time.monotonic() + 900
                while b.stats().artifacts < len(ids):
                    if time.monotonic() > deadline:
                        raise AssertionError("the follower did not catch up:\n" + target.log())
                    time.sleep(0.05)
                held = {info.artifact_id for info in b.list_artifacts()}
            if held != ids:
                raise AssertionError("the follower's replica differs from the source")
            lines = target.log_lines
            began = next(_log_time(line) for line in lines if "following" in line)
            ended = max(_log_time(line) for line in lines if ": added " in line)
            return ended - began
        finally:
            discard(target)

    def put_from_memory() -> float:
        target = fresh_target()
        try:
            with Client(target.address, timeout_s=60, transfer_timeout_s=900) as b:
                start = time.perf_counter()
                for artifact in corpus.artifacts:
                    b.put_artifact(artifact)
                return time.perf_counter() - start
        finally:
            discard(target)

    def tcp_get() -> float:
        start = time.perf_counter()
        for index in range(len(corpus.artifacts)):
            lo, hi = corpus.artifact_span(index)
            tcp.fetch(lo, hi - lo, into[lo:hi])
        return time.perf_counter() - start

    def tcp_fsync() -> float:
        path = work / "tcp-file"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            start = time.perf_counter()
            for index in range(len(corpus.artifacts)):
                lo, hi = corpus.artifact_span(index)
                tcp.fetch(lo, hi - lo, into[lo:hi])
                write_in_pieces(fd, into[lo:hi])
                os.fsync(fd)
            return time.perf_counter() - start
        finally:
            os.close(fd)
            path.unlink()

    tcp.connect()
    interleaved(
        trials,
        [
            (ours, one_shot),
            (raw, tcp_get),
            (pull, pull_once),
            (follow, catch_up),
            (durable, tcp_fsync),
            (put, put_from_memory),
        ],
    )
    if not np.array_equal(dest, corpus.data):
        raise AssertionError("the TCP baseline received other bytes than were sent")
    return [ours, pull, follow, put, raw, durable]


def lag_artifact(corpus: Corpus, index: int) -> Artifact:
    """A 128-token artifact of the corpus's geometry, new bytes each time."""
    g = corpus.geometry
    rng = np.random.default_rng(10_000 + index)
    pages = [rng.bytes(g.page_bytes) for _ in range(g.layers * (LAG_TOKENS // g.page_tokens))]
    return Artifact.build(
        model_fingerprint=bytes(range(32)),
        layout=pb.KvLayout(
            num_layers=g.layers,
            kv_heads=g.kv_heads,
            head_dim=g.head_dim,
            kv_dtype=pb.KV_DTYPE_FLOAT32,
        ),
        profile=pb.ComputeProfile(
            torch_version="bench", device_kind="cpu", page_tokens=g.page_tokens
        ),
        token_ids=rng.integers(0, 49_152, LAG_TOKENS).tolist(),
        page_bytes=pages,
    )


def bench_lag(corpus: Corpus, work: Path, source: DaemonProcess, writes: int) -> list[float]:
    """Seconds from a put on the source returning to its ADDED record on a follower."""
    n = corpus.total_bytes
    target = DaemonProcess.start(
        work / "follower", _daemon_args(n, "--replication-follow", source.address)
    )
    lags: list[float] = []
    try:
        with Client(source.address) as a, Client(target.address) as b:
            for index in range(writes + 1):  # the first one is the warm-up
                artifact = lag_artifact(corpus, index)
                feed = b.watch(b.stats().last_sequence + 1, follow=True)
                try:
                    a.put_artifact(artifact)
                    start = time.perf_counter()
                    for record in feed:
                        if record.artifact_id == artifact.id:
                            break
                    lag = time.perf_counter() - start
                finally:
                    feed.cancel()
                if index:
                    lags.append(lag)
        return lags
    finally:
        target.stop()
        shutil.rmtree(target.data_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="corpus size (default 1 GiB)")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--lag-writes", type=int, default=15)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    geometry = Geometry(30, 3, 64, 64, 2048)

    began = time.perf_counter()
    load_before = os.getloadavg()
    corpus = make_corpus(geometry, args.gib, args.seed)
    n = corpus.total_bytes
    free = shutil.disk_usage(args.dir).free
    if free < 4 * n + (2 << 30):
        print(f"replication_bench: {args.dir} has {free >> 20} MiB free", file=sys.stderr)
        return 2
    print(
        f"replication_bench: {len(corpus.artifacts)} artifacts x "
        f"{geometry.pages_per_artifact} pages x {geometry.page_bytes:,} bytes = "
        f"{n / 1e9:.3f} GB ({n / (1 << 30):.3f} GiB); {args.trials} trials; dir {args.dir}; "
        f"{os.cpu_count()} CPUs; load average {load_before[0]:.2f}",
        flush=True,
    )
    tcp = TcpBaseline(corpus.data)  # fork now: before any gRPC channel
    work = Path(tempfile.mkdtemp(prefix="kvgraft-replication-bench-", dir=args.dir))
    source = None
    try:
        source = DaemonProcess.start(work / "source", _daemon_args(n))
        with Client(source.address, timeout_s=60, transfer_timeout_s=900) as a:
            for artifact in corpus.artifacts:
                a.put_artifact(artifact)
        print("  source loaded", flush=True)
        rows = bench_one_shot(corpus, work, source, tcp, args.trials)
        print("  copies done", flush=True)
        lags = bench_lag(corpus, work, source, args.lag_writes)
        print("  lag done", flush=True)
    except Exception:
        if source is not None:
            print(source.log()[-4000:], file=sys.stderr)
        raise
    finally:
        tcp.close()
        if source is not None:
            source.stop()
        shutil.rmtree(work, ignore_errors=True)

    print_table(rows)
    ours, pull, follow, put, raw, durable = rows
    lag_bytes = geometry.layers * (LAG_TOKENS // geometry.page_tokens) * geometry.page_bytes
    print(
        f"\ncatch-up lag, {LAG_TOKENS}-token artifacts ({lag_bytes / 1e6:.1f} MB), "
        f"{len(lags)} writes: median {statistics.median(lags) * 1e3:.1f} ms, "
        f"min {min(lags) * 1e3:.1f} ms, max {max(lags) * 1e3:.1f} ms"
    )
    result = {
        "replication_vs_tcp": round(paired_ratio(ours, raw), 3),
        "catchup_lag_s": round(statistics.median(lags), 4),
        "pull_vs_tcp": round(paired_ratio(pull, raw), 3),
        "follow_catchup_vs_tcp": round(paired_ratio(follow, raw), 3),
        "replication_vs_tcp_fsync": round(paired_ratio(ours, durable), 3),
        "replication_vs_put": round(paired_ratio(ours, put), 3),
        "follow_catchup_vs_put": round(paired_ratio(follow, put), 3),
        "put_gbps": round(put.median_gbps, 3),
        "replication_gbps": round(ours.median_gbps, 3),
        "pull_gbps": round(pull.median_gbps, 3),
        "follow_catchup_gbps": round(follow.median_gbps, 3),
        "tcp_gbps": round(raw.median_gbps, 3),
        "tcp_fsync_gbps": round(durable.median_gbps, 3),
        "catchup_lag_max_s": round(max(lags), 4),
        "lag_artifact_bytes": lag_bytes,
        "bytes": n,
        "artifacts": len(corpus.artifacts),
        "trials": args.trials,
        "load_average_before": round(load_before[0], 2),
        "load_average_after": round(os.getloadavg()[0], 2),
        "elapsed_s": round(time.perf_counter() - began, 1),
    }
    print(
        "\nratios are throughput(ours)/throughput(baseline), median of per-trial pairs; "
        "target: replication_vs_tcp >= 0.25"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
