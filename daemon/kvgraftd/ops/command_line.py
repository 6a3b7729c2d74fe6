"""kvgraftd's command line and configuration file: flags, the TOML file of --config, and
--print-config.

Every setting (a field of kvgraftd.config.DaemonConfig) has one name and two spellings:

* a flag: `map_initial_bytes` is `--map-initial-bytes`;
* a key of the TOML file: `map_initial_bytes = "1GiB"` at the top of the file, except
  the settings of replication, trust and the remote tier (TABLES), which go in the table
  their name starts with: `trust_keys` is `keys` under `[trust]`.

--print-config, the README and daemon/systemd/kvgraftd.toml all write that one spelling.
A file may also give a table's setting flat at the top (`trust_keys = [...]`, as files
printed before the tables did); a setting given both ways, an unknown key and an unknown
table are refused by name. Lists are TOML arrays in the file; a flag takes them
comma-separated. Flags win over the file, the file over the defaults.
"""

from __future__ import annotations

import argparse
import json
import tomllib
from collections.abc import Iterator
from dataclasses import Field
from pathlib import Path
from typing import Any

from kvgraft import __version__
from kvgraftd.config import FIELDS, ConfigError, DaemonConfig, coerce
from kvgraftd.config.tenants import tenants_of

TABLES = ("replication", "trust", "remote")
LIST_TYPE = "tuple[str, ...]"
BYTE_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))

SPELLING = """\
Every setting is a flag and a key of the TOML file of --config: --map-initial-bytes is
map_initial_bytes at the top of the file, and a setting of replication, trust or the
remote tier is a key of its table: --trust-keys is keys under [trust]. Flags win over the
file. Byte sizes take integers or units ("64MiB", "2GB"); lists are TOML arrays in the
file and comma-separated after a flag."""


def table_of(name: str) -> str:
    """The TOML table a setting goes in ("" for the top of the file)."""
    prefix = name.split("_", 1)[0]
    return prefix if prefix in TABLES else ""


def _settings_of(table: str) -> Iterator[tuple[str, Field]]:
    return ((name, spec) for name, spec in FIELDS.items() if table_of(name) == table)


def _key(name: str) -> str:
    """A setting's key in its table (or at the top): `keys` for trust_keys."""
    table = table_of(name)
    return name.removeprefix(f"{table}_") if table else name


# ----------------------------------------------------------------------
# flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgraftd",
        description="kvgraft daemon: byte-exact KV-cache artifacts over gRPC.",
        epilog=SPELLING,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvgraftd {__version__}")
    parser.add_argument(
        "--config", type=Path, help="TOML file: every flag below is a key there (see the end)"
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the effective configuration and exit"
    )
    for table in ("", *TABLES):
        group = parser.add_argument_group(
            f"[{table}] table of the TOML file" if table else "settings (TOML: top of the file)"
        )
        for name, spec in _settings_of(table):
            is_list = spec.type == LIST_TYPE
            group.add_argument(
                "--" + name.replace("_", "-"),
                dest=name,
                default=None,
                metavar="A,B,..." if is_list else None,
                # argparse %-formats help strings: a literal % must be doubled.
                help=(spec.metadata["help"] + _default_text(name, spec.default)).replace("%", "%%"),
                **({"action": argparse.BooleanOptionalAction} if spec.type == "bool" else {}),
            )
    return parser


def _default_text(name: str, default: Any) -> str:
    """How --help shows a default: none for "" (each such help says what empty means)."""
    if default == "":
        return ""
    if default == ():
        return " (default: none)"
    if isinstance(default, bool):
        return f" (default: {'on' if default else 'off'})"
    if name.endswith(("_bytes", "_bytes_per_s")) and default:
        unit = next(((u, size) for u, size in BYTE_UNITS if default % size == 0), None)
        return f" (default: {default // unit[1]}{unit[0]})" if unit else f" (default: {default})"
    return f" (default: {default})"


def load_config(args: argparse.Namespace) -> DaemonConfig:
    """Defaults, then the TOML file of --config, then the flags given."""
    values: dict[str, Any] = {}
    if args.config is not None:
        values.update(read_toml(args.config))
    for name in FIELDS:
        given = getattr(args, name)
        if given is not None:
            values[name] = coerce(name, given)
    return DaemonConfig(**values)


# ----------------------------------------------------------------------
# the TOML file


def read_toml(path: Path) -> dict[str, Any]:
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory: give the TOML file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not text: give a TOML file") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    values: dict[str, Any] = {}
    if "tenants" in raw:  # [tenants.NAME] tables: a name of the operator's choosing each
        values["tenants"] = tenants_of(raw.pop("tenants"), f"config file {path}")
    for name, spelled, value in _settings_in(path, raw):
        if name not in FIELDS:
            known = ", ".join(_spelled(known) for known in FIELDS)
            raise ConfigError(f"config file {path}: unknown key {spelled} (known keys: {known})")
        if name in values:
            raise ConfigError(
                f"config file {path}: {_spelled(name)} is given twice (also as {name} at the "
                f"top): keep one"
            )
        values[name] = coerce(name, value)
    return values


def _settings_in(path: Path, raw: dict[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """(setting name, as the file spells it, value) of every key of the file."""
    for key, value in raw.items():
        if not isinstance(value, dict):
            yield key, repr(key), value
            continue
        if key not in TABLES:
            tables = ", ".join(f"[{table}]" for table in TABLES)
            raise ConfigError(
                f"config file {path}: unknown table [{key}] (the tables are {tables}; the "
                "other keys go at the top of the file, before any table)"
            )
        for sub, item in value.items():
            yield f"{key}_{sub}", f"{sub!r} in [{key}]", item


def _spelled(name: str) -> str:
    """A setting as the TOML file spells it: `listen`, `keys in [trust]`."""
    table = table_of(name)
    return f"{_key(name)} in [{table}]" if table else name


def _toml_string(text: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's, except DEL must be escaped too."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | Path):
        return _toml_string(str(value))
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_string(item) for item in value) + "]"
    return repr(value)


def to_toml(config: DaemonConfig) -> str:
    """The configuration as a TOML file: a header on the spelling, then every setting with its
    help, the tables last (TOML puts a table's keys after its header, to the next one)."""
    header = "".join(f"# {line}\n" for line in SPELLING.splitlines())
    blocks = [header]
    for table in ("", *TABLES):
        lines = [f"[{table}]"] if table else []
        for name, spec in _settings_of(table):
            lines.append(f"# {spec.metadata['help']}")
            lines.append(f"{_key(name)} = {_toml_value(getattr(config, name))}")
        blocks.append("\n".join(lines) + "\n")
    for tenant in config.tenants:  # [tenants.NAME]: a tenant's token names it (README)
        lines = [f"[tenants.{tenant.name}]", f"token_file = {_toml_string(tenant.token_file)}"]
        if tenant.store_budget_bytes:
            lines.append(f"store_budget_bytes = {tenant.store_budget_bytes}")
        if tenant.max_running_contexts:
            lines.append(f"max_running_contexts = {tenant.max_running_contexts}")
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)
