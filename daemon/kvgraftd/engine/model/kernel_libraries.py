"""The engine's native libraries as Python sees them: found, loaded, their constants read.

Each kernel library (engine/native, built with the package as an extension module) is
a plain shared library that the engine calls through ctypes. `load(module)` is that
library, or None where it was not built (no C compiler: the engine then computes with
torch alone, on its fixed schedule, and says so in its compute profile).

`constants(library, table)` reads the constants and limits the library exports (a
table of names and values that ends with a NULL name: native/constants_table.h) once,
when the library is loaded. The C headers are the one source of every value the two
sides share; Python repeats none, so a changed limit cannot leave a stale copy here.
`named(constants, prefix)` groups a family of them (FORMAT_F32, FORMAT_Q4_1, ... ->
{"f32": ..., "q4_1": ...}).
"""

from __future__ import annotations

import ctypes
import importlib.util


class _Constant(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_int64)]


def load(module: str) -> ctypes.CDLL | None:
    """The built extension `module` (e.g. "kvgraftd.engine.model._linear"), or None where it
    is not."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    return ctypes.CDLL(spec.origin)


def constants(library: ctypes.CDLL, table: str) -> dict[str, int]:
    """The library's exported table `table`, as {name: value}."""
    first = _Constant.in_dll(library, table)
    entries = ctypes.cast(ctypes.addressof(first), ctypes.POINTER(_Constant))
    found: dict[str, int] = {}
    index = 0
    while entries[index].name is not None:
        found[entries[index].name.decode()] = entries[index].value
        index += 1
    return found


def named(constants: dict[str, int], prefix: str) -> dict[str, int]:
    """The constants whose names start with `prefix`, by the rest of the name in lower case."""
    return {
        name.removeprefix(prefix).lower(): value
        for name, value in constants.items()
        if name.startswith(prefix)
    }
