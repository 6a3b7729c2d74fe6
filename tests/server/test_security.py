"""Who may call kvgraftd: bearer tokens, TLS, mutual TLS and the exposure rule.

* Token: every kvgraft RPC, server reflection and health Watch without the
  token, or with a wrong one, is UNAUTHENTICATED; health Check stays open;
  the right token (Client, CLI flag, KVGRAFT_TOKEN_FILE) works; the token
  appears in no log line and no error message.
* TLS with certificates the test makes: a client that trusts the CA works,
  plaintext and a client trusting another CA do not; with mutual TLS a
  client without a certificate, or with one from another CA, is refused.
  Under systemd the daemon probes its health over a private Unix socket
  that serves nothing else.
* Exposure: a non-loopback address without TLS or a token does not start
  (exit 2, naming the fix) unless --insecure is given.
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvgraft import Client
from kvgraft.client.channel import Security
from kvgraft.errors import InvalidArgument, Unauthenticated, Unavailable
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.server.security import is_local
from tests.support.certs import Pki, make_pki, openssl_available
from tests.support.factory import random_artifact

TOKEN = "kvgraft-test-token-5f2b9c0e7d41"
SERVICE = pb.DESCRIPTOR.services_by_name["Kvgraft"]
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    if not openssl_available():
        pytest.skip("the openssl command is not installed (.ci/run installs it)")
    return make_pki(tmp_path_factory.mktemp("pki"))


def _call_code(channel: grpc.Channel, method, metadata) -> grpc.StatusCode:
    """Call `method` (a descriptor) with an empty request; the status code it ends with."""
    path = f"/{SERVICE.full_name}/{method.name}"
    kwargs = {"request_serializer": None, "response_deserializer": None}
    try:
        if method.client_streaming and method.server_streaming:
            list(channel.stream_stream(path, **kwargs)(iter([b""]), metadata=metadata, timeout=10))
        elif method.client_streaming:
            channel.stream_unary(path, **kwargs)(iter([b""]), metadata=metadata, timeout=10)
        elif method.server_streaming:
            list(channel.unary_stream(path, **kwargs)(b"", metadata=metadata, timeout=10))
        else:
            channel.unary_unary(path, **kwargs)(b"", metadata=metadata, timeout=10)
    except grpc.RpcError as exc:
        assert TOKEN not in (exc.details() or "")
        return exc.code()
    return grpc.StatusCode.OK


def _reflection_code(channel: grpc.Channel, metadata) -> grpc.StatusCode:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    try:
        list(stub.ServerReflectionInfo(iter([request]), metadata=metadata, timeout=10))
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _health_watch_code(channel: grpc.Channel, metadata) -> grpc.StatusCode:
    watch = health_pb2_grpc.HealthStub(channel).Watch
    try:
        stream = watch(health_pb2.HealthCheckRequest(), metadata=metadata, timeout=10)
        assert next(stream).status == SERVING
        stream.cancel()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_every_rpc_without_the_right_token_is_unauthenticated(start_daemon, token_file) -> None:
    daemon = start_daemon(extra_args=["--token-file", str(token_file), "--log-level", "debug"])
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    wrong = [("authorization", "Bearer " + TOKEN[:-1] + "x")]
    right = [("authorization", "Bearer " + TOKEN)]
    with grpc.insecure_channel(daemon.address) as channel:
        for metadata in (None, wrong, [("authorization", TOKEN)]):
            codes = {m.name: _call_code(channel, m, metadata) for m in SERVICE.methods}
            assert codes == dict.fromkeys(SERVICE.methods_by_name, unauthenticated)
            assert _reflection_code(channel, metadata) == unauthenticated
            assert _health_watch_code(channel, metadata) == unauthenticated
            check = health_pb2_grpc.HealthStub(channel).Check  # open: probes need no secret
            assert check(health_pb2.HealthCheckRequest(), metadata=metadata).status == SERVING
        # The right token passes the door: each call then fails or succeeds on its merits.
        codes = {m.name: _call_code(channel, m, right) for m in SERVICE.methods}
        assert unauthenticated not in codes.values()
        assert codes["Stats"] == grpc.StatusCode.OK
        assert _reflection_code(channel, right) == grpc.StatusCode.OK
        assert _health_watch_code(channel, right) == grpc.StatusCode.OK

    with Client(daemon.address) as client, pytest.raises(Unauthenticated) as caught:
        client.stats()
    assert "--token-file" in str(caught.value)
    with Client(daemon.address, token_file=token_file) as client:
        assert client.stats().rpc_calls["Stats:UNAUTHENTICATED"] == 4
    with Client(daemon.address, token=TOKEN) as client:
        client.info()
    assert daemon.log_lines and not [line for line in daemon.log_lines if TOKEN in line]


def test_cli_takes_the_token_from_a_flag_or_the_environment(start_daemon, token_file) -> None:
    daemon = start_daemon(extra_args=["--token-file", str(token_file)])

    def kvgraft(*args: str, env: dict[str, str] | None = None):
        environ = {k: v for k, v in os.environ.items() if not k.startswith("KVGRAFT_")}
        return subprocess.run(
            [sys.executable, "-m", "kvgraft", "--server", daemon.address, "--json", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**environ, **(env or {})},
        )

    refused = kvgraft("ls")
    assert refused.returncode == 1
    assert '"code": "UNAUTHENTICATED"' in refused.stdout
    assert kvgraft("--token-file", str(token_file), "ls").returncode == 0
    assert kvgraft("ls", env={"KVGRAFT_TOKEN_FILE": str(token_file)}).returncode == 0
    for result in (refused, kvgraft("--token-file", "/nonexistent/token", "ls")):
        assert TOKEN not in result.stdout + result.stderr


def test_client_security_options_are_checked_and_the_token_stays_hidden(tmp_path) -> None:
    security = Security.resolve(token=TOKEN, environ={})
    assert TOKEN not in repr(security)
    assert security.tls is False
    with pytest.raises(InvalidArgument, match="tls_cert and tls_key"):
        Security.resolve(tls_cert="client.pem", environ={})
    with pytest.raises(InvalidArgument, match="cannot read it") as caught:
        Security.resolve(token_file=tmp_path / "absent", environ={})
    assert "absent" in str(caught.value)
    environ = {"KVGRAFT_TLS_CA": "ca.pem", "KVGRAFT_TOKEN_FILE": str(tmp_path / "absent")}
    assert Security.resolve(token="t", environ=environ) == Security("t", True, "ca.pem")


# ----------------------------------------------------------------------
# TLS


def _tls_args(pki: Pki, *, mutual: bool) -> list[str]:
    args = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    return args + (["--tls-client-ca", str(pki.ca)] if mutual else [])


def test_tls_serves_clients_that_trust_its_ca(start_daemon, pki: Pki, rng) -> None:
    daemon = start_daemon(extra_args=_tls_args(pki, mutual=False))
    artifact = random_artifact(rng)
    with Client(daemon.address, tls_ca=pki.ca) as client:
        client.put_artifact(artifact)
        assert client.get_artifact(artifact.id).id == artifact.id
    with Client(daemon.address, tls_ca=pki.ca, tls_server_name="localhost") as client:
        assert client.stats().artifacts == 1
    for options in ({}, {"tls_ca": pki.rogue_ca}):  # plaintext; a CA that did not sign it
        client = Client(daemon.address, timeout_s=10, **options)
        with client, pytest.raises(Unavailable):
            client.stats()


def test_mutual_tls_refuses_clients_without_a_certificate_of_its_ca(start_daemon, pki: Pki):
    daemon = start_daemon(extra_args=_tls_args(pki, mutual=True))
    good = {"tls_ca": pki.ca, "tls_cert": pki.client_cert, "tls_key": pki.client_key}
    with Client(daemon.address, **good) as client:
        assert client.stats().artifacts == 0
    wrong = {**good, "tls_cert": pki.rogue_cert, "tls_key": pki.rogue_key}
    for options in ({"tls_ca": pki.ca}, wrong):
        client = Client(daemon.address, timeout_s=10, **options)
        with client, pytest.raises(Unavailable) as caught:
            client.stats()
        assert "--tls-cert" in str(caught.value)
    env = {
        "KVGRAFT_TLS_CA": str(pki.ca),
        "KVGRAFT_TLS_CERT": str(pki.client_cert),
        "KVGRAFT_TLS_KEY": str(pki.client_key),
    }
    result = subprocess.run(
        [sys.executable, "-m", "kvgraft", "--server", daemon.address, "ls"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "no artifacts"


def test_tls_metrics_and_the_probe_socket_under_systemd(start_daemon, pki: Pki, tmp_path) -> None:
    """Under mutual TLS the daemon still tells systemd READY (probing health over a Unix
    socket in its data directory), that socket serves nothing but health, and /metrics
    is HTTPS with the same client-certificate requirement."""
    with tempfile.TemporaryDirectory(dir="/tmp") as directory:
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(f"{directory}/notify")
        notify.settimeout(30)
        data = Path(directory) / "data"
        daemon = start_daemon(
            data_dir=data,
            extra_args=[*_tls_args(pki, mutual=True), "--metrics-listen", "127.0.0.1:0"],
            env={"NOTIFY_SOCKET": f"{directory}/notify"},
        )
        assert b"READY=1" in notify.recv(4096).split(b"\n")
        notify.close()
        probe = f"unix:{data.resolve()}/health-probe.sock"
        with grpc.insecure_channel(probe) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            assert check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING
            with Client(probe) as client, pytest.raises(Unauthenticated, match="probe socket"):
                client.stats()

        url = next(
            line.split("metrics on ", 1)[1] for line in daemon.log_lines if "metrics on" in line
        )
        assert url.startswith("https://127.0.0.1:")
        context = ssl.create_default_context(cafile=str(pki.ca))
        context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
        with urllib.request.urlopen(url, context=context, timeout=10) as response:
            assert b"kvgraft_store_artifacts 0.0" in response.read()
        anonymous = ssl.create_default_context(cafile=str(pki.ca))
        with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
            urllib.request.urlopen(url, context=anonymous, timeout=10).read()


# ----------------------------------------------------------------------
# exposure


def test_addresses_other_machines_reach_are_not_local() -> None:
    assert all(map(is_local, ["127.0.0.1:1", "127.8.9.1:1", "[::1]:1", "localhost:1", "unix:/x"]))
    assert not any(map(is_local, ["0.0.0.0:1", "[::]:1", "10.0.0.1:1", "example.org:1"]))


def _kvgraftd(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvgraftd", "--model", "none", "--data", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_exposed_listen_needs_tls_a_token_or_insecure(start_daemon, tmp_path, token_file):
    refused = _kvgraftd(tmp_path / "a", "--listen", "0.0.0.0:0")
    assert refused.returncode == 2
    assert "listen '0.0.0.0:0' is reachable from other machines" in refused.stderr
    assert "--insecure" in refused.stderr and "token_file" in refused.stderr
    assert not (tmp_path / "a").exists()  # refused before touching the data directory
    metrics = _kvgraftd(tmp_path / "b", "--token-file", str(token_file), "--metrics-listen", ":0")
    assert metrics.returncode == 2
    assert "metrics_listen ':0' is reachable from other machines" in metrics.stderr
    http = _kvgraftd(tmp_path / "e", "--http-listen", "0.0.0.0:0")
    assert http.returncode == 2
    assert "http_listen '0.0.0.0:0' is reachable from other machines" in http.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert "is empty" in _kvgraftd(tmp_path / "c", "--token-file", str(empty)).stderr
    alone = _kvgraftd(tmp_path / "d", "--tls-cert", str(token_file))
    assert alone.returncode == 2 and "tls_cert and tls_key go together" in alone.stderr

    for extra in (["--insecure"], ["--token-file", str(token_file)]):
        daemon = start_daemon(extra_args=["--listen", "0.0.0.0:0", *extra])
        port = daemon.address.rsplit(":", 1)[1]
        with Client(f"127.0.0.1:{port}", token_file=token_file) as client:
            assert client.stats().artifacts == 0
        assert daemon.terminate() == 0
