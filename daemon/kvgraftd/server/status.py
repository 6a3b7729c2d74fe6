"""What Info and Stats answer: the store's figures, the engine's, the remote tier's, and this
process's.

Tiers are listed in lookup order: the engine's device and host tiers, the
store's, then the remote tier last. Stats adds the calls served (CallCounter),
this process's anonymous resident memory (its heap, not the LMDB map's page
cache) and the accelerator's peak allocation; kvgraftd.ops.metrics reads the
same figures through `stats_response`.
"""

from __future__ import annotations

from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.engine.requests.service import EngineService
from kvgraftd.remote.service import RemoteService
from kvgraftd.server.telemetry import CallCounter
from kvgraftd.store.service import StoreService


def info_response(
    service: StoreService,
    engine: EngineService,
    request: pb.InfoRequest,
    remote: RemoteService,
) -> pb.InfoResponse:
    response = service.info(request)
    engine.describe(response)
    _prepend_tiers(response, engine.tier_infos())
    response.tiers.extend(remote.tier_infos())  # the remote tier is looked up last
    return response


def _stats(
    service: StoreService,
    engine: EngineService,
    counter: CallCounter,
    request: pb.StatsRequest,
    remote: RemoteService,
) -> pb.StatsResponse:
    response = service.stats(request)
    response.rpc_calls.update(counter.snapshot())
    _prepend_tiers(response, engine.tier_infos())
    response.tiers.extend(remote.tier_infos())
    response.rss_anon_bytes = rss_anon_bytes()
    response.device_max_allocated_bytes = engine.device_max_allocated_bytes()
    return response


def stats_response(
    service: StoreService,
    engine: EngineService,
    counter: CallCounter,
    remote: RemoteService,
    request: pb.StatsRequest | None = None,
) -> pb.StatsResponse:
    """What Stats answers; the metrics endpoint (kvgraftd.ops.metrics) reads the same figures."""
    return _stats(service, engine, counter, request or pb.StatsRequest(), remote)


def own_figures(response: pb.InfoResponse | pb.StatsResponse) -> None:
    """What a tenant is told of the daemon (kvgraft.tenancy): its own store figures and
    budget, which its services filled in; the tiers, call counts, memory and scrub, which
    every tenant's traffic moves, are left out."""
    del response.tiers[:]
    if isinstance(response, pb.StatsResponse):
        response.rpc_calls.clear()
        response.rss_anon_bytes = response.device_max_allocated_bytes = 0
    else:
        response.ClearField("scrub")


def _prepend_tiers(response, tiers: list[pb.TierInfo]) -> None:
    """Tiers in lookup order: the engine's device and host tiers, then the store's."""
    stored = list(response.tiers)
    del response.tiers[:]
    response.tiers.extend([*tiers, *stored])


def rss_anon_bytes() -> int:
    """This process's anonymous resident memory: its heap, not the LMDB map's page cache."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
