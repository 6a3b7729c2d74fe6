"""A setting's value as a configuration gives it: its conversion to the setting's type,
the range of every numeric setting, byte sizes, and the error that says what is wrong
(for kvgraftd.config and kvgraftd.config.tenants).

`convert` turns a value from a flag or the TOML file into the setting's type (byte sizes
through `parse_bytes`, which takes plain integers or strings with a unit: "64MiB", "2GB",
"1.5GiB"); `check_bounds` refuses a numeric setting outside BOUNDS. Neither knows the
configuration's dataclass: kvgraftd.config names the type and passes the object.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from kvgraft.artifact import MAX_PAGE_BYTES

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


# The range of every numeric setting, both ends included (None: no upper end). The
# upper ends keep values inside what the libraries take: gRPC's options are 32-bit
# integers (milliseconds, bytes), an LMDB map must fit the address space.
_DAY_S = 86400.0
BOUNDS: dict[str, tuple[float, float | None]] = {
    "workers": (1, 4096),
    "drain_s": (0, _DAY_S),
    "map_initial_bytes": (1 << 20, 1 << 40),
    "min_free_bytes": (0, None),
    "spill_bytes": (1 << 20, 1 << 40),
    "upload_memory_bytes": (MAX_PAGE_BYTES, None),  # a page arriving in pieces fits
    "staged_ttl_s": (0, 365 * _DAY_S),
    "staged_max_bytes": (0, None),
    "staged_max_bytes_per_connection": (0, None),
    "store_budget_bytes": (0, None),
    "store_budget_artifacts": (0, None),
    "conversation_budget_bytes": (0, None),
    "scrub_interval_s": (0, 365 * _DAY_S),
    "scrub_bytes_per_s": (1 << 20, None),
    "malloc_top_pad_bytes": (0, 1 << 30),
    "page_tokens": (1, 1 << 16),
    "block_tokens": (1, 1 << 24),
    "max_context_tokens": (0, 1 << 30),
    "max_batch_tokens": (1, 1 << 16),
    "max_batch_rows": (1, 1 << 12),
    "max_running_contexts": (1, 1 << 16),
    "max_queued_requests": (0, 1 << 20),
    "max_live_kv_bytes": (0, None),
    "device_budget_bytes": (0, None),
    "host_budget_bytes": (0, None),
    "max_concurrent_rpcs": (1, 1 << 16),
    "max_follow_streams": (1, 1 << 12),
    "max_streams_per_connection": (1, 1 << 16),
    "max_request_bytes": (4 << 20, 1 << 30),  # at least PutArtifact's 4 MiB messages
    "max_call_s": (0.001, 365 * _DAY_S),
    "put_idle_s": (0.001, _DAY_S),
    "keepalive_s": (0.001, 7 * _DAY_S),
    "keepalive_timeout_s": (0.001, _DAY_S),
    "remote_timeout_s": (0.001, _DAY_S),
    "remote_connections": (1, 1024),
}


def check_bounds(config: Any) -> None:
    """ConfigError for a numeric setting of `config` outside its range in BOUNDS."""
    for name, (least, most) in BOUNDS.items():
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{name} = {value!r}: expected a number")
        if not math.isfinite(value) or value < least or (most is not None and value > most):
            upper = f"..{_number(most)}" if most is not None else " or more"
            raise ConfigError(f"{name} = {value!r}: use a value in {_number(least)}{upper}")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def convert(name: str, value: Any, kind: str) -> Any:
    """`value` (from a flag or the TOML file) as setting `name`, of type `kind` (the
    dataclass field's annotation, a string), holds it; ConfigError if it cannot be."""
    try:
        if name.endswith(("_bytes", "_bytes_per_s")):
            return parse_bytes(value, name)
        if kind == "Path":
            return Path(value)
        if kind == "bool":
            if not isinstance(value, bool):
                raise ConfigError(f"{name} = {value!r}: expected true or false")
            return value
        if kind == "tuple[str, ...]":
            items = value.replace(",", " ").split() if isinstance(value, str) else value
            if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
                raise ConfigError(f"{name} = {value!r}: expected a list of strings")
            return tuple(items)
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ConfigError(f"{name} = {value!r}: expected a whole number")
            return int(value)
        if kind == "float":
            if isinstance(value, bool):
                raise ConfigError(f"{name} = {value!r}: expected a number")
            return float(value)
        if not isinstance(value, str):
            raise ConfigError(f"{name} = {value!r}: expected a string")
        return value
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{name} = {value!r}: expected {kind}") from None
