"""Shared fixtures: a real daemon per test on a temporary store, and a client to it; the
daemon's default ports held for the whole run (tests.support.ports)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgraft import Client
from kvgraftd.testing.daemon_process import DaemonProcess
from tests.support.ports import HELD_VARIABLE, DefaultPortHold
from tests.support.small_disks import tmpfs

_HOLD = pytest.StashKey[DefaultPortHold]()


def pytest_configure(config: pytest.Config) -> None:
    """Hold the default ports in the one process that lives through the whole run:
    pytest-xdist's controller, or pytest itself without workers. A worker holds none
    (one socket only can: the controller's), and a port another program holds is left
    to it, so the hold never fails a run."""
    if not hasattr(config, "workerinput"):
        hold = config.stash[_HOLD] = DefaultPortHold()
        os.environ[HELD_VARIABLE] = ",".join(hold.held)  # the workers' environment too


def pytest_unconfigure(config: pytest.Config) -> None:
    hold = config.stash.get(_HOLD, None)
    if hold is not None:
        hold.close()


def pytest_report_header(config: pytest.Config) -> str | None:
    hold = config.stash.get(_HOLD, None)
    return hold.describe() if hold is not None else None


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
    """The default model's adapter, loaded in-process (once per session): the integer
    products (--products int8-dot, the default)."""
    from kvgraftd.engine.model.model_adapter import ModelAdapter

    return ModelAdapter.load(None, MODEL_CACHE)


@pytest.fixture(scope="session")
def real_model_fp32(real_model):
    """The default model with the float products (--products fp32): the same weights."""
    return real_model.with_products("fp32")


@pytest.fixture(scope="session")
def real_model_args(real_model) -> list[str]:
    """Daemon flags serving the default model from the shared cache (already converted)."""
    return ["--model", "", "--model-cache", str(MODEL_CACHE)]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 32 MiB tmpfs: a filesystem that really fills up."""
    with tmpfs(tmp_path / "small-disk") as mount_point:
        yield mount_point
