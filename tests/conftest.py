"""Shared fixtures: a real daemon per test on a temporary store, and a client to it."""

from __future__ import annotations

import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgraft import Client
from kvgraftd.testing.daemon_process import DaemonProcess


@pytest.fixture
def rng(request) -> random.Random:
    return random.Random(request.node.name)


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator:
    """Start daemons on demand: start_daemon(data_dir=None, extra_args=None)."""
    started: list[DaemonProcess] = []

    def start(data_dir: Path | None = None, extra_args: list[str] | None = None, **kwargs):
        daemon = DaemonProcess.start(
            data_dir or tmp_path / f"data{len(started)}", extra_args, **kwargs
        )
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()


@pytest.fixture
def daemon(start_daemon) -> DaemonProcess:
    return start_daemon()


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[Client]:
    with Client(daemon.address, timeout_s=30) as c:
        yield c


# The real default model, converted from its GGUF once and cached here across
# test runs (the conversion takes ~30 s; a cached load ~2 s). Ignored by git.
MODEL_CACHE = Path(__file__).resolve().parent.parent / ".cache" / "models"


@pytest.fixture(scope="session")
def real_model():
    """The default model's adapter, loaded in-process (once per session)."""
    from kvgraftd.engine.model_adapter import ModelAdapter

    return ModelAdapter.load(None, MODEL_CACHE)


@pytest.fixture(scope="session")
def real_model_args(real_model) -> list[str]:
    """Daemon flags serving the default model from the shared cache (already converted)."""
    return ["--model", "", "--model-cache", str(MODEL_CACHE)]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 32 MiB tmpfs: a filesystem that really fills up."""
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)
