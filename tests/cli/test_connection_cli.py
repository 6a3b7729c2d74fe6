"""How the `kvgraft` command reaches a daemon, run as the real command against a real
store-only daemon (or a peer that never answers): in its own words when it cannot (no
line of gRPC's own logging on the terminal), on port 50551 when none is given, and
within `--timeout` for every call, those that compute included; Ctrl-C cancels a call in
one line.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from kvgraftd.testing.daemon_process import DaemonProcess


def kvgraft(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The command with no KVGRAFT_* setting and gRPC's logging at its default."""
    environment = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KVGRAFT_", "GRPC_VERBOSITY", "GRPC_TRACE"))
    }
    return subprocess.run(
        [sys.executable, "-m", "kvgraft", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**environment, **(env or {})},
    )


def test_tls_failures_are_one_line_in_kvgraft_words(daemon: DaemonProcess, tmp_path: Path):
    """Regression: `--tls` against a plaintext daemon, or a --tls-ca gRPC cannot load,
    printed gRPC's own log lines ("E1203 ... ssl_transport_security.cc ...") before the
    error, which blamed an unreachable daemon."""
    address = daemon.address
    plaintext = kvgraft("--server", address, "--tls", "ls")
    assert plaintext.returncode == 1
    assert plaintext.stderr == (
        f"kvgraft: error: UNAVAILABLE: kvgraftd at {address} does not speak TLS (its answer "
        "is not a TLS handshake): leave out --tls, --tls-ca, --tls-cert, --tls-key and "
        "--tls-server-name (and KVGRAFT_TLS*), or check that --server names the daemon\n"
    )

    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("not a certificate\n")
    result = kvgraft("--server", address, "--tls-ca", str(not_pem), "ls")
    assert result.returncode == 1
    assert result.stderr == (
        f"kvgraft: error: INVALID_ARGUMENT: --tls-ca {not_pem} is not a PEM file: give the "
        "certificate of the CA that signed the daemon's certificate in PEM form (a text "
        "file with a -----BEGIN CERTIFICATE----- line; KVGRAFT_TLS_CA takes it too)\n"
    )

    garbled = tmp_path / "ca.pem"  # PEM on its face, no certificate inside
    garbled.write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n")
    result = kvgraft("--server", address, "--tls-ca", str(garbled), "ls")
    assert result.returncode == 1
    assert result.stderr == (
        "kvgraft: error: UNAVAILABLE: the TLS settings could not be loaded: --tls-ca "
        "(KVGRAFT_TLS_CA) must hold PEM certificates of the CA that signed the daemon's "
        "certificate, and --tls-cert with --tls-key a PEM client certificate and its own "
        "private key\n"
    )


def test_an_address_without_a_port_means_port_50551() -> None:
    """Regression: `--server localhost` went to port 443. Whether a daemon answers on
    50551 here or not, the address the command used is in its answer."""
    for flag, env, expected in (
        (["--server", "127.0.0.1"], {}, "127.0.0.1:50551"),
        ([], {"KVGRAFT_SERVER": "[::1]"}, "[::1]:50551"),
    ):
        result = kvgraft(*flag, "--json", "--timeout", "10", "info", env=env)
        document = json.loads(result.stdout)
        said = document["server"] if result.returncode == 0 else document["error"]["message"]
        assert expected in said, said


def test_timeout_bounds_the_calls_that_compute() -> None:
    """Regression: --timeout did not apply to deposit, generate, graft, verify, ask and
    lookup, whose deadline nothing set. The peer accepts connections and never answers,
    so each call lasts its deadline (a call without it would run to the test's)."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        for args in (["generate", "--tokens", "1,2,3"], ["lookup", "--tokens", "1"]):
            result = kvgraft("--server", address, "--json", "--timeout", "0.5", *args)
            assert result.returncode == 1, result.stderr
            assert json.loads(result.stdout)["error"] == {
                "code": "DEADLINE_EXCEEDED",
                "message": f"kvgraftd at {address} did not finish the call within its "
                "deadline of 0.5 s: give it longer with --timeout S (in Python, "
                "Client(compute_timeout_s=S))",
            }


def test_ctrl_c_cancels_the_call_in_one_line() -> None:
    """Regression: Ctrl-C during a call (a long generate) printed a Python traceback
    ending in KeyboardInterrupt."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KVGRAFT_")}
    with socket.create_server(("127.0.0.1", 0)) as silent:
        silent.settimeout(60)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        command = ["generate", "--tokens", "1,2,3"]
        process = subprocess.Popen(
            [sys.executable, "-m", "kvgraft", "--server", address, "--json", *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environment,
            # Python raises KeyboardInterrupt only where SIGINT was not ignored at its start
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            connection, _ = silent.accept()  # the call is under way: it opened the connection
            with connection:
                process.send_signal(signal.SIGINT)
                out, err = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
    message = "interrupted: the call was cancelled"
    assert (process.returncode, err) == (130, f"kvgraft: {message}\n")
    assert json.loads(out) == {"error": {"code": "CANCELLED", "message": message}}
