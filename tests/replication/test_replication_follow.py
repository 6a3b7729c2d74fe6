"""Continuous replication: a replica daemon follows its source, across crashes and hosts.

* A daemon configured with `[replication] follow = [SOURCE]` applies the
  source's writes and deletes as they happen; killed (SIGKILL) while the
  source is being written, it restarts from the position it saved and copies
  exactly what it lacks, nothing twice.
* The library (Client.replicate_to(follow=True)) and the command line
  (`kvgraft replicate --follow`, ended with Ctrl-C) follow the same way.
* Over mutual TLS with a bearer token: prepared clients for the library, the
  KVGRAFT_* environment for a following daemon.
* Two hosts: where network namespaces can be made (root, `ip netns`), the
  source and the replica run in two namespaces with their own addresses,
  joined by a bridge; otherwise the test is skipped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import uuid

import pytest

from kvgraft import Client
from kvgraft.replication.stream_guard import StreamGuard
from kvgraft.stream import Stream
from kvgraftd.config import DaemonConfig
from kvgraftd.testing.daemon_process import DaemonProcess
from tests.support.certs import make_pki, openssl_available
from tests.support.factory import random_artifact
from tests.support.replica_audit import divergent_artifacts, ids, wait_until
from tests.support.store_audit import multi_mib_artifact

_ADDED = re.compile(r"replica of \S+: added ([0-9a-f]{64})")


def saved_position(daemon: DaemonProcess, peer: str) -> int:
    path = daemon.data_dir / "replication.json"
    if not path.exists():
        return 0
    return json.loads(path.read_text())["peers"].get(peer, {}).get("sequence", 0)


def test_follower_applies_changes_and_resumes_after_a_crash(start_daemon, rng, tmp_path) -> None:
    source = start_daemon()
    config = tmp_path / "replica.toml"
    config.write_text(f'[replication]\nfollow = ["{source.address}"]\n')
    replica = start_daemon(extra_args=["--config", str(config)])
    with Client(source.address) as a:
        artifacts = [random_artifact(rng) for _ in range(10)]
        for artifact in artifacts:
            a.put_artifact(artifact)
        with Client(replica.address) as b:
            wait_until(lambda: ids(b) == ids(a), "the writes reach the replica")
            for victim in artifacts[:3]:
                a.delete(victim.id)
            wait_until(lambda: ids(b) == ids(a), "the deletes reach the replica")
            assert divergent_artifacts(a, b) == []
            last = a.stats().last_sequence
            wait_until(lambda: saved_position(replica, source.address) == last, "position saved")

            # Crash the replica while the source is being written.
            more = [multi_mib_artifact(rng) for _ in range(4)]
            more += [random_artifact(rng) for _ in range(8)]
            writer = threading.Thread(target=lambda: [a.put_artifact(x) for x in more])
            writer.start()
            wait_until(lambda: len(ids(b) & {x.id for x in more}) >= 2, "copying in progress")
        replica.kill()
        writer.join()
        a.delete(more[0].id)  # changes while the replica is down
        for artifact in [random_artifact(rng) for _ in range(2)]:
            a.put_artifact(artifact)
        position = saved_position(replica, source.address)
        assert position > last

        # What survived the crash, seen with following switched off.
        replica.extra_args = ["--config", str(config), "--replication-follow", ""]
        replica.launch()
        with Client(replica.address) as b:
            survived = ids(b)
        replica.terminate()

        replica.extra_args = ["--config", str(config)]
        replica.launch()
        with Client(replica.address) as b:
            wait_until(lambda: ids(b) == ids(a), "the replica catches up")
            assert divergent_artifacts(a, b) == []
        log = replica.log()
        assert f"following {source.address} from sequence {position + 1}" in log
        added = set(_ADDED.findall(log))
        assert len(added) >= 2
        assert added == ids(a) - survived  # exactly what it lacked, nothing twice


def test_library_follow_mode_until_stopped(start_daemon, rng) -> None:
    source, replica = start_daemon(), start_daemon()
    stop = threading.Event()
    positions: list[int] = []
    with Client(source.address) as a, Client(replica.address) as b:
        first = random_artifact(rng)
        a.put_artifact(first)
        results = []
        follower = threading.Thread(
            target=lambda: results.append(
                a.replicate_to(b, follow=True, stop=stop, on_position=positions.append)
            )
        )
        follower.start()
        wait_until(lambda: ids(b) == {first.id}, "the catch-up")
        second = random_artifact(rng)
        a.put_artifact(second)
        a.delete(first.id)
        wait_until(lambda: ids(b) == {second.id}, "a write and a delete followed")
        stop.set()
        follower.join(30)
        assert not follower.is_alive()
        summary = results[0]
        assert (summary.artifacts_added, summary.artifacts_deleted) == (2, 1)
        assert summary.last_sequence == positions[-1] == 3


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_cli_follow_until_interrupted(start_daemon, rng, stop_signal) -> None:
    # Regression: a SIGINT whose KeyboardInterrupt was lost inside gRPC's stream
    # iteration left the command following; now either signal sets its stop event.
    source, replica = start_daemon(), start_daemon()
    command = [sys.executable, "-m", "kvgraft", "--json", "replicate", "--follow"]
    command += ["--from", source.address, "--to", replica.address]
    with Client(source.address) as a, Client(replica.address) as b:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        try:
            artifact = random_artifact(rng)
            a.put_artifact(artifact)
            wait_until(lambda: ids(b) == {artifact.id}, "the CLI follows")
        finally:
            process.send_signal(stop_signal)
            try:
                out, _ = process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()  # leave no orphan following a daemon
                process.communicate()
                raise
        assert process.returncode == 0
        summary = json.loads(out)
        assert summary["artifacts_added"] == 1 and summary["last_sequence"] == 1


def test_replication_over_mutual_tls_with_a_token(start_daemon, rng, tmp_path) -> None:
    """The library takes prepared clients; a following daemon its KVGRAFT_* environment."""
    if not openssl_available():
        pytest.skip("the openssl command is not installed (.ci/run installs it)")
    pki = make_pki(tmp_path / "pki")
    token = tmp_path / "token"
    token.write_text("replication-test-token-0123456789\n")
    token.chmod(0o600)
    secured = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    secured += ["--tls-client-ca", str(pki.ca), "--token-file", str(token)]
    options = {
        "tls_ca": pki.ca,
        "tls_cert": pki.client_cert,
        "tls_key": pki.client_key,
        "token_file": token,
    }
    source, replica = start_daemon(extra_args=secured), start_daemon(extra_args=secured)
    environment = {
        "KVGRAFT_TLS_CA": str(pki.ca),
        "KVGRAFT_TLS_CERT": str(pki.client_cert),
        "KVGRAFT_TLS_KEY": str(pki.client_key),
        "KVGRAFT_TOKEN_FILE": str(token),
    }
    follower = start_daemon(
        extra_args=[*secured, "--replication-follow", source.address], env=environment
    )
    with (
        Client(source.address, **options) as a,
        Client(replica.address, **options) as b,
        Client(follower.address, **options) as c,
    ):
        for artifact in [multi_mib_artifact(rng), random_artifact(rng)]:
            a.put_artifact(artifact)
        assert a.replicate_to(b).artifacts_added == 2
        assert divergent_artifacts(a, b) == []
        wait_until(lambda: ids(c) == ids(a), "the follower over TLS")
        assert divergent_artifacts(a, c) == []


# --------------------------------------------------------------------------
# two hosts


class TwoHosts:
    """Two network namespaces on a bridge: 10.213.x.1 and 10.213.x.2; the host is .254."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.subnet = f"10.213.{int(tag[:2], 16)}"
        self.names = [f"kvg-{tag}-a", f"kvg-{tag}-b"]
        self.bridge = f"kvgbr{tag}"
        self.commands: list[list[str]] = []

    def up(self) -> None:
        run = self._run
        run("ip", "link", "add", self.bridge, "type", "bridge")
        run("ip", "addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        for index, name in enumerate(self.names, start=1):
            host_end, inner = f"kvgv{name[4:10]}{index}", f"kvgi{name[4:10]}{index}"
            run("ip", "netns", "add", name)
            run("ip", "link", "add", host_end, "type", "veth", "peer", "name", inner)
            run("ip", "link", "set", inner, "netns", name)
            run("ip", "link", "set", host_end, "master", self.bridge)
            run("ip", "link", "set", host_end, "up")
            run("ip", "netns", "exec", name, "ip", "addr", "add", f"{self.address(index)}/24",
                "dev", inner)  # fmt: skip
            run("ip", "netns", "exec", name, "ip", "link", "set", inner, "up")
            run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")

    def address(self, index: int) -> str:
        return f"{self.subnet}.{index}"

    def down(self) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def _run(self, *command: str) -> None:
        subprocess.run(command, check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("network namespaces need root and iproute2")
    hosts = TwoHosts()
    try:
        hosts.up()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        hosts.down()
        pytest.skip(f"network namespaces cannot be made here: {exc}")
    yield hosts
    hosts.down()


def _in_namespace(hosts: TwoHosts, index: int) -> list[str]:
    """Flags for a daemon of host `index`: its own address, and the exposure opt-in if any."""
    args = ["--listen", f"{hosts.address(index)}:0"]
    if "insecure" in DaemonConfig.__dataclass_fields__:
        args.append("--insecure")  # a non-loopback address without TLS, on a test bridge
    return args


def test_two_hosts_in_network_namespaces(two_hosts, tmp_path, rng) -> None:
    source = DaemonProcess.start(
        tmp_path / "a", _in_namespace(two_hosts, 1), prefix=_netns(two_hosts, 0)
    )
    replica = None
    try:
        try:
            with Client(source.address, timeout_s=5) as a:
                a.stats()
        except Exception as exc:
            pytest.skip(f"the host cannot reach the namespace over the bridge: {exc}")
        replica = DaemonProcess.start(
            tmp_path / "b",
            [*_in_namespace(two_hosts, 2), "--replication-follow", source.address],
            prefix=_netns(two_hosts, 1),
        )
        assert source.address.startswith(two_hosts.address(1))
        assert replica.address.startswith(two_hosts.address(2))
        artifacts = [multi_mib_artifact(rng), *[random_artifact(rng) for _ in range(5)]]
        with Client(source.address) as a, Client(replica.address) as b:
            for artifact in artifacts:
                a.put_artifact(artifact)
            a.delete(artifacts[-1].id)
            wait_until(lambda: ids(b) == ids(a), "the replica host follows the source host")
            assert divergent_artifacts(a, b) == []
    finally:
        if replica is not None:
            replica.stop()
        source.stop()


def _netns(hosts: TwoHosts, index: int) -> list[str]:
    return ["ip", "netns", "exec", hosts.names[index]]


def test_a_stream_opened_as_the_task_stops_is_cancelled_at_once() -> None:
    """Regression: a stream opened just after the guard's cancel_all was never cancelled,
    so `kvgraft replicate --follow` now and then ignored Ctrl-C."""
    stop = threading.Event()
    guard = StreamGuard(lambda: False, lambda: 0, 60.0, "a test task")
    guard.watch(stop)
    stop.set()  # the guard's thread cancels what is open, then ends
    cancelled = threading.Event()
    with guard.opened(Stream(iter(()), cancelled.set)):
        assert cancelled.is_set()
