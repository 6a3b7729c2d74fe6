"""The header of a GGUF file: its key/value metadata and where its tensors lie, not their bytes.

Contract: `read_metadata(path)` returns every key of the file's metadata section with its
value: numbers and booleans as Python's, strings as str, numeric arrays as numpy arrays,
string arrays as lists of str (an array of arrays, or a key given twice, is refused, as
llama.cpp refuses them). `read_header(path)` returns that and the tensors' infos
(name, type number, shape with the fastest dimension first as GGUF writes it, and the
offset of its bytes from the start of the file, the data section's alignment applied).
Both read only the header (a vocabulary-only GGUF, or the first megabytes of a model), in
one pass over a mapping of the file; a file that is not GGUF version 2 or 3 in
little-endian order, that ends inside its header, or whose tensors lie past its end, is
refused with a ValueError naming the file and what is wrong.

Why not gguf-py's GGUFReader: it builds a numpy view of every element of every array,
about ten seconds for Llama 3's 128,256 tokens and 280,147 merges; this is a tenth of a
second. (The format: github.com/ggml-org/ggml/blob/master/docs/gguf.md.)
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

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
DEFAULT_ALIGNMENT = 32  # of the data section, where general.alignment does not say
MAX_DIMS = 4


class TensorInfo(NamedTuple):
    name: str
    type: int  # GGUF's (ggml's) type number
    shape: tuple[int, ...]  # the fastest-varying dimension first (a row's length)
    offset: int  # of its first byte, from the start of the file


class Header(NamedTuple):
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    size: int  # of the file, bytes


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
            raise ValueError(f"{self.name} holds an array of arrays, which GGUF readers refuse")
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
    return read_header(path).metadata


def read_header(path: str | Path) -> Header:
    """The metadata and the tensors' infos of the GGUF file at `path`."""
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


def _read(cursor: _Cursor, name: str) -> Header:
    if bytes(cursor.take(4)) != MAGIC:
        raise ValueError(f"{name} is not a GGUF file (it does not start with 'GGUF')")
    version = cursor.number(_U32)
    if version not in VERSIONS:
        raise ValueError(
            f"{name} is GGUF version {version} (or big-endian); kvgraft reads versions "
            f"{VERSIONS[0]} and {VERSIONS[-1]} in little-endian order"
        )
    tensors = cursor.number(_U64)
    count = cursor.number(_U64)
    metadata: dict[str, Any] = {}
    for _ in range(count):
        key = cursor.string()
        if key in metadata:
            raise ValueError(f"{name} gives the metadata key {key!r} twice")
        metadata[key] = cursor.value(cursor.number(_U32))
    infos = []
    for _ in range(tensors):
        tensor = cursor.string()
        dims = cursor.number(_U32)
        if not 1 <= dims <= MAX_DIMS:
            raise ValueError(f"{name}: tensor {tensor!r} has {dims} dimensions (1 to 4 are read)")
        shape = tuple(cursor.number(_U64) for _ in range(dims))
        infos.append((tensor, cursor.number(_U32), shape, cursor.number(_U64)))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{name}: general.alignment {alignment} is not a power of two")
    start = -(-cursor.at // alignment) * alignment
    size = len(cursor.data)
    placed = [TensorInfo(t, kind, shape, start + offset) for t, kind, shape, offset in infos]
    for tensor in placed:
        if tensor.offset > size:
            raise ValueError(f"{name}: tensor {tensor.name!r} lies past the end of the file")
    return Header(metadata, placed, size)
