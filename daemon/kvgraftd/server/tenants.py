"""Which services answer a call: the operator's, or the tenant's its token names.

With [tenants] configured (kvgraftd.config.TenantConfig), every call carries a
bearer token (the access interceptor, kvgraftd.server.security, has refused it
otherwise) and the token names its caller: the daemon's own token_file is the
operator, each [tenants.NAME] token_file that tenant. `TenantRoute` hands each
call the caller's `Services`; `tenant_services` (which kvgraftd.main calls) builds
one set per tenant over its kvgraftd.store.tenant_view and
kvgraftd.engine.requests.tenant_engine. The RPCs that act on the whole store (its change
feed, replication, scrubs, the remote tier) are the operator's: a tenant calling
one is refused with PermissionDenied.
Without tenants the operator's services answer every call, as before.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from kvgraft.errors import PermissionDenied
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.config import DaemonConfig
from kvgraftd.engine.requests.tenant_engine import (
    TenantAdmission,
    TenantEngineService,
    tenant_engine,
)
from kvgraftd.library.service import LibraryService
from kvgraftd.remote.service import RemoteService
from kvgraftd.server.grpc_server import Services
from kvgraftd.server.security import TokenCheck
from kvgraftd.store.eviction import CacheBudget
from kvgraftd.store.tenant_view import TenantView

# The RPCs only the operator's token may call once tenants are configured.
OPERATOR_ONLY = frozenset({"Watch", "Replicate", "Scrub", "RemoteStatus", "RemoteSync"})


@dataclass(frozen=True)
class TenantFigures:
    """One tenant's figures, as the metrics endpoint labels them (kvgraftd.ops.metrics)."""

    tenant: str
    artifacts: int  # its artifacts now
    page_bytes: int  # the page bytes they reference (what its budget counts)
    budget_bytes: int  # its store_budget_bytes (0: none of its own)
    evicted_artifacts: int  # evicted to keep it within its budget, since start
    running: int  # its engine requests computing now
    queued: int  # and waiting in its line
    calls: dict[str, int]  # its calls routed, by method, since start


class TenantRoute:
    def __init__(
        self, operator: Services, tenants: Mapping[str, Services], token_check: TokenCheck
    ) -> None:
        self._operator = operator
        self._tenants = dict(tenants)
        self._token_check = token_check
        self._calls: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def figures(self) -> list[TenantFigures]:
        out = []
        with self._lock:
            calls = dict(self._calls)
        for name, services in self._tenants.items():
            stats = services.store.stats(pb.StatsRequest())
            cache = services.store.cache_info()
            batch = services.engine.batch_figures()
            out.append(
                TenantFigures(
                    name,
                    stats.artifacts,
                    stats.page_bytes,
                    cache.budget_bytes,
                    cache.evicted_artifacts,
                    batch.running if batch else 0,
                    batch.queued if batch else 0,
                    {method: n for (tenant, method), n in calls.items() if tenant == name},
                )
            )
        return out

    def caller(self, metadata) -> Services:
        """The services of the caller whose token is in `metadata`."""
        tenant = self._token_check.verify(metadata)
        return self._tenants[tenant] if tenant else self._operator

    def __call__(self, context: grpc.ServicerContext, method: str) -> Services:
        services = self.caller(context.invocation_metadata())
        if services.tenant:
            with self._lock:
                self._calls[services.tenant, method] += 1
        if services.tenant and method in OPERATOR_ONLY:
            raise PermissionDenied(
                f"{method} acts on the whole store, every tenant's artifacts: it is the "
                "operator's; call it with the daemon's token_file"
            )
        return services


def tenant_services(config: DaemonConfig, operator: Services, store) -> dict[str, Services]:
    """One set of services per [tenants.NAME] (kvgraft.tenancy): the store as the tenant
    sees it (one view for its store RPCs and its engine: a tenant's ids never reach the
    remote tier's imports), the engine as it uses it, its library; the operator's remote
    tier and replication are never routed to a tenant (kvgraftd.server.tenants)."""
    running, queued = config.engine_limits()
    count = max(1, len(config.tenants))
    out = {}
    for tenant in config.tenants:
        budget = CacheBudget(bytes=tenant.store_budget_bytes, policy=config.eviction_policy)
        view = TenantView(store, tenant.name, budget)
        own_running = tenant.max_running_contexts or max(1, running // count)
        own_queued = max(1, queued // count)

        def scope(engine, view=view, name=tenant.name, own=(own_running, own_queued)):
            return tenant_engine(engine, view, name, TenantAdmission(engine.admission, *own))

        engine = TenantEngineService(operator.engine, scope)
        out[tenant.name] = Services(
            operator.store.scoped(view, tenant.name),
            engine,
            LibraryService(engine),
            RemoteService(view, operator.store.trust),
            operator.pulls,
            tenant=tenant.name,
        )
    return out
