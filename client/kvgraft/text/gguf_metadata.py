"""The key/value metadata of a GGUF file, read without its tensors.

Contract: `read_metadata(path)` returns every key of the file's metadata section with its
value: numbers and booleans as Python's, strings as str, numeric arrays as read-only numpy
arrays, string arrays as lists of str. It reads only the header and the metadata (a
vocabulary-only GGUF or the first megabytes of a model), in one pass over a mapping of the
file; a file that is not GGUF version 2 or 3 in little-endian order, or that ends inside
its metadata, is refused with a ValueError naming the file and what is wrong.

Why not gguf-py's GGUFReader: it builds a numpy view of every element of every array,
about ten seconds for Llama 3's 128,256 tokens and 280,147 merges; this is a tenth of a
second. (The format: github.com/ggml-org/ggml/blob/master/docs/gguf.md.)
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)

# value types of the format, numbered as in the spec
STRING, ARRAY = 8, 9
_SCALARS = {
    0: struct.Struct("<B"),
    1: struct.Struct("<b"),
    2: struct.Struct("<H"),
    3: struct.Struct("<h"),
    4: struct.Struct("<I"),
    5: struct.Struct("<i"),
    6: struct.Struct("<f"),
    7: struct.Struct("<?"),
    10: struct.Struct("<Q"),
    11: struct.Struct("<q"),
    12: struct.Struct("<d"),
}
_DTYPES = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class _Cursor:
    """Reads the metadata section front to back."""

    def __init__(self, data: memoryview, name: str) -> None:
        self.data, self.at, self.name = data, 0, name

    def take(self, size: int) -> memoryview:
        if self.at + size > len(self.data):
            raise ValueError(f"{self.name} ends inside its metadata: a truncated or not GGUF file")
        piece = self.data[self.at : self.at + size]
        self.at += size
        return piece

    def number(self, kind: struct.Struct) -> Any:
        return kind.unpack(self.take(kind.size))[0]

    def string(self) -> str:
        size = self.number(_U64)
        return str(self.take(size), "utf-8", "replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.number(_SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.number(_U32), self.number(_U64)
            if item in _DTYPES:
                width = np.dtype(_DTYPES[item]).itemsize
                return np.frombuffer(self.take(count * width), _DTYPES[item]).copy()
            if item == STRING:
                return self.strings(count)
            return [self.value(item) for _ in range(count)]
        raise ValueError(f"{self.name} holds a metadata value of unknown type {kind}")

    def strings(self, count: int) -> list[str]:
        data, at, unpack, out = self.data, self.at, _U64.unpack_from, []
        end = len(data)
        for _ in range(count):
            if at + 8 > end:
                self.at = end
                self.take(1)  # raises: truncated
            (size,) = unpack(data, at)
            if at + 8 + size > end:
                self.at = end
                self.take(1)
            out.append(str(data[at + 8 : at + 8 + size], "utf-8", "replace"))
            at += 8 + size
        self.at = at
        return out


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Every metadata key of the GGUF file at `path` and its value."""
    name = str(path)
    with open(path, "rb") as file:
        try:
            mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise ValueError(f"{name} is empty, not a GGUF file") from None
    with mapping:
        view = memoryview(mapping)
        try:
            return _read(_Cursor(view, name), name)
        finally:
            view.release()


def _read(cursor: _Cursor, name: str) -> dict[str, Any]:
    if bytes(cursor.take(4)) != MAGIC:
        raise ValueError(f"{name} is not a GGUF file (it does not start with 'GGUF')")
    version = cursor.number(_U32)
    if version not in VERSIONS:
        raise ValueError(
            f"{name} is GGUF version {version} (or big-endian); kvgraft reads versions "
            f"{VERSIONS[0]} and {VERSIONS[-1]} in little-endian order"
        )
    cursor.number(_U64)  # tensors: not read here
    count = cursor.number(_U64)
    metadata: dict[str, Any] = {}
    for _ in range(count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.number(_U32))
    return metadata
