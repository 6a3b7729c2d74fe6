"""Page bytes read through read-only mappings of segment files, every access guarded.

`SegmentReads` (kvgraftd.store.segment_reads) with its contract, read the fast
way: each page is copied out of a shared mapping of its segment into the
reader's buffer, its xxh3-128 checked in the same pass, by the native module
kvgraftd.store._mapped_pages. A pread copies out of the page cache at about
half a memcpy's rate and the check then reads the page again; the mapping
costs one copy. What made mappings unsafe is caught there: a byte the file no
longer has (cut short under the daemon) or the disk cannot give raises SIGBUS
inside the native copy, whose handler jumps back out of it, and the page is
UnreadPage (a DataLoss), as a short pread would make it. No mapped byte is
touched outside native code under that guard: the copies, and the attention
kernel, which reads a stored page where it lies (`address(location)`, valid
while the segments' `reading()` that asked for it lasts) with the guard's C
functions (`fault_guard()`: their addresses, for the kernel's library); no
view of a mapping is ever handed to Python.

Mappings: one per segment, made at its first read, as long as the file is
then, or the page read needs, or `map_bytes` (the segment size: the active
segment grows into it), whichever is most; a page past a mapping's end maps
the segment again (the older mapping stays until the segment is forgotten: a
reader on another thread may be copying from it). `forget(segment)` and
`close()` unmap: the caller guarantees that no read of the segment is under
way (kvgraftd.store.segments removes a segment only once every read that could
reach it has ended, and closes only once every read has).
`mapped_reads(path_of, map_bytes)` is this reader, or the
pread one where the native module was not built.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from kvgraftd.store.segment_reads import Location, SegmentReads, UnreadPage, WritableBuffer

try:
    from kvgraftd.store import _mapped_pages  # type: ignore[attr-defined]
except ImportError:  # no C compiler where the package was built: pread, one copy slower
    _mapped_pages = None

MAP_ALIGN = 2 << 20  # mappings are made in whole 2 MiB steps (fewer remaps as a file grows)


def fault_guard() -> tuple[int, int] | None:
    """The addresses of the native guard's arm and disarm functions (C: see
    native/mapped_pages.c), or None where the module was not built."""
    if _mapped_pages is None:
        return None
    library = ctypes.CDLL(_mapped_pages.__file__)  # the module already loaded: its symbols
    arm, disarm = library.kvg_fault_guard_arm, library.kvg_fault_guard_disarm
    return ctypes.cast(arm, ctypes.c_void_p).value, ctypes.cast(disarm, ctypes.c_void_p).value


def mapped_reads(path_of: Callable[[int], Path], map_bytes: int) -> SegmentReads:
    """Reads through guarded mappings where the native module exists, else by pread."""
    if _mapped_pages is None:
        return SegmentReads(path_of)
    return MappedSegmentReads(path_of, map_bytes)


class MappedSegmentReads(SegmentReads):
    def __init__(self, path_of: Callable[[int], Path], map_bytes: int) -> None:
        super().__init__(path_of)
        self._map_bytes = max(MAP_ALIGN, map_bytes)
        self._maps: dict[int, tuple[int, int]] = {}  # segment -> (address, length)
        self._outgrown: dict[int, list[tuple[int, int]]] = {}  # older, shorter mappings

    def read(
        self,
        locations: Sequence[Location],
        dests: Sequence[WritableBuffer],
        checksums: Sequence[bytes] | None = None,
    ) -> int | None:
        """Copy each page into its buffer (checked, given `checksums`); see the contract."""
        sources: list[int] = []
        unmapped: UnreadPage | None = None
        for index, location in enumerate(locations):
            try:
                sources.append(self.address(location, index))
            except UnreadPage as unread:  # the pages before it are read first
                unmapped = unread
                break
        count = len(sources)
        bad, why = _mapped_pages.copy_pages(
            sources,
            dests[:count],
            [length for _, _, length in locations[:count]],
            None if checksums is None else b"".join(checksums[:count]),
        )
        if bad >= 0 and why == _mapped_pages.MISMATCH:
            return bad
        if bad >= 0:
            raise UnreadPage(bad, self._fault(locations[bad]))
        if unmapped is not None:
            raise unmapped
        return None

    def read_bytes(self, location: Location) -> bytes:
        """One page's bytes; DataLoss where it cannot be read whole."""
        data = bytearray(location[2])
        self.read([location], [data])
        return bytes(data)

    def forget(self, segment: int) -> None:
        with self._lock:
            mappings = [self._maps.pop(segment, None), *self._outgrown.pop(segment, [])]
        for mapping in mappings:
            if mapping is not None:
                _mapped_pages.unmap(*mapping)
        super().forget(segment)

    def close(self) -> None:
        with self._lock:
            mappings = [*self._maps.values(), *(m for old in self._outgrown.values() for m in old)]
            self._maps.clear()
            self._outgrown.clear()
        for mapping in mappings:
            _mapped_pages.unmap(*mapping)
        super().close()

    def address(self, location: Location, index: int = 0) -> int:
        """Where the page lies in its segment's mapping: for guarded native code only.
        UnreadPage (naming `index`) where its segment cannot be opened or mapped."""
        """Where the page lies in its segment's mapping (mapped, or mapped longer, here)."""
        segment, offset, length = location
        mapped = self._maps.get(segment)
        if mapped is not None and offset + length <= mapped[1]:
            return mapped[0] + offset
        try:
            fd = self._fd(segment)
            size = os.fstat(fd).st_size
            with self._lock:
                mapped = self._maps.get(segment)
                if mapped is None or offset + length > mapped[1]:
                    wanted = max(size, offset + length, self._map_bytes)
                    span = -(-wanted // MAP_ALIGN) * MAP_ALIGN
                    if mapped is not None:
                        self._outgrown.setdefault(segment, []).append(mapped)
                    mapped = self._maps[segment] = (_mapped_pages.map(fd, span), span)
        except OSError as exc:
            self._not_damage(location, exc)
            raise UnreadPage(index, self._unreadable(location, exc)) from None
        return mapped[0] + offset

    def _fault(self, location: Location) -> str:
        """Why the copy of the page at `location` faulted: its file ends before it, or the
        disk could not give its bytes."""
        segment, offset, length = location
        try:
            size = os.fstat(self._fd(segment)).st_size
        except OSError as exc:
            return self._unreadable(location, exc)
        if size < offset + length:
            return self._cut_short(location)
        return self._unreadable(location, OSError(errno.EIO, os.strerror(errno.EIO)))
