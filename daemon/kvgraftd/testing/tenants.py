"""A kvgraftd configuration with tenants, for tests and benchmarks: token files and the TOML
that names them.

`write_tenants(directory, {"alice": {...}, "bob": {}})` writes an operator token and one
token per tenant (mode 600) and a TOML file whose `[tenants.NAME]` tables carry the given
keys (store_budget_bytes, max_running_contexts); it returns the config's path and each
caller's token file ("operator" for the daemon's own).
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path


def write_tenants(
    directory: Path, tenants: dict[str, dict], extra_toml: str = ""
) -> tuple[Path, dict[str, Path]]:
    directory.mkdir(parents=True, exist_ok=True)
    tokens = {}
    for name in ("operator", *tenants):
        path = directory / f"{name}.token"
        path.write_text(secrets.token_hex(16) + "\n")
        path.chmod(0o600)
        tokens[name] = path
    lines = [f"token_file = {json.dumps(str(tokens['operator']))}", extra_toml]
    for name, keys in tenants.items():
        lines.append(f"[tenants.{name}]")
        lines.append(f"token_file = {json.dumps(str(tokens[name]))}")
        lines += [f"{key} = {json.dumps(value)}" for key, value in keys.items()]
    config = directory / "kvgraftd.toml"
    config.write_text("\n".join(lines) + "\n")
    return config, tokens
