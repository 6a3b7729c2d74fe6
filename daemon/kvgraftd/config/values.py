"""A setting's value as a configuration gives it: byte sizes, and the error that says
what is wrong (for kvgraftd.config and kvgraftd.config.tenants).

`parse_bytes` takes plain integers or strings with a unit: "64MiB", "2GB", "1.5GiB".
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key and the fix."""


def parse_bytes(value: int | str, key: str = "value") -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{key} = {value!r}: use a byte count such as 1073741824 or 64MiB")
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"{key} = {value!r}: use a byte count such as 1073741824, 64MiB or 2GB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
