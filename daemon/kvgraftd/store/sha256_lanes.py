"""SHA-256 of many pages at once: 16 side by side in AVX-512 lanes.

`sha256_digests(pages)` is `[hashlib.sha256(page).digest() for page in pages]`,
digest for digest (the tests compare every one): the pages of one length go
through the native kernel (native/sha256_lanes.c) 16 at a time, about twice
OpenSSL's one-page SHA-NI rate per core. With `copies`, each page is also
copied into its own array in the same pass (the intake's aligned slots: the
bytes hashed are the bytes kept, read once). A call costs as much as 16 pages
whatever its number, so a group of fewer than MIN_LANES_USED pages goes to
hashlib instead, as does everything where the extension was not built or the
CPU lacks AVX-512. The native calls release the GIL (ctypes), so threads hash
side by side.

Pages: contiguous buffers (numpy uint8 arrays, bytes, memoryviews) that do
not change during the call; copies: writable uint8 arrays of the same sizes.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
from collections.abc import Sequence

import numpy as np

LANES = 16
MIN_LANES_USED = 8  # below this, hashlib is as fast as a call that hashes 16


def _load() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("kvgraftd.store._sha256_lanes")
    if spec is None or spec.origin is None:
        return None
    library = ctypes.CDLL(spec.origin)
    if not library.kvg_sha256_lanes_supported():
        return None
    library.kvg_sha256_x16.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int32,
        ctypes.c_size_t,
        ctypes.c_void_p,
    ]
    library.kvg_sha256_x16.restype = None
    return library


_library = _load()


def available() -> bool:
    """Whether the 16-lane kernel runs here (else every page goes through hashlib)."""
    return _library is not None


def sha256_digests(
    pages: Sequence[object], copies: Sequence[np.ndarray] | None = None
) -> list[bytes]:
    """The SHA-256 digest of each page, in order; with `copies`, page i copied to copies[i]."""
    arrays = [np.frombuffer(page, np.uint8) for page in pages]
    if copies is not None and (
        [c.nbytes for c in copies] != [a.nbytes for a in arrays]
        or not all(c.flags.writeable and c.flags.c_contiguous for c in copies)
    ):
        raise ValueError("sha256_digests copies into writable contiguous arrays of each size")
    digests: list[bytes | None] = [None] * len(arrays)
    if _library is not None:
        by_length: dict[int, list[int]] = {}
        for index, array in enumerate(arrays):
            if array.nbytes:
                by_length.setdefault(array.nbytes, []).append(index)
        for length, indexes in by_length.items():
            for lo in range(0, len(indexes), LANES):
                group = indexes[lo : lo + LANES]
                if len(group) >= MIN_LANES_USED:
                    _hash_lanes(_library, arrays, copies, group, length, digests)
    done: list[bytes] = []
    for index, digest in enumerate(digests):
        if digest is None:
            page = arrays[index]
            if copies is not None:
                copies[index][:] = page
                page = copies[index]
            digest = hashlib.sha256(page).digest()
        done.append(digest)
    return done


def _hash_lanes(
    library: ctypes.CDLL,
    arrays: list[np.ndarray],
    copies: Sequence[np.ndarray] | None,
    group: list[int],
    length: int,
    digests: list[bytes | None],
) -> None:
    """digests[i] for each i in `group` (1-16 indexes of arrays of `length` bytes)."""
    addresses = (ctypes.c_void_p * LANES)(*(arrays[index].ctypes.data for index in group))
    to = None
    if copies is not None:
        to = (ctypes.c_void_p * LANES)(*(copies[index].ctypes.data for index in group))
    out = ctypes.create_string_buffer(32 * len(group))
    library.kvg_sha256_x16(addresses, to, len(group), length, out)
    raw = out.raw
    for position, index in enumerate(group):
        digests[index] = raw[32 * position : 32 * position + 32]
