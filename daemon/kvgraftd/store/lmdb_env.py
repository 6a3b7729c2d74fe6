"""One LMDB environment with named sub-databases: transactions, map growth, disk reserve.

Contract:
* `read()` yields a read transaction whose values are buffers (views into
  the map, valid until the transaction ends); any number run at once.
* `write(needed_bytes, body, file_bytes=0)` runs `body(txn)` in one write transaction
  (writers are serialized) and returns its result. When the map is full it
  grows the map and runs `body` again from the start, so a body must not
  have effects outside its transaction. A write that would eat into
  `min_free_bytes` of the disk is refused with ResourceExhausted before it
  starts, counting the space LMDB can reuse inside its file (`file_bytes`,
  what the body writes outside LMDB, cannot reuse it); a disk that
  fills anyway (another process wrote meanwhile) fails the write cleanly
  (ResourceExhausted), never the process: LMDB reports a short write as
  EIO, which a full disk explains.
  Writes with needed_bytes == 0 (deletes, pins) may use the reserve: they
  are how an operator frees space.
* The map is read-only to the process (writemap=False); LMDB writes pages
  with pwrite and syncs before a commit returns. A writable map is slower for
  large values on the disks measured here, and a full disk under it kills
  the process with SIGBUS.
* The reader table (LMDB's `lock.mdb`, written through a shared mapping) has
  its blocks allocated at open: LMDB creates it sparse, and a reader taking
  a slot on a page never written before, on a full disk, would be SIGBUS.
* `close()` waits for every open transaction.
* A store directory that cannot be reached any more (deleted, unmounted or made
  unreadable under the running daemon) is the operator's to fix, not a bug:
  the free-space check fails FailedPrecondition in words (`unreachable_store`), which
  kvgraftd.store.service's Info and Stats answer too.

kvgraftd.store.artifact_store holds what the data means; this module only how it is kept.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import lmdb

from kvgraft.errors import FailedPrecondition, ResourceExhausted

log = logging.getLogger(__name__)

LMDB_PAGE_BYTES = 4096
T = TypeVar("T")


class _ResizeGate:
    """Many transactions at once, or one map resize with none open.

    LMDB's mdb_env_set_mapsize is only safe while this process has no open
    transaction: a resize remaps the file and would pull the memory out from
    under a reader's buffers.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = 0
        self._resizing = False

    @contextmanager
    def open_txn(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._open += 1
        try:
            yield
        finally:
            with self._cond:
                self._open -= 1
                if not self._open:
                    self._cond.notify_all()

    @contextmanager
    def resize(self) -> Iterator[None]:
        with self._cond:
            self._resizing = True
            while self._open:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


class LmdbEnv:
    """The LMDB environment in directory `path` with sub-databases `names`."""

    def __init__(
        self, path: Path, names: Sequence[str], *, initial_map_bytes: int, min_free_bytes: int
    ) -> None:
        self.path = path
        self._min_free_bytes = min_free_bytes
        self._env = lmdb.open(
            str(path),
            map_size=initial_map_bytes,
            max_dbs=len(names) + 1,
            max_readers=1024,
            writemap=False,
        )
        self.db = {name: self._env.open_db(name.encode()) for name in names}
        try:
            self._allocate_reader_table()
        except BaseException:
            self._env.close()
            raise
        self._write_lock = threading.Lock()
        self._gate = _ResizeGate()

    def close(self) -> None:
        with self._write_lock, self._gate.resize():
            self._env.close()

    def open_db(self, name: str):
        """A sub-database not in `names` (one at most), e.g. one an old format had."""
        return self._env.open_db(name.encode())

    @contextmanager
    def read(self) -> Iterator[lmdb.Transaction]:
        with self._gate.open_txn(), self._env.begin(buffers=True) as txn:
            yield txn

    def write(
        self, needed_bytes: int, body: Callable[[lmdb.Transaction], T], *, file_bytes: int = 0
    ) -> T:
        """Run `body` in one write transaction, growing the map as needed."""
        with self._write_lock:
            self._check_free_space(needed_bytes, file_bytes)
            while True:
                try:
                    # buffers=True: reads inside a write return views, not copies of pages;
                    # every body uses a view before its next write in the transaction.
                    with self._gate.open_txn(), self._env.begin(write=True, buffers=True) as txn:
                        return body(txn)
                except lmdb.MapFullError:
                    self._grow_map(needed_bytes)
                except lmdb.Error as exc:
                    if "No space left" not in str(exc) and not self._full(needed_bytes):
                        raise
                    raise ResourceExhausted(
                        f"the disk holding {self.path} is full; nothing was written. Free disk "
                        "space or delete artifacts (kvgraft rm ID)."
                    ) from None

    def map_bytes(self) -> tuple[int, int]:
        """(map size, bytes of the map in use)."""
        info = self._env.info()
        return info["map_size"], (info["last_pgno"] + 1) * LMDB_PAGE_BYTES

    def _check_free_space(self, needed_bytes: int, file_bytes: int) -> None:
        if not needed_bytes and not file_bytes:
            return
        free = self._free_bytes()
        needed = _with_overhead(needed_bytes)
        # Pages freed by deletes are reused before the file grows.
        growth = max(0, needed - self._reusable_bytes()) + file_bytes
        if free - growth < self._min_free_bytes:
            raise ResourceExhausted(
                f"the disk holding {self.path} has {_mib(free)} free; this write needs "
                f"{_mib(growth)} more and kvgraftd keeps "
                f"min_free_bytes={_mib(self._min_free_bytes)} in reserve. Free disk space, "
                "delete artifacts (kvgraft rm ID) or lower --min-free-bytes."
            )

    def _full(self, needed_bytes: int) -> bool:
        """Whether the disk lacks room for a transaction of `needed_bytes` (a failed commit:
        LMDB says EIO where a write came back short, which a full disk does)."""
        return self._free_bytes() < _with_overhead(needed_bytes)

    def _free_bytes(self) -> int:
        try:
            return shutil.disk_usage(self.path).free
        except OSError as exc:
            raise unreachable_store(exc) from None

    def _allocate_reader_table(self) -> None:
        fd = os.open(self.path / "lock.mdb", os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            os.posix_fallocate(fd, 0, size)  # blocks for every slot; no byte of it changes
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise ResourceExhausted(
                f"the disk holding {self.path} is full: the store cannot reserve its reader "
                f"table ({size >> 10} KiB). Free disk space, then start again."
            ) from None
        finally:
            os.close(fd)

    def _reusable_bytes(self) -> int:
        """Bytes of LMDB's file that no tree uses (freed pages, reused before growing)."""
        with self.read() as txn:
            used = sum(
                stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
                for stat in [txn.stat(db) for db in self.db.values()] + [self._env.stat()]
            )
        return max(0, self._env.info()["last_pgno"] + 1 - 2 - used) * LMDB_PAGE_BYTES

    def _grow_map(self, needed_bytes: int) -> None:
        current = self._env.info()["map_size"]
        target = max(2 * current, current + 2 * needed_bytes)
        with self._gate.resize():
            self._env.set_mapsize(target)
        log.info("store map grown from %d MiB to %d MiB", current >> 20, target >> 20)


def unreachable_store(exc: OSError) -> FailedPrecondition:
    """What to say when the store's files cannot be reached: `exc` names the path."""
    return FailedPrecondition(
        f"the store's files cannot be reached ({exc.strerror or exc}: {exc.filename}): was "
        "the data directory deleted, unmounted or made unreadable while kvgraftd ran? "
        "Restore it, then restart kvgraftd (on an empty data directory it starts an empty store)"
    )


def _with_overhead(needed_bytes: int) -> int:
    """What a transaction of `needed_bytes` may take: LMDB rounds values up to whole 4 KiB
    pages and copies tree pages."""
    return needed_bytes + needed_bytes // 16 + (1 << 20)


def _mib(count: int) -> str:
    return f"{count / (1 << 20):.1f} MiB"
