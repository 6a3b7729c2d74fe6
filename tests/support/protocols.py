"""Holding a class to a typing.Protocol it implements, signatures included.

`isinstance` with a runtime-checkable Protocol checks only that the names exist;
`mismatches(cls, protocol)` also compares each method's parameters with the
Protocol's: the same names and kinds in the same order, a default wherever the
Protocol has one, and a default on every parameter the Protocol does not name.
Data members (annotations without a value) are checked on an instance when one is
given (they are set in `__init__`).
"""

from __future__ import annotations

import inspect
from typing import Protocol


def protocol_members(protocol: type) -> tuple[set[str], set[str]]:
    """(methods and properties, data members) a Protocol declares, those of the Protocols
    it extends too."""
    methods: set[str] = set()
    data: set[str] = set()
    for base in protocol.__mro__:
        if base in (Protocol, object) or not getattr(base, "_is_protocol", False):
            continue
        methods |= {
            name
            for name, value in vars(base).items()
            if (callable(value) or isinstance(value, property)) and not name.startswith("__")
        }
        data |= set(getattr(base, "__annotations__", {}))
    return methods, data


def public_methods(cls: type) -> set[str]:
    """The public methods (and properties) of a class and its bases."""
    return {
        name
        for base in cls.__mro__
        if base is not object
        for name, value in vars(base).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }


def mismatches(cls: type, protocol: type, instance: object | None = None) -> list[str]:
    """What keeps `cls` from implementing `protocol`, in words (empty: nothing)."""
    methods, data = protocol_members(protocol)
    found: list[str] = []
    for name in sorted(methods):
        implemented = getattr(cls, name, None)
        if implemented is None:
            found.append(f"{cls.__name__} lacks {name}")
            continue
        if isinstance(inspect.getattr_static(cls, name), property):
            continue  # a property declared as one
        declared = list(inspect.signature(getattr(protocol, name)).parameters.values())
        offered = list(inspect.signature(implemented).parameters.values())
        found += [f"{cls.__name__}.{name}: {why}" for why in _incompatible(declared, offered)]
    if instance is not None:
        found += [f"{cls.__name__} has no {n}" for n in sorted(data) if not hasattr(instance, n)]
    return found


def _incompatible(declared: list, offered: list) -> list[str]:
    if len(offered) < len(declared):
        return [f"takes {len(offered)} parameters, the Protocol {len(declared)}"]
    out = []
    for want, have in zip(declared, offered, strict=False):
        if (want.name, want.kind) != (have.name, have.kind):
            out.append(f"parameter {have.name} ({have.kind}) where the Protocol has {want.name}")
        elif _has_default(want) and not _has_default(have):
            out.append(f"parameter {have.name} has no default, the Protocol's has one")
    for extra in offered[len(declared) :]:
        if not _has_default(extra) and extra.kind not in (extra.VAR_POSITIONAL, extra.VAR_KEYWORD):
            out.append(f"parameter {extra.name} is not declared and has no default")
    return out


def _has_default(parameter: inspect.Parameter) -> bool:
    return parameter.default is not inspect.Parameter.empty
