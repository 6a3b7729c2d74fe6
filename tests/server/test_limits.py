"""What an overloaded or abused kvgraftd does: refuse at once, stay healthy, free what it held.

* A flood of connections beyond max_concurrent_rpcs is refused at once with
  RESOURCE_EXHAUSTED (every call, counted exactly), while health Check keeps
  answering in under 100 ms (the median of the probes made during the
  flood); calls waiting for a worker run once one frees, and the slots come
  back when the holders go.
* A stream running past max_call_s ends with DEADLINE_EXCEEDED (a slow
  reader, a slow uploader: nothing stored); follow Watch streams are exempt.
* A request larger than max_request_bytes is RESOURCE_EXHAUSTED.
* Reflection streams, which hold a thread each, starve neither health Check
  nor kvgraft calls (each runs on a pool of its own).
* Keepalive: a client that vanishes without closing its connection (a
  stopped process) is noticed and the call it held is freed.
"""

from __future__ import annotations

import hashlib
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvgraft import Client, wire
from kvgraft.errors import DeadlineExceeded
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraft.v1 import kvgraft_pb2_grpc as pb_grpc
from kvgraftd.server.limits import RESERVE_THREADS, SIDE_THREADS
from tests.support.factory import random_artifact

SERVICE = "kvgraft.v1.Kvgraft"
SERVING = health_pb2.HealthCheckResponse.SERVING
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
FLOOD_CONNECTIONS = 24
CALLS_PER_CONNECTION = 5


def _stats_code(channel: grpc.Channel, timeout_s: float = 30) -> tuple[grpc.StatusCode, str]:
    try:
        pb_grpc.KvgraftStub(channel).Stats(pb.StatsRequest(), timeout=timeout_s)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def _wait_for_code(channel: grpc.Channel, code: grpc.StatusCode, timeout_s: float = 30) -> int:
    """Call Stats until it answers `code`; returns how many calls were refused on the way.

    Each probe gives up after a second: a probe that arrives before the calls it
    should be refused behind waits for a worker instead (regression: one such
    probe used to hold the whole 30 s), and a probe that gives up frees its slot.
    """
    deadline = time.monotonic() + timeout_s
    refused = 0
    while True:
        got, _ = _stats_code(channel, timeout_s=1)
        refused += got == EXHAUSTED
        if got == code:
            return refused
        assert time.monotonic() < deadline, f"Stats still answers {got}"
        time.sleep(0.05)


def _wait_in_progress(daemon, calls: int, timeout_s: float = 30) -> None:
    """Until the daemon's kvgraft_rpc_in_progress gauge reads `calls`."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(daemon.metrics_url, timeout=10) as response:
            text = response.read().decode()
        gauge = next(
            line for line in text.splitlines() if line.startswith("kvgraft_rpc_in_progress")
        )
        if float(gauge.split()[-1]) == calls:
            return
        assert time.monotonic() < deadline, f"{gauge}, waiting for {calls}"
        time.sleep(0.05)


def _mib_artifact(rng: random.Random, mib: int):
    return random_artifact(
        rng,
        num_layers=4,
        kv_heads=4,
        head_dim=64,
        kv_dtype=pb.KV_DTYPE_FLOAT32,
        page_tokens=64,
        tokens=128 * mib,
    )


def test_a_flood_beyond_the_limit_is_refused_and_health_stays_fast(start_daemon, rng) -> None:
    daemon = start_daemon(
        extra_args=[
            "--max-concurrent-rpcs",
            "4",
            "--workers",
            "2",
            "--metrics-listen",
            "127.0.0.1:0",
        ]
    )
    with Client(daemon.address) as client:
        client.put_artifact(random_artifact(rng))
    with grpc.insecure_channel(daemon.address) as holders:
        # Four uploads held open fill the limit: two run (each waits for its next message
        # on a worker), then two wait for a worker. (Follow Watch streams would not: they
        # have a limit of their own and take no worker.)
        put = holders.stream_unary(
            f"/{SERVICE}/PutArtifact",
            request_serializer=None,
            response_deserializer=pb.PutArtifactResponse.FromString,
        )
        release = threading.Event()
        page = random.Random(0).randbytes(64)
        first = wire.encode_page_block(
            wire.PUT_PAGES, [wire.Chunk(hashlib.sha256(page).digest(), 0, len(page), page)]
        )

        def held():
            yield first
            release.wait(120)

        uploads = [put.future(held(), timeout=120) for _ in range(2)]
        _wait_in_progress(daemon, 2)
        uploads += [put.future(held(), timeout=120) for _ in range(2)]
        # Both admitted before any probe: a probe admitted first would take the slot
        # one of them needs.
        _wait_in_progress(daemon, 4)
        with grpc.insecure_channel(daemon.address) as probe_channel:
            refused_before = _wait_for_code(probe_channel, EXHAUSTED)

            results: list[tuple[grpc.StatusCode, str]] = []
            start = threading.Barrier(FLOOD_CONNECTIONS + 1)

            def flood() -> None:
                with grpc.insecure_channel(daemon.address) as channel:  # a connection each
                    grpc.channel_ready_future(channel).result(timeout=30)
                    start.wait()
                    results.extend(_stats_code(channel) for _ in range(CALLS_PER_CONNECTION))

            threads = [threading.Thread(target=flood) for _ in range(FLOOD_CONNECTIONS)]
            for thread in threads:
                thread.start()
            check = health_pb2_grpc.HealthStub(probe_channel).Check
            start.wait()
            latencies = []
            while any(thread.is_alive() for thread in threads) or len(latencies) < 5:
                began = time.perf_counter()
                assert check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING
                latencies.append(time.perf_counter() - began)
                time.sleep(0.01)
            for thread in threads:
                thread.join()

        assert len(results) == FLOOD_CONNECTIONS * CALLS_PER_CONNECTION
        assert {code for code, _ in results} == {EXHAUSTED}
        assert all("max_concurrent_rpcs" in details for _, details in results)
        assert statistics.median(latencies) < 0.1, latencies

        # The waiting calls run once workers free; the slots come back when the holders go.
        uploads[0].cancel()
        uploads[1].cancel()
        release.set()  # the two that waited run, and end without a manifest: they ran
        for upload in uploads[2:]:
            assert upload.exception(60).code() == grpc.StatusCode.INVALID_ARGUMENT
    with Client(daemon.address) as client:
        deadline = time.monotonic() + 30
        while (calls := client.stats().rpc_calls)["Stats:OK"] < 1:
            assert time.monotonic() < deadline
        flood_calls = FLOOD_CONNECTIONS * CALLS_PER_CONNECTION
        assert calls["Stats:RESOURCE_EXHAUSTED"] == refused_before + flood_calls


def test_streams_past_max_call_s_end_with_deadline_exceeded(start_daemon, rng) -> None:
    daemon = start_daemon(extra_args=["--max-call-s", "1"])
    big = _mib_artifact(rng, 32)  # far more than gRPC buffers in flight
    with Client(daemon.address) as client:
        client.put_artifact(big)
        follow = client.watch(1, follow=True)
        assert next(follow).sequence == 1

        # A slow reader: the daemon ends the stream at its first message past the limit.
        with grpc.insecure_channel(daemon.address) as channel:
            read = channel.unary_stream(
                f"/{SERVICE}/GetArtifact",
                request_serializer=pb.GetArtifactRequest.SerializeToString,
                response_deserializer=None,
            )
            stream = read(pb.GetArtifactRequest(artifact_id=big.id), timeout=60)
            next(stream)
            time.sleep(1.5)
            with pytest.raises(grpc.RpcError) as caught:
                for _ in stream:
                    pass
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "max_call_s = 1 s" in caught.value.details()

        # A slow uploader: refused, and nothing of it is stored or staged.
        slow = _mib_artifact(rng, 12)
        with pytest.raises(DeadlineExceeded, match="max_call_s"):
            client.put_artifact(slow, progress=lambda sent: time.sleep(0.6))
        stats = client.stats()
        assert (stats.artifacts, stats.staged_pages) == (1, 0)

        # A follow Watch is exempt: long past the limit it still delivers.
        small = random_artifact(rng)
        client.put_artifact(small)
        record = next(follow)
        assert (record.sequence, record.artifact_id) == (2, small.id)
        follow.cancel()


def test_requests_beyond_max_request_bytes_are_refused(start_daemon) -> None:
    digests = [bytes(32)] * 150_000  # 4.8 MB: past 4 MiB
    request = pb.MissingPagesRequest(sha256=digests).SerializeToString()
    for limit, expected in (("4MiB", EXHAUSTED), ("8MiB", grpc.StatusCode.INVALID_ARGUMENT)):
        daemon = start_daemon(extra_args=["--max-request-bytes", limit])
        with grpc.insecure_channel(daemon.address) as channel:
            call = channel.unary_unary(f"/{SERVICE}/MissingPages", request_serializer=None)
            with pytest.raises(grpc.RpcError) as caught:
                call(request, timeout=30)
        assert caught.value.code() == expected, caught.value.details()


_VANISHING_CLIENT = """
import hashlib, sys, time, grpc
from kvgraft import wire
from kvgraft.v1 import kvgraft_pb2 as pb
channel = grpc.insecure_channel(sys.argv[1])
put = channel.stream_unary("/kvgraft.v1.Kvgraft/PutArtifact", request_serializer=None,
                           response_deserializer=pb.PutArtifactResponse.FromString)
page = b"held" * 16
def held():  # an upload that never ends: it holds a worker while it waits
    yield wire.encode_page_block(wire.PUT_PAGES,
                                 [wire.Chunk(hashlib.sha256(page).digest(), 0, 64, page)])
    print("holding", 1, flush=True)
    time.sleep(600)
future = put.future(held(), timeout=600)
time.sleep(600)
"""


def test_keepalive_frees_the_call_of_a_vanished_client(start_daemon, rng) -> None:
    daemon = start_daemon(
        extra_args=[
            *("--max-concurrent-rpcs", "1", "--workers", "1"),
            *("--keepalive-s", "0.5", "--keepalive-timeout-s", "0.5"),
        ]
    )
    with Client(daemon.address) as client:
        client.put_artifact(random_artifact(rng))
    holder = subprocess.Popen(
        [sys.executable, "-c", _VANISHING_CLIENT, daemon.address],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().split() == ["holding", "1"]
        with grpc.insecure_channel(daemon.address) as channel:
            _wait_for_code(channel, EXHAUSTED)  # the one slot is held
            # Frozen, the client still holds its TCP connection but answers no ping.
            holder.send_signal(signal.SIGSTOP)
            _wait_for_code(channel, grpc.StatusCode.OK)
    finally:
        holder.kill()
        holder.wait()


def test_reflection_streams_starve_neither_health_nor_kvgraft_calls(start_daemon) -> None:
    """Reflection streams are not admitted by count (each holds a thread while it waits
    for its next request): they run on a pool of their own, health Check on another."""
    daemon = start_daemon(extra_args=["--max-concurrent-rpcs", "1", "--workers", "1"])
    held = max(SIDE_THREADS, 1 + RESERVE_THREADS) + 1  # more than any pool holds
    release = threading.Event()

    def requests():
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        release.wait(60)  # keep the stream, and its server thread, open

    with grpc.insecure_channel(daemon.address) as channel:
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo
        streams = [reflect(requests(), timeout=60) for _ in range(SIDE_THREADS)]
        for stream in streams:  # each now holds a thread of the side pool
            assert next(stream).HasField("list_services_response")
        streams += [reflect(requests(), timeout=60) for _ in range(held - SIDE_THREADS)]
        check = health_pb2_grpc.HealthStub(channel).Check
        assert check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING
        assert _stats_code(channel)[0] == grpc.StatusCode.OK
        release.set()
        for stream in streams:
            stream.cancel()
