"""A GGUF model file read in place: its tensors are views of the file's mapped pages.

Contract: `GgufFile.open(path)` maps the file read-only and reads its header
(kvgraft.text.gguf_metadata); `tensor(name)` is a `GgufTensor`: its GGUF type, its shape
(rows first, as numpy orders it: a weight matrix of N output rows of K inputs is (N, K))
and its bytes, a read-only uint8 view of the mapping (no copy: the weights' memory is the
file's pages, shared with the page cache and every process that maps the same file).
`dequantized(name)` is the float32 array of its weights (kvgraftd.engine.model.gguf_blocks:
gguf-py's values, bit for bit). A tensor of a type the engine does not read, a row whose
length is not a whole number of its type's blocks, or bytes past the end of the file are
refused at open with a ValueError naming the tensor and what is wrong.

The mapping lives as long as any view of it: `close()` lets the file go once no tensor
handed out is referenced any more.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kvgraft.text.gguf_metadata import read_header
from kvgraftd.engine.model import gguf_blocks


class GgufTensor(NamedTuple):
    name: str
    type: int  # GGUF's type number (gguf_blocks.TYPES)
    shape: tuple[int, ...]  # numpy's order: rows first
    data: np.ndarray  # uint8, read-only, in the file's mapping

    @property
    def type_name(self) -> str:
        return _NAMES.get(self.type, str(self.type)).upper()


_NAMES = {number: name for name, number in gguf_blocks.TYPES.items()}


class GgufFile:
    def __init__(self, path: Path, metadata: dict[str, Any], tensors: dict[str, GgufTensor]):
        self.path = path
        self.metadata = metadata
        self._tensors = tensors

    @classmethod
    def open(cls, path: str | Path) -> GgufFile:
        path = Path(path)
        if not gguf_blocks.TYPES:
            raise ValueError(
                f"{path.name}: the native linear library is not built, so no GGUF tensor can "
                "be read (make install builds it)"
            )
        header = read_header(path)
        with open(path, "rb") as file:
            mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        buffer = np.frombuffer(mapping, np.uint8)  # holds the mapping while views live
        tensors = {}
        for info in header.tensors:
            if info.type not in _NAMES:
                read = ", ".join(name.upper() for name in gguf_blocks.TYPES)
                raise ValueError(
                    f"{path.name}: tensor {info.name!r} is of GGUF type {info.type}, which "
                    f"kvgraft does not read; it reads {read}"
                )
            weights, size = gguf_blocks.block_size(info.type)
            if info.shape[0] % weights:
                raise ValueError(
                    f"{path.name}: tensor {info.name!r} has rows of {info.shape[0]} weights, "
                    f"not whole {_NAMES[info.type].upper()} blocks of {weights}"
                )
            nbytes = math.prod(info.shape) // weights * size
            if info.offset + nbytes > header.size:
                raise ValueError(
                    f"{path.name}: tensor {info.name!r} ends past the end of the file "
                    "(a truncated download?)"
                )
            data = buffer[info.offset : info.offset + nbytes]
            shape = tuple(reversed(info.shape))
            tensors[info.name] = GgufTensor(info.name, info.type, shape, data)
        return cls(path, header.metadata, tensors)

    def names(self) -> list[str]:
        return list(self._tensors)

    def tensor(self, name: str) -> GgufTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{self.path.name} has no tensor {name!r}") from None

    def dequantized(self, name: str) -> np.ndarray:
        """The tensor's weights as float32, in its shape."""
        tensor = self.tensor(name)
        values = gguf_blocks.dequantize(tensor.type, tensor.data, math.prod(tensor.shape))
        return values.reshape(tensor.shape)

    def close(self) -> None:
        """Let the file's mapping go (once no view of a tensor is referenced)."""
        self._tensors = {}
