"""A real kvgraftd in its own process, for integration tests.

`DaemonProcess.start(data_dir)` runs `python -m kvgraftd --listen
127.0.0.1:0 --http-listen 127.0.0.1:0` (port 0: the kernel picks a free port) and waits for
the log line that names the bound address (`address`; the HTTP API's base URL is
`http_url`). The daemon's stderr is collected in `log_lines` so a failing test can show it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

_SERVING = re.compile(r"serving on (\S+:\d+)")
_HTTP = re.compile(r"OpenAI-compatible API at (\S+)/v1")  # logged before _SERVING


class DaemonProcess:
    def __init__(
        self,
        data_dir: Path,
        extra_args: list[str],
        env: dict[str, str] | None,
        prefix: list[str] | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.extra_args = extra_args
        self.env = env
        self.prefix = list(prefix or [])  # e.g. ["ip", "netns", "exec", NAME]
        self.address = ""
        self.http_url = ""  # e.g. http://127.0.0.1:41234 (the API is under /v1)
        self.log_lines: list[str] = []
        self.proc: subprocess.Popen[str] | None = None

    @classmethod
    def start(
        cls,
        data_dir: Path,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = 60.0,
        prefix: list[str] | None = None,
    ) -> DaemonProcess:
        daemon = cls(data_dir, list(extra_args or []), env, prefix)
        daemon.launch(timeout_s)
        return daemon

    def launch(self, timeout_s: float = 60.0) -> None:
        """(Re)start the process on the same data directory."""
        listen = ["--listen", "127.0.0.1:0"] if "--listen" not in self.extra_args else []
        # Store-only unless a test asks for a model: no torch import, fast starts.
        listen += ["--model", "none"] if "--model" not in self.extra_args else []
        if "--http-listen" not in self.extra_args:
            listen += ["--http-listen", "127.0.0.1:0"]
        self.log_lines = []
        self.proc = subprocess.Popen(
            [
                *self.prefix,
                sys.executable,
                "-m",
                "kvgraftd",
                *listen,
                "--data",
                str(self.data_dir),
                *self.extra_args,
            ],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **(self.env or {})},
        )
        found = threading.Event()

        def pump() -> None:
            assert self.proc is not None and self.proc.stderr is not None
            for line in self.proc.stderr:
                self.log_lines.append(line.rstrip("\n"))
                if http := _HTTP.search(line):
                    self.http_url = http.group(1)
                match = _SERVING.search(line)
                if match and not found.is_set():
                    self.address = match.group(1)
                    found.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not found.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("kvgraftd did not start:\n" + self.log())

    def log(self) -> str:
        return "\n".join(self.log_lines)

    def wait_for_log(self, text: str, timeout_s: float = 10.0) -> int:
        """The index of the first log line containing `text`, once it has been read."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = next((i for i, line in enumerate(self.log_lines) if text in line), None)
            if found is not None:
                return found
            assert time.monotonic() < deadline, f"no log line with {text!r}:\n{self.log()}"
            time.sleep(0.02)

    @property
    def metrics_url(self) -> str:
        """The Prometheus endpoint of a daemon started with --metrics-listen."""
        line = next(line for line in self.log_lines if "metrics on " in line)
        return line.split("metrics on ", 1)[1]

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit status."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        """SIGKILL: no chance to clean up, as in a crash."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.terminate(30)
            except subprocess.TimeoutExpired:
                self.kill()


def wait_model_ready(address: str, timeout_s: float = 300.0, token_file=None) -> None:
    """Block until the daemon at `address` reports its model ready (it loads in the
    background); `token_file`: a daemon that requires a token (a tenant's will do)."""
    from kvgraft import Client

    deadline = time.monotonic() + timeout_s
    with Client(address, token_file=token_file) as client:
        while True:
            state = client.info().model_state
            if state == "ready":
                return
            if state.startswith("failed") or state == "none" or time.monotonic() > deadline:
                raise RuntimeError(f"the model at {address} is not ready: {state}")
            time.sleep(0.2)
