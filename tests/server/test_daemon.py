"""kvgraftd as a process: health, reflection, signals, locking, config, RPCs, full disks.

Every test runs a real daemon in its own process on a temporary store:

* standard gRPC health answers SERVING; server reflection lists the service
  and serves its descriptor (so grpcurl works);
* SIGTERM and SIGINT: health turns NOT_SERVING, an in-flight slow read
  drains whole, follow Watch streams end, the store closes, exit status 0,
  and the data are intact on restart;
* a second daemon on the same data directory refuses to start and names the
  first one's pid;
* --config TOML sets options, flags override it, unknown keys are errors,
  --print-config round-trips;
* engine RPCs of a daemon without a model are FAILED_PRECONDITION with a
  message; Watch, Pin, id prefixes and the rpc_calls counters behave as the proto says;
* disk full: the min_free_bytes reserve refuses puts (nothing stored, deletes
  still work), a real full filesystem (tmpfs) never kills the daemon, and the
  LMDB map grows from 1 MiB as needed.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvgraft import Artifact, Client, wire
from kvgraft.artifact import page_sizes
from kvgraft.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraft.v1 import kvgraft_pb2_grpc as pb_grpc
from kvgraftd.testing.daemon_process import DaemonProcess
from tests.support.factory import random_artifact

SERVICE = "kvgraft.v1.Kvgraft"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
F32 = pb.KV_DTYPE_FLOAT32


def _small(rng: random.Random, **labels: str) -> Artifact:
    return random_artifact(
        rng, num_layers=2, kv_heads=2, head_dim=16, page_tokens=16, labels=labels
    )


def _mib_artifact(rng: random.Random, mib: int) -> Artifact:
    """An artifact of `mib` MiB in 128 KiB pages (4 layers, fp32)."""
    return random_artifact(
        rng, num_layers=4, kv_heads=4, head_dim=64, kv_dtype=F32, page_tokens=64, tokens=128 * mib
    )


def _same_pages(fetched: Artifact, original: Artifact) -> bool:
    return {d: bytes(v) for d, v in fetched.pages.items()} == {
        d: bytes(v) for d, v in original.pages.items()
    }


def _kvgraftd(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvgraftd", *args], capture_output=True, text=True, timeout=timeout_s
    )


def _wait_for_log(daemon: DaemonProcess, text: str, timeout_s: float = 30) -> None:
    """The log pump runs in a thread: let it read what the process wrote."""
    deadline = time.monotonic() + timeout_s
    while not any(text in line for line in daemon.log_lines):
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{daemon.log()}"
        time.sleep(0.02)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------
# health and reflection


def test_health_answers_serving(daemon: DaemonProcess) -> None:
    with grpc.insecure_channel(daemon.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert response.status == SERVING
        with pytest.raises(grpc.RpcError) as caught:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_the_service(daemon: DaemonProcess) -> None:
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE),
    ]
    with grpc.insecure_channel(daemon.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        listed, described = stub.ServerReflectionInfo(iter(requests), timeout=10)
    names = {s.name for s in listed.list_services_response.service}
    assert names == {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in described.file_descriptor_response.file_descriptor_proto
    ]
    ours = next(f for f in files if f.name == "kvgraft/v1/kvgraft.proto")
    methods = {m.name for m in ours.service[0].method}
    assert methods == set(pb.DESCRIPTOR.services_by_name["Kvgraft"].methods_by_name)


# ----------------------------------------------------------------------
# signals


def _raw_get_stream(channel: grpc.Channel, artifact_id: str) -> Iterator[bytes]:
    call = channel.unary_stream(
        f"/{SERVICE}/GetArtifact",
        request_serializer=pb.GetArtifactRequest.SerializeToString,
        response_deserializer=None,
    )
    return call(pb.GetArtifactRequest(artifact_id=artifact_id), timeout=120)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_drains_in_flight_calls_and_exits_cleanly(start_daemon, rng, signum) -> None:
    daemon = start_daemon()
    big = _mib_artifact(rng, 32)  # far more than gRPC buffers in flight
    small = _small(rng)
    with Client(daemon.address) as client:
        client.put_artifact(big)
        client.put_artifact(small)
    with grpc.insecure_channel(daemon.address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=60
        )
        assert next(health).status == SERVING
        slow_read = _raw_get_stream(channel, big.id)
        first = next(slow_read)  # the manifest: the read is now in flight, and we stall it
        assert wire.decode_envelope(first, wire.GET_PAGES, wire.GET_MANIFEST)[1] is not None

        daemon.proc.send_signal(signum)
        assert next(health).status == NOT_SERVING
        health.cancel()

        pages: dict[bytes, bytearray] = {}
        for raw in slow_read:
            chunks, _ = wire.decode_envelope(raw, wire.GET_PAGES, wire.GET_MANIFEST)
            for chunk in chunks:
                pages.setdefault(chunk.sha256, bytearray()).extend(chunk.data)
    assert set(pages) == set(page_sizes(big.manifest))
    for digest, data in pages.items():
        assert hashlib.sha256(data).digest() == digest

    assert daemon.proc.wait(60) == 0
    _wait_for_log(daemon, "store closed")
    messages = [line.split(": ", 1)[-1] for line in daemon.log_lines]
    stop_order = [
        next(i for i, m in enumerate(messages) if m.startswith(prefix))
        for prefix in ("shutting down", "server stopped", "store closed")
    ]
    assert stop_order == sorted(stop_order)
    assert not [line for line in daemon.log_lines if " ERROR " in line or "Traceback" in line]

    daemon.launch()  # the same data directory
    with Client(daemon.address) as client:
        assert _same_pages(client.get_artifact(big.id), big)
        assert _same_pages(client.get_artifact(small.id), small)
        stats = client.stats()
        assert (stats.artifacts, stats.staged_pages, stats.last_sequence) == (2, 0, 2)


def test_shutdown_ends_follow_watch_streams(start_daemon, rng) -> None:
    """Regression: a follow Watch (a replica) held the drain for its whole grace period."""
    daemon = start_daemon(extra_args=["--drain-s", "600"])
    with Client(daemon.address) as client:
        client.put_artifact(_small(rng))
    with grpc.insecure_channel(daemon.address) as channel:
        feed = pb_grpc.KvgraftStub(channel).Watch(pb.WatchRequest(follow=True), timeout=120)
        assert next(feed).sequence == 1
        daemon.proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as caught:
            next(feed)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in caught.value.details()
    assert "from sequence 2" in caught.value.details()
    assert daemon.proc.wait(60) == 0


def test_second_daemon_on_the_same_data_dir_refuses_to_start(daemon: DaemonProcess) -> None:
    listen = ["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"]
    result = _kvgraftd(*listen, "--data", str(daemon.data_dir))
    assert result.returncode == 1
    assert f"in use by another kvgraftd (pid {daemon.proc.pid})" in result.stderr
    assert "serving on" not in result.stderr
    assert (daemon.data_dir / "kvgraftd.lock").read_text() == f"{daemon.proc.pid}\n"
    with Client(daemon.address) as client:
        assert client.info().version


# ----------------------------------------------------------------------
# configuration


def test_config_file_sets_options_and_flags_override_it(start_daemon, rng, tmp_path) -> None:
    config = tmp_path / "kvgraftd.toml"
    config.write_text('log_level = "warning"\nmin_free_bytes = "1000TB"\nworkers = 3\n')

    # --log-level beats the file (the "serving on" line is logged at info);
    # min_free_bytes comes from the file.
    daemon = start_daemon(extra_args=["--config", str(config), "--log-level", "info"])
    artifact = _small(rng)
    with Client(daemon.address) as client, pytest.raises(ResourceExhausted) as caught:
        client.put_artifact(artifact)
    assert "min_free_bytes=953674316.4 MiB" in str(caught.value)
    assert daemon.terminate() == 0

    # The file's log_level now holds (no info lines); --min-free-bytes beats the file.
    port = _free_port()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "kvgraftd", "--config", str(config)),
            *("--min-free-bytes", "1MiB", "--listen", f"127.0.0.1:{port}"),
            *("--http-listen", "127.0.0.1:0"),
            *("--data", str(daemon.data_dir)),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            check = health_pb2_grpc.HealthStub(channel).Check
            assert check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING
        with Client(f"127.0.0.1:{port}") as client:
            assert client.put_artifact(artifact).artifact_id == artifact.id
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert " INFO " not in stderr


def test_print_config_round_trips(tmp_path: Path) -> None:
    data = tmp_path / 'odd "dir" \\ name é'
    printed = _kvgraftd(
        "--print-config",
        "--listen",
        "0.0.0.0:7000",
        "--data",
        str(data),
        "--min-free-bytes",
        "5MiB",
        "--drain-s",
        "2.5",
        "--map-initial-bytes",
        "3GB",
    )
    assert printed.returncode == 0, printed.stderr
    values = tomllib.loads(printed.stdout)
    assert values["listen"] == "0.0.0.0:7000"
    assert values["data"] == str(data)
    assert values["min_free_bytes"] == 5 << 20
    assert values["map_initial_bytes"] == 3 * 10**9
    assert values["drain_s"] == 2.5
    assert values["log_level"] == "info"

    config = tmp_path / "printed.toml"
    config.write_text(printed.stdout)
    again = _kvgraftd("--config", str(config), "--print-config")
    assert again.returncode == 0, again.stderr
    assert again.stdout == printed.stdout
    overridden = _kvgraftd("--config", str(config), "--workers", "40", "--print-config")
    assert tomllib.loads(overridden.stdout) == {**values, "workers": 40}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('log_level = "info"\nbogus_key = 3\n', "unknown key 'bogus_key' (known keys: "),
        ('min_free_bytes = "lots"\n', "min_free_bytes = 'lots': use a byte count"),
        ('log_level = "loud"\n', "log_level 'loud': use debug, info, warning or error"),
        ("log_level = \n", "is not valid TOML"),
        ("malloc_top_pad_bytes = -1\n", "malloc_top_pad_bytes = -1: use a value in 0..1073741824"),
        # each of these was a traceback, a failure later, or silently another value
        ("map_initial_bytes = 4611686018427387904\n", "map_initial_bytes = 461168"),
        ("staged_ttl_s = nan\n", "staged_ttl_s = nan: use a value in 0..31536000"),
        ("keepalive_s = 1e12\n", "keepalive_s = 1000000000000.0: use a value in"),
        ("max_request_bytes = 1099511627776\n", "max_request_bytes = 1099511627776: use"),
        ("drain_s = inf\n", "drain_s = inf: use a value in 0..86400"),
        ("host_budget_bytes = -5\n", "host_budget_bytes = -5: use a value in 0 or more"),
        ("block_tokens = 0\n", "block_tokens = 0: use a value in 1.."),
        ("min_free_bytes = -1\n", "min_free_bytes = -1: use a value in 0 or more"),
        ("max_context_tokens = -1\n", "max_context_tokens = -1: use a value in 0.."),
        ("conversation_budget_bytes = -1\n", "conversation_budget_bytes = -1: use a value in 0"),
        ("workers = 1.9\n", "workers = 1.9: expected a whole number"),
        ("workers = true\n", "workers = True: expected a whole number"),
        ('listen = "127.0.0.1:99999"\n', "a port in 0..65535"),
        ('metrics_listen = "127.0.0.1:x"\n', "a port in 0..65535"),
    ],
)
def test_bad_config_file_exits_2_naming_the_problem(tmp_path, text: str, expected: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(text)
    result = _kvgraftd("--config", str(config), "--data", str(tmp_path / "data"))
    assert result.returncode == 2
    assert expected in result.stderr
    if "known keys" in expected:  # the list names the real keys
        assert all(f"{key}, " in result.stderr for key in ("data", "listen", "log_level"))
    assert not (tmp_path / "data").exists()  # nothing was started


def test_a_directory_or_binary_config_file_is_refused_clearly(tmp_path) -> None:
    binary = tmp_path / "binary.toml"
    binary.write_bytes(bytes(range(256)))
    for path, expected in ((tmp_path, "is a directory"), (binary, "is not text")):
        result = _kvgraftd("--config", str(path), "--data", str(tmp_path / "data"))
        assert result.returncode == 2, result.stderr
        assert expected in result.stderr and "Traceback" not in result.stderr


def test_missing_config_file_exits_2(tmp_path) -> None:
    result = _kvgraftd("--config", str(tmp_path / "nowhere.toml"))
    assert result.returncode == 2
    assert f"config file {tmp_path / 'nowhere.toml'} does not exist" in result.stderr


# ----------------------------------------------------------------------
# RPCs


def test_engine_rpcs_without_a_model_fail_with_a_message(daemon: DaemonProcess) -> None:
    names = ("Lookup", "Deposit", "Generate", "Graft", "Verify")
    with grpc.insecure_channel(daemon.address) as channel:
        stub = pb_grpc.KvgraftStub(channel)
        for name in names:
            method = pb.DESCRIPTOR.services_by_name["Kvgraft"].methods_by_name[name]
            request = getattr(pb, method.input_type.name)()
            with pytest.raises(grpc.RpcError) as caught:
                response = getattr(stub, name)(request, timeout=10)
                if method.server_streaming:
                    list(response)
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION, name
            assert caught.value.details() == (
                "this daemon runs without a model (--model none); restart it with a model "
                "to deposit, generate, graft or verify"
            )
    with Client(daemon.address) as client:
        assert client.stats().rpc_calls == {f"{name}:FAILED_PRECONDITION": 1 for name in names}


def test_watch_returns_the_change_feed(client: Client, rng) -> None:
    first, second, third = _small(rng), _small(rng), _small(rng)
    client.put_artifact(first)
    client.put_artifact(second)
    client.delete(first.id)
    expected = [
        (1, pb.ChangeRecord.KIND_ADDED, first.id),
        (2, pb.ChangeRecord.KIND_ADDED, second.id),
        (3, pb.ChangeRecord.KIND_DELETED, first.id),
    ]
    records = list(client.watch())
    assert [(r.sequence, r.kind, r.artifact_id) for r in records] == expected
    assert all(a.unix_ms <= b.unix_ms for a, b in itertools.pairwise(records))
    assert [r.sequence for r in client.watch(0)] == [1, 2, 3]
    assert [(r.sequence, r.kind, r.artifact_id) for r in client.watch(2)] == expected[1:]
    assert list(client.watch(4)) == []
    assert client.stat(second.id).info.sequence == 2

    feed = client.watch(2, follow=True)
    assert [next(feed).sequence, next(feed).sequence] == [2, 3]
    client.put_artifact(third)  # after the stream started
    record = next(feed)
    assert (record.sequence, record.kind, record.artifact_id) == (
        4,
        pb.ChangeRecord.KIND_ADDED,
        third.id,
    )
    feed.close()
    assert client.stats().last_sequence == 4


def test_pin_blocks_delete_until_unpinned(client: Client, rng) -> None:
    artifact = _small(rng)
    client.put_artifact(artifact)
    info = client.pin(artifact.id[:10])
    assert (info.artifact_id, info.pinned) == (artifact.id, True)
    assert client.stat(artifact.id).info.pinned
    assert [i.pinned for i in client.list_artifacts()] == [True]
    with pytest.raises(FailedPrecondition, match=r"is pinned; unpin it first \(kvgraft pin --off"):
        client.delete(artifact.id)
    assert client.stats().artifacts == 1
    assert client.pin(artifact.id, pinned=True).pinned  # pinning twice is harmless
    assert not client.pin(artifact.id, pinned=False).pinned
    deleted = client.delete(artifact.id)
    assert deleted.pages_freed == len(page_sizes(artifact.manifest))
    with pytest.raises(NotFound):
        client.pin(artifact.id)


def test_stat_and_get_accept_a_unique_prefix(client: Client, rng) -> None:
    artifact, other = _small(rng), _small(rng)
    client.put_artifact(artifact)
    client.put_artifact(other)
    for prefix in (artifact.id[:8], artifact.id[:33].upper(), artifact.id):
        assert client.stat(prefix).info.artifact_id == artifact.id
        assert client.get_artifact(prefix).id == artifact.id
    with pytest.raises(InvalidArgument, match="give 8 to 64 hex characters"):
        client.stat(artifact.id[:7])
    with pytest.raises(InvalidArgument, match="give 8 to 64 hex characters"):
        client.get_artifact("not-hex!")
    absent = "0" * 8 if not artifact.id.startswith("0" * 8) else "f" * 8
    with pytest.raises(NotFound, match=f"no artifact id starts with {absent}"):
        client.stat(absent)
    with pytest.raises(InvalidArgument, match="not a full artifact id"):
        client.delete(artifact.id[:16])  # deletes take full ids only
    assert client.stats().artifacts == 2


def test_stats_counts_rpc_calls_by_method_and_code(client: Client, rng) -> None:
    artifact = _small(rng)
    client.info()
    client.info()
    client.put_artifact(artifact)
    client.get_artifact(artifact.id)
    with pytest.raises(NotFound):
        client.stat("deadbeef")
    with pytest.raises(InvalidArgument):
        client.stat("xyz")
    with pytest.raises(NotFound):
        client.delete("ab" * 32)
    assert client.stats().rpc_calls == {
        "Info:OK": 2,
        "MissingPages:OK": 1,
        "PutArtifact:OK": 1,
        "GetArtifact:OK": 1,
        "Stat:NOT_FOUND": 1,
        "Stat:INVALID_ARGUMENT": 1,
        "Delete:NOT_FOUND": 1,
    }
    assert client.stats().rpc_calls["Stats:OK"] == 1


# ----------------------------------------------------------------------
# disk full


def test_min_free_bytes_refuses_puts_but_not_deletes(start_daemon, rng) -> None:
    daemon = start_daemon()
    kept = _small(rng)
    with Client(daemon.address) as client:
        client.put_artifact(kept)
        before = client.stats()
    assert daemon.terminate() == 0

    # More reserve than the disk has; spill_bytes 1 MiB makes the 3 MiB put
    # stage pages mid-stream, which is refused as well.
    daemon = start_daemon(
        data_dir=daemon.data_dir, extra_args=["--min-free-bytes", "1000TB", "--spill-bytes", "1MiB"]
    )
    refused = [_small(rng), _mib_artifact(rng, 3)]
    with Client(daemon.address) as client:
        for artifact in refused:
            with pytest.raises(ResourceExhausted) as caught:
                client.put_artifact(artifact)
            message = str(caught.value)
            assert "kvgraftd keeps min_free_bytes=953674316.4 MiB in reserve" in message
            assert "delete artifacts (kvgraft rm ID)" in message
            digests = list(page_sizes(artifact.manifest))
            assert client.missing_pages(digests) == digests
        stats = client.stats()
        assert (stats.artifacts, stats.pages, stats.page_bytes, stats.staged_pages) == (
            1,
            before.pages,
            before.page_bytes,
            0,
        )
        assert stats.last_sequence == 1
        assert stats.rpc_calls["PutArtifact:RESOURCE_EXHAUSTED"] == 2

        # Still serving: reads, pins and deletes (how an operator frees space).
        assert client.info().version
        assert _same_pages(client.get_artifact(kept.id), kept)
        assert client.pin(kept.id).pinned
        assert not client.pin(kept.id, pinned=False).pinned
        assert client.delete(kept.id).pages_freed == before.pages
        stats = client.stats()
        assert (stats.artifacts, stats.pages, stats.page_bytes) == (0, 0, 0)


SMALL_DISK_ARGS = ["--min-free-bytes", "1MiB", "--map-initial-bytes", "1MiB"]


def _fill(client: Client, rng: random.Random) -> list[Artifact]:
    """Put 3 MiB, then 1 MiB, then tiny artifacts until each size is refused."""
    stored: list[Artifact] = []
    refusals = 0
    mib = 3
    for _ in range(300):
        artifact = _mib_artifact(rng, mib) if mib else _small(rng)
        try:
            client.put_artifact(artifact)
        except ResourceExhausted as exc:
            assert "delete artifacts (kvgraft rm ID)" in str(exc)
            refusals += 1
            if not mib:
                break
            mib //= 2  # fill what is left with smaller artifacts
            continue
        stored.append(artifact)
    assert refusals == 3 and len(stored) > 10
    return stored


def test_full_filesystem_refuses_writes_and_keeps_serving(small_disk: Path, rng) -> None:
    daemon = DaemonProcess.start(small_disk / "data", SMALL_DISK_ARGS)
    try:
        with Client(daemon.address) as client:
            stored = _fill(client, rng)
            assert daemon.proc.poll() is None  # no SIGBUS
            stats = client.stats()
            assert stats.artifacts == len(stored) and stats.staged_pages == 0
            assert stats.disk_free_bytes < 3 << 20
            for artifact in stored:
                assert _same_pages(client.get_artifact(artifact.id), artifact)
            # Deletes still work on a full disk.
            gone = stored.pop(0)
            assert client.delete(gone.id).pages_freed == len(page_sizes(gone.manifest))
            assert client.stats().artifacts == len(stored)
        assert daemon.terminate() == 0

        daemon.launch()
        with Client(daemon.address) as client:
            assert client.stats().artifacts == len(stored)
            for artifact in stored:
                assert _same_pages(client.get_artifact(artifact.id), artifact)
    finally:
        daemon.stop()


def test_deleting_on_a_full_filesystem_makes_room_for_puts(small_disk: Path, rng) -> None:
    daemon = DaemonProcess.start(small_disk / "data", SMALL_DISK_ARGS)
    try:
        with Client(daemon.address) as client:
            stored = _fill(client, rng)
            for artifact in stored[:3]:
                client.delete(artifact.id)  # 9 MiB of pages freed inside the store
            client.put_artifact(_mib_artifact(rng, 1))
    finally:
        daemon.stop()


def test_map_grows_from_one_mib(start_daemon, rng) -> None:
    daemon = start_daemon(extra_args=["--map-initial-bytes", "1MiB"])
    large = random_artifact(  # 8,192 pages: one commit whose index outgrows the map
        rng, num_layers=8, kv_heads=1, head_dim=1, kv_dtype=F32, page_tokens=2, tokens=1024
    )
    smalls = [_small(rng) for _ in range(20)]
    with Client(daemon.address) as client:
        assert client.stats().map_size_bytes == 1 << 20
        for artifact in [smalls[0], large, *smalls[1:]]:
            client.put_artifact(artifact)
        stats = client.stats()
        assert stats.page_bytes == sum(
            sum(page_sizes(a.manifest).values()) for a in [large, *smalls]
        )
        assert stats.map_size_bytes >= stats.map_used_bytes > 1 << 20
    assert daemon.terminate() == 0
    assert any("store map grown from 1 MiB" in line for line in daemon.log_lines)
    daemon.launch()
    with Client(daemon.address) as client:
        assert client.stats().artifacts == 21
        for artifact in [large, *smalls]:
            assert _same_pages(client.get_artifact(artifact.id), artifact)
