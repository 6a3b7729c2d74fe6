"""Filesystems that really fill up, for tests of full disks: a tmpfs mounted for a test
(`tmpfs`: skips the test where mounting is impossible, unmounts after) and a file that
takes a filesystem's last bytes (`fill`)."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(mount_point: Path, options: str = "size=32m") -> Iterator[Path]:
    """A tmpfs mounted at `mount_point` (created) with `options` while the block runs."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount_point.mkdir(exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)],
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


def fill(directory: Path, leave: int = 0) -> Path:
    """Fill the filesystem holding `directory` with a file, leaving about `leave` bytes."""
    path = directory / "filler"
    with open(path, "ab") as f:
        try:
            while True:
                f.write(b"\xff" * (64 << 10))
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    if leave:
        os.truncate(path, max(0, path.stat().st_size - leave))
    return path
