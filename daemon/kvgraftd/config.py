"""The daemon's configuration: one frozen dataclass, from defaults, a TOML file and flags.

Every field is both a command-line flag (`--map-initial-bytes`) and a key of
the TOML file (`map_initial_bytes = "1GiB"`); flags win over the file, the file
over the defaults. Unknown keys are an error that names the key. Byte sizes
take plain integers or strings with a unit ("64MiB", "2GB").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_LISTEN = "127.0.0.1:50551"
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


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class DaemonConfig:
    listen: str = _opt(DEFAULT_LISTEN, "address to serve gRPC on (host:port; port 0 picks one)")
    data: Path = _opt(Path("./kvgraft-data"), "data directory (the store and caches)")
    log_level: str = _opt("info", "debug, info, warning or error")
    workers: int = _opt(16, "threads serving RPCs")
    drain_s: float = _opt(30.0, "seconds in-flight calls may take to finish on shutdown")
    map_initial_bytes: int = _opt(1 << 30, "initial LMDB map size; it grows by itself")
    min_free_bytes: int = _opt(256 << 20, "disk space kept free: writes beyond it are refused")
    spill_bytes: int = _opt(256 << 20, "page bytes one upload holds in memory before staging")
    staged_ttl_s: float = _opt(86400.0, "seconds unclaimed staged pages are kept for a resume")
    model: str = _opt(
        "",
        "model: empty for the default (SmolLM2-135M-Instruct), a GGUF file, a Hugging Face "
        "directory, tiny:SEED (a small random test model) or none (store only)",
    )
    model_cache: str = _opt("", "where converted models are cached (default: DATA/models)")
    page_tokens: int = _opt(64, "tokens per KV page")
    block_tokens: int = _opt(4096, "keys per attention block (a multiple of page_tokens)")
    max_context_tokens: int = _opt(32768, "longest context one request may build")

    def __post_init__(self) -> None:
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level {self.log_level!r}: use debug, info, warning or error")
        if ":" not in self.listen:
            raise ConfigError(f"listen {self.listen!r}: use host:port, e.g. {DEFAULT_LISTEN}")
        if self.workers < 1:
            raise ConfigError("workers must be at least 1")
        if self.page_tokens < 1 or self.block_tokens % self.page_tokens:
            raise ConfigError("page_tokens must be >= 1 and block_tokens a multiple of it")
        for name in ("map_initial_bytes", "spill_bytes"):
            if getattr(self, name) < 1 << 20:
                raise ConfigError(f"{name} must be at least 1MiB")


_FIELDS = {f.name: f for f in dataclasses.fields(DaemonConfig)}


def parse_bytes(value: int | str, key: str = "value") -> int:
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"{key} = {value!r}: use a byte count such as 1073741824, 64MiB or 2GB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _coerce(name: str, value: Any) -> Any:
    kind = _FIELDS[name].type
    try:
        if name.endswith("_bytes"):
            return parse_bytes(value, name)
        if kind == "Path":
            return Path(value)
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        return str(value)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{name} = {value!r}: expected {kind}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgraftd",
        description="kvgraft daemon: byte-exact KV-cache artifacts over gRPC.",
    )
    parser.add_argument("--config", type=Path, help="TOML file; any flag below is also a key there")
    parser.add_argument(
        "--print-config", action="store_true", help="print the effective configuration and exit"
    )
    for name, spec in _FIELDS.items():
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=None,
            help=f"{spec.metadata['help']} (default: {spec.default})",
        )
    return parser


def load_config(args: argparse.Namespace) -> DaemonConfig:
    """Defaults, then the TOML file of --config, then the flags given."""
    values: dict[str, Any] = {}
    if args.config is not None:
        values.update(read_toml(args.config))
    for name in _FIELDS:
        given = getattr(args, name)
        if given is not None:
            values[name] = _coerce(name, given)
    return DaemonConfig(**values)


def read_toml(path: Path) -> dict[str, Any]:
    try:
        raw = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in _FIELDS:
            known = ", ".join(sorted(_FIELDS))
            raise ConfigError(f"config file {path}: unknown key {key!r} (known keys: {known})")
        values[key] = _coerce(key, value)
    return values


def _toml_string(text: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's, except DEL must be escaped too."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def to_toml(config: DaemonConfig) -> str:
    lines = []
    for name, spec in _FIELDS.items():
        value = getattr(config, name)
        rendered = _toml_string(str(value)) if isinstance(value, str | Path) else repr(value)
        lines.append(f"# {spec.metadata['help']}\n{name} = {rendered}")
    return "\n".join(lines) + "\n"
