"""kvgraftd as a systemd service: the notify protocol, the unit file, its config, shutdown.

* Notify: the test binds a datagram socket (a path, and the abstract
  namespace), starts a real daemon with NOTIFY_SOCKET and WATCHDOG_USEC, and
  reads what it sends: READY=1 once health answers SERVING, WATCHDOG=1 at
  WATCHDOG_USEC/2, STOPPING=1 on SIGTERM (no ping after it), then exit 0.
  The readiness loop is also driven with a scripted probe: no READY before a
  probe succeeds, no ping after a failed one.
* The unit: `systemd-analyze verify` accepts it and `systemd-analyze security
  --offline=yes` rates its exposure at most 2.5.
* daemon/systemd/kvgraftd.toml is exactly what `kvgraftd --print-config`
  prints for the service, so it cannot go stale; the install script stages
  the unit, the config and the user.
* SIGTERM during transfers: puts in flight finish or never show, exit 0,
  everything stored is whole after a restart.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgraft import Client
from kvgraft.errors import KvgraftError
from kvgraftd.config import FIELDS
from kvgraftd.ops.notify import Notifier
from kvgraftd.ops.readiness import Readiness
from tests.support.store_audit import audit_store, multi_mib_artifact

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "daemon" / "systemd" / "kvgraftd.service"
SERVICE_TOML = ROOT / "daemon" / "systemd" / "kvgraftd.toml"
SERVING = health_pb2.HealthCheckResponse.SERVING


class NotifyListener:
    """The systemd side of sd_notify: a datagram socket that collects messages."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind("\0" + address[1:] if address.startswith("@") else address)

    def receive(self, timeout_s: float = 30.0) -> tuple[float, dict[str, str]]:
        """(monotonic arrival time, the message's KEY=VALUE fields)."""
        self.socket.settimeout(timeout_s)
        raw = self.socket.recv(4096).decode()
        return time.monotonic(), dict(line.split("=", 1) for line in raw.splitlines() if line)

    def close(self) -> None:
        self.socket.close()


@pytest.fixture(params=["path", "abstract"])
def listener(request) -> Iterator[NotifyListener]:
    if request.param == "abstract":
        address = f"@kvgraft-test-{os.getpid()}-{time.monotonic_ns()}"
        listener = NotifyListener(address)
        yield listener
        listener.close()
    else:
        with tempfile.TemporaryDirectory(dir="/tmp") as directory:  # a short path (108 max)
            listener = NotifyListener(f"{directory}/notify")
            yield listener
            listener.close()


def _health_status(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        return check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_notify_ready_watchdog_stopping(start_daemon, listener: NotifyListener) -> None:
    watchdog_usec = 600_000  # pings every 0.3 s
    daemon = start_daemon(
        env={"NOTIFY_SOCKET": listener.address, "WATCHDOG_USEC": str(watchdog_usec)}
    )
    _, ready = listener.receive()
    # READY is the first message, and health serves when it arrives.
    assert ready["READY"] == "1"
    assert ready["MAINPID"] == str(daemon.proc.pid)
    assert ready["STATUS"] == f"serving on {daemon.address}"
    assert _health_status(daemon.address) == SERVING
    # The daemon logs READY just after sending it: wait for the line to be read.
    told = daemon.wait_for_log("answered SERVING; systemd told READY")
    assert daemon.wait_for_log("kvgraftd 0.1.0 serving") < told

    arrivals = []
    while len(arrivals) < 8:
        arrived, fields = listener.receive(timeout_s=10)
        assert fields == {"WATCHDOG": "1"}
        arrivals.append(arrived)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    interval_s = watchdog_usec / 2e6
    # The rate: half the watchdog timeout, as systemd advises. Every gap is shorter
    # than the timeout itself (or systemd would kill the daemon).
    assert 0.7 * interval_s < statistics.median(gaps) < 1.3 * interval_s, gaps
    assert max(gaps) < watchdog_usec / 1e6, gaps

    daemon.proc.send_signal(signal.SIGTERM)
    while True:
        _, fields = listener.receive(timeout_s=10)
        if "WATCHDOG" not in fields:
            break
    assert fields["STOPPING"] == "1"
    assert fields["STATUS"].startswith("draining in-flight calls")
    assert daemon.proc.wait(60) == 0
    listener.socket.settimeout(0.5)
    with pytest.raises(TimeoutError):
        listener.socket.recv(4096)  # nothing after STOPPING: no late watchdog ping


def test_no_watchdog_pings_without_watchdog_usec(start_daemon, listener: NotifyListener) -> None:
    daemon = start_daemon(env={"NOTIFY_SOCKET": listener.address})
    assert listener.receive()[1]["READY"] == "1"
    daemon.proc.send_signal(signal.SIGTERM)
    assert listener.receive(timeout_s=10)[1]["STOPPING"] == "1"
    assert daemon.proc.wait(60) == 0


def test_watchdog_of_another_pid_is_ignored() -> None:
    assert Notifier.from_environment({}).enabled is False
    ours = {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier.from_environment(ours).watchdog_interval_s == 0.5
    theirs = {**ours, "WATCHDOG_PID": "1"}
    assert Notifier.from_environment(theirs).watchdog_interval_s == 0
    assert Notifier.from_environment({"NOTIFY_SOCKET": "relative"}).enabled is False


class _ScriptedProbe:
    """A health probe whose answers the test writes in advance (then False forever)."""

    target = "scripted"

    def __init__(self, answers: list[bool]) -> None:
        self.answers = answers
        self.calls = 0
        self.done = threading.Event()

    def serving(self, timeout_s: float = 5.0) -> bool:
        self.calls += 1
        if self.calls >= len(self.answers):
            self.done.set()
        return self.answers[self.calls - 1] if self.calls <= len(self.answers) else False

    def close(self) -> None:
        pass


class _RecordingNotifier:
    def __init__(self, watchdog_interval_s: float) -> None:
        self.watchdog_interval_s = watchdog_interval_s
        self.sent: list[tuple[str, int]] = []  # (what, probe calls so far)
        self.probe: _ScriptedProbe | None = None

    def ready(self, status: str) -> bool:
        self.sent.append(("READY", self.probe.calls))
        return True

    def watchdog(self) -> bool:
        self.sent.append(("WATCHDOG", self.probe.calls))
        return True


def test_readiness_notifies_only_after_successful_probes() -> None:
    """READY after the first SERVING probe, then one ping per SERVING probe, none otherwise."""
    answers = [False, False, False, True, True, False, True, False, False, True]
    probe = _ScriptedProbe(answers)
    notifier = _RecordingNotifier(watchdog_interval_s=0.01)
    notifier.probe = probe
    readiness = Readiness(notifier, probe, "serving")  # type: ignore[arg-type]
    readiness.start()
    assert probe.done.wait(30)
    readiness.stop()
    good_calls = [i + 1 for i, good in enumerate(answers) if good]
    assert notifier.sent == [("READY", good_calls[0])] + [("WATCHDOG", c) for c in good_calls[1:]]


# ----------------------------------------------------------------------
# the unit file and its configuration


def _systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (.ci/run installs the systemd package)")
    return tool


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    tool = _systemd_analyze()
    # verify checks that ExecStart's program exists: point it at this checkout's kvgraftd.
    kvgraftd = Path(sys.executable).parent / "kvgraftd"
    assert kvgraftd.is_file()
    unit = tmp_path / "kvgraftd.service"
    unit.write_text(UNIT.read_text().replace("/opt/kvgraft/bin/kvgraftd", str(kvgraftd)))
    result = subprocess.run(
        [tool, "verify", str(unit)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    complaints = [line for line in result.stderr.splitlines() if "kvgraftd.service" in line]
    assert complaints == []


def test_unit_exposure_is_at_most_2_5() -> None:
    tool = _systemd_analyze()
    result = subprocess.run(
        [tool, "security", "--offline=yes", "--no-pager", str(UNIT)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    match = re.search(r"Overall exposure level for kvgraftd\.service: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= 2.5, result.stdout


def test_unit_runs_the_daemon_as_a_notify_service_with_its_config() -> None:
    directives = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            directives.setdefault(key, value)
    assert directives["Type"] == "notify"
    assert (
        directives["ExecStart"] == "/opt/kvgraft/bin/kvgraftd --config /etc/kvgraft/kvgraftd.toml"
    )
    assert directives["User"] == "kvgraft"
    assert directives["StateDirectory"] == "kvgraft"
    assert int(directives["WatchdogSec"]) > 0
    assert tomllib.loads(SERVICE_TOML.read_text())["data"] == "/var/lib/kvgraft"


def test_service_config_is_what_print_config_prints() -> None:
    """The shipped TOML names every key with its help and default (`make service-config`)."""
    printed = subprocess.run(
        [sys.executable, "-m", "kvgraftd", "--data", "/var/lib/kvgraft", "--print-config"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    header, body = SERVICE_TOML.read_text().split("\n\n", 1)
    assert all(line.startswith("#") for line in header.splitlines())
    assert body == printed, "daemon/systemd/kvgraftd.toml is stale: run `make service-config`"
    settings = {  # the replication, trust and remote settings are keys of their tables
        f"{key}_{sub}" if isinstance(value, dict) else key
        for key, value in tomllib.loads(body).items()
        for sub in (value if isinstance(value, dict) else [None])
    }
    assert settings == set(FIELDS)  # every setting but the [tenants.NAME] tables
    assert {"follow", "pull_from"} <= set(tomllib.loads(body)["replication"])


def test_install_script_stages_unit_config_and_user(tmp_path: Path) -> None:
    stage = tmp_path / "root"
    result = subprocess.run(
        ["sh", str(ROOT / "daemon" / "systemd" / "install.sh")],
        env={**os.environ, "DESTDIR": str(stage), "PREFIX": "/srv/kv"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    unit = (stage / "etc/systemd/system/kvgraftd.service").read_text()
    assert "ExecStart=/srv/kv/bin/kvgraftd --config /etc/kvgraft/kvgraftd.toml" in unit
    config = stage / "etc/kvgraft/kvgraftd.toml"
    assert config.read_text() == SERVICE_TOML.read_text()
    assert config.stat().st_mode & 0o777 == 0o640
    assert (stage / "etc/kvgraft").stat().st_mode & 0o777 == 0o750
    sysusers = (stage / "usr/lib/sysusers.d/kvgraft.conf").read_text()
    assert sysusers.splitlines()[-1].split()[:2] == ["u", "kvgraft"]


# ----------------------------------------------------------------------
# SIGTERM while transfers run


def test_sigterm_during_transfers_stores_nothing_partial(start_daemon, rng) -> None:
    daemon = start_daemon()
    artifacts = [multi_mib_artifact(rng) for _ in range(12)]
    sent = {a.id: a for a in artifacts}
    acknowledged: set[str] = set()
    refused: list[str] = []
    first_ack = threading.Event()

    def writer(batch) -> None:
        with Client(daemon.address, timeout_s=60) as client:
            for artifact in batch:
                try:
                    client.put_artifact(artifact)
                except KvgraftError as exc:
                    refused.append(exc.code)
                    continue
                acknowledged.add(artifact.id)
                first_ack.set()

    threads = [threading.Thread(target=writer, args=(artifacts[i::3],)) for i in range(3)]
    for thread in threads:
        thread.start()
    assert first_ack.wait(60)
    daemon.proc.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(120)
    assert daemon.proc.wait(60) == 0
    assert len(acknowledged) + len(refused) == len(artifacts)
    # Calls that reach a daemon already shutting down are refused: UNAVAILABLE, or
    # CANCELLED for one that raced the listener's close. Calls in flight finish.
    assert set(refused) <= {"UNAVAILABLE", "CANCELLED"}, refused
    assert refused, "SIGTERM came after every put: the test proved nothing"

    daemon.launch()  # the same data directory
    with Client(daemon.address, timeout_s=60) as client:
        stored = {info.artifact_id for info in client.list_artifacts()}
        assert acknowledged <= stored <= set(sent)
        # Each stored artifact is whole; no staged (half-sent) pages were left behind.
        audit_store(client, {aid: sent[aid] for aid in stored})


def _unblocked_thread(pid: int, signum: int) -> int:
    """A thread of `pid` other than its main one that would take `signum` (reads /proc)."""
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        blocked = re.search(r"SigBlk:\s*([0-9a-f]+)", (task / "status").read_text())
        if int(task.name) != pid and not int(blocked.group(1), 16) >> (signum - 1) & 1:
            return int(task.name)
    raise AssertionError(f"every thread of {pid} but the main one blocks signal {signum}")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_taken_by_another_thread_stops_the_daemon(start_daemon, signum) -> None:
    """Regression: a stop signal the kernel hands to a thread other than the main one
    (a gRPC or BLAS thread) did not wake the main thread, asleep until the next hourly
    housekeeping: the daemon went on serving and systemd would have killed it."""
    tgkill = getattr(ctypes.CDLL(None, use_errno=True), "tgkill", None)
    if tgkill is None:
        pytest.skip("this libc has no tgkill")
    daemon = start_daemon()
    thread = _unblocked_thread(daemon.proc.pid, signum)
    assert tgkill(daemon.proc.pid, thread, signum) == 0, os.strerror(ctypes.get_errno())
    assert daemon.proc.wait(30) == 0
    # the stderr pump may still be reading the last lines: wait for them
    assert daemon.wait_for_log(f"received {signal.Signals(signum).name}") < daemon.wait_for_log(
        "store closed"
    )
