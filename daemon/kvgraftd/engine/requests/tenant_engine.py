"""The engine as one tenant uses it: its store view, its share of the engine, its labels.

One model, one batcher, one set of tiers serve every tenant; what differs per tenant
is what a request may reuse and keep, and how many of its requests run at once.
`tenant_engine` makes that engine's tenant-facing copy (`Engine.for_tenant`: every model,
batcher and tier object shared) whose store is the tenant's kvgraftd.store.tenant_view (so
a prompt grafts only its own and the shared pages, and a deposit is labelled as its),
and whose admission is `TenantAdmission`: the tenant's own limit first, then the
engine's, so a tenant's flood queues and is refused (ResourceExhausted) in its own
line while another tenant's requests take the places the engine has left.
`TenantEngineService` is the EngineService that hands out that copy once the model is
loaded; until then it answers as the daemon's engine service does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from kvgraftd.engine.requests.service import EngineService
from kvgraftd.engine.scheduling.admission import Admission

if TYPE_CHECKING:  # the engine imports torch; a store-only daemon never does
    from kvgraftd.engine.requests.engine import Engine


class TenantAdmission:
    """A tenant's place in the engine: one of its own `max_running` (its line holding
    `max_queued`), then one of the engine's."""

    def __init__(self, engine: Admission, max_running: int, max_queued: int) -> None:
        self.own = Admission(max_running, max_queued)
        self.engine = engine

    @contextmanager
    def admitted(
        self, is_active: Callable[[], bool] | None = None, kv_bytes: int = 0
    ) -> Iterator[None]:
        with self.own.admitted(is_active), self.engine.admitted(is_active, kv_bytes):
            yield

    @property
    def running(self) -> int:
        return self.own.running

    @property
    def queued(self) -> int:
        return self.own.queued

    @property
    def live_kv_bytes(self) -> int:
        return self.engine.live_kv_bytes

    @property
    def max_live_kv_bytes(self) -> int:
        return self.engine.max_live_kv_bytes


def tenant_engine(engine: Engine, store, tenant: str, admission: TenantAdmission) -> Engine:
    """`engine` as `tenant` uses it (see the module's docstring)."""
    return engine.for_tenant(store, tenant, admission)


class TenantEngineService(EngineService):
    """`base`'s engine, once loaded, as `scope` makes it for one tenant."""

    def __init__(self, base: EngineService, scope: Callable[[Engine], Engine]) -> None:
        # EngineService.__init__ is not run: the model's load is base's
        self._base = base
        self._scope = scope
        self._scoped: Engine | None = None
        self._scoping = threading.Lock()

    @property
    def _engine(self) -> Engine | None:
        engine = self._base._engine
        if engine is None:
            return None
        with self._scoping:
            if self._scoped is None:
                self._scoped = self._scope(engine)
            return self._scoped

    @property
    def _floor(self):
        return self._base._floor

    @property
    def _error(self):
        return self._base._error

    @property
    def _started(self) -> float:
        return self._base._started

    @property
    def _ready(self) -> threading.Event:
        return self._base._ready

    @property
    def _enabled(self) -> bool:
        return self._base._enabled
