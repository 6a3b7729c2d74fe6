"""The [tenants.NAME] tables of the TOML file: who each tenant's token is, and its shares.

They have no flag and no key of DaemonConfig's flat settings (kvgraftd.config.FIELDS
leaves them out): kvgraftd.ops.command_line reads them with `tenants_of` into
`DaemonConfig.tenants`, and --print-config writes them back. Names are checked as
kvgraft.tenancy allows them; each table needs a token_file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgraft.tenancy import check_tenant_name
from kvgraftd.config.values import ConfigError, parse_bytes


@dataclass(frozen=True)
class TenantConfig:
    """One [tenants.NAME] table: who the token of `token_file` is, and its shares."""

    name: str
    token_file: str
    store_budget_bytes: int = 0  # 0: no budget of its own (the store's still holds)
    max_running_contexts: int = 0  # 0: a fair share (the engine's / the tenants')


TENANT_KEYS = ("token_file", "store_budget_bytes", "max_running_contexts")


def tenants_of(raw: Any, where: str) -> tuple[TenantConfig, ...]:
    """The [tenants.NAME] tables of a TOML file (`where` names it in errors)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: tenants is a table of tables: [tenants.NAME] token_file = ...")
    out = []
    for name, table in raw.items():
        try:
            check_tenant_name(name)
        except ValueError as exc:
            raise ConfigError(f"{where}: [tenants.{name}]: {exc}") from None
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: [tenants.{name}] must be a table with token_file = ...")
        unknown = sorted(set(table) - set(TENANT_KEYS))
        if unknown:
            raise ConfigError(
                f"{where}: unknown key {unknown[0]!r} in [tenants.{name}] (known keys: "
                f"{', '.join(TENANT_KEYS)})"
            )
        if not isinstance(table.get("token_file"), str) or not table["token_file"]:
            raise ConfigError(f'{where}: [tenants.{name}] needs token_file = "/path/to/token"')
        budget = table.get("store_budget_bytes", 0)
        running = table.get("max_running_contexts", 0)
        if isinstance(running, bool) or not isinstance(running, int) or running < 0:
            raise ConfigError(
                f"{where}: [tenants.{name}] max_running_contexts = {running!r}: a whole number "
                "(0 or absent: a fair share of the engine)"
            )
        out.append(
            TenantConfig(
                name, table["token_file"], parse_bytes(budget, "store_budget_bytes"), running
            )
        )
    return tuple(out)
