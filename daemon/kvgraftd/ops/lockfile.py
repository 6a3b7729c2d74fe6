"""One daemon per data directory, enforced with an advisory lock.

LMDB itself lets several processes share an environment; kvgraftd must not
(one writer, one map-resize policy, one change feed). The lock is an flock on
DATA/kvgraftd.lock holding the owner's pid; the kernel drops it when the
process dies, so a kill -9 never leaves a stale lock.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from kvgraft.errors import FailedPrecondition


class DataDirLock:
    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.path = data_dir / "kvgraftd.lock"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            raise FailedPrecondition(
                f"data directory {data_dir} is in use by another kvgraftd (pid {owner}); "
                "stop that daemon or pass another --data"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
