"""Prometheus metrics at http://METRICS_LISTEN/metrics (off unless metrics_listen is set).

Every figure is read when Prometheus scrapes, from the objects that already
keep it — no second set of books:

| metric | from |
|---|---|
| kvgraft_rpc_requests_total{method,code} | the CallCounter (also Stats.rpc_calls) |
| kvgraft_rpc_{received,sent}_bytes_total{method} | Telemetry |
| kvgraft_rpc_in_progress, kvgraft_rpc_limit | the CallLimiter |
| kvgraft_{computations,grafts}_total{method} | receipts, via Telemetry |
| kvgraft_{reused,computed}_tokens_total | receipts, via Telemetry |
| kvgraft_batch_{steps,contexts,tokens,passes,queue_seconds}_total | the engine's batcher |
| kvgraft_batch_abandoned_total (passes whose client left) | the engine's batcher |
| kvgraft_batch_{waiting_passes,largest_step_contexts} | the engine's batcher |
| kvgraft_requests_{running,queued}, kvgraft_live_kv{,_budget}_bytes | the engine's admission |
| kvgraft_tier_{hits,misses,evictions}_total{tier} | Stats().tiers |
| kvgraft_tier_{used,capacity,peak}_bytes{tier} | Stats().tiers |
| kvgraft_store_* (artifacts, pages, bytes, map use, disk free, sequence) | Stats() |
| kvgraft_cache_{evicted_artifacts,evicted_bytes,expired_artifacts}_total | Info().cache |
| kvgraft_cache_{auto_deposits,auto_deposits_skipped}_total | Info().cache |
| kvgraft_cache_{budget_bytes,budget_artifacts,quarantined_artifacts} | Info().cache |
| kvgraft_scrub_{pages,bytes}_{done,total}, kvgraft_scrub_corrupt_pages | Info().scrub |
| kvgraft_scrub_running, kvgraft_scrub_last_finished_unix_seconds | Info().scrub |
| kvgraft_store_{corrupt_reads,read_quarantines}_total | the store's ReadQuarantine |
| kvgraft_store_reachable (0: the figures from Stats and Info left out) | Stats(), Info() |
| kvgraft_tenant_{artifacts,page_bytes,budget_bytes}{tenant} | kvgraftd.server.tenants |
| kvgraft_tenant_requests_{running,queued}{tenant} | kvgraftd.server.tenants |
| kvgraft_tenant_{evicted_artifacts,calls}_total{tenant[,method]} | kvgraftd.server.tenants |
| process_* | prometheus_client's process collector |

With TLS configured the endpoint is HTTPS with the daemon's certificate
(and requires a client certificate under tls_client_ca); kvgraftd.ops.metrics_endpoint
serves it. It must not hold a lock of the store across a scrape: Stats() uses one short
read transaction. A store whose files cannot be reached (its directory deleted under
the daemon) does not fail the scrape: what does not come from the store is still
served, and the log says what is wrong once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgraft.errors import KvgraftError
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.config import DaemonConfig
from kvgraftd.engine.scheduling.batcher import BatchFigures
from kvgraftd.ops.metrics_endpoint import MetricsEndpoint, tls_context
from kvgraftd.server.limits import CallLimiter
from kvgraftd.server.telemetry import Telemetry
from kvgraftd.server.tenants import TenantFigures
from kvgraftd.store.quarantine import ReadQuarantine

log = logging.getLogger(__name__)


class KvgraftCollector(Collector):
    def __init__(
        self,
        calls: Callable[[], dict[str, int]],
        stats: Callable[[], pb.StatsResponse],
        telemetry: Telemetry,
        limiter: CallLimiter,
        batching: Callable[[], BatchFigures | None] = lambda: None,
        cache: Callable[[], pb.InfoResponse] | None = None,
        read_quarantine: ReadQuarantine | None = None,
        tenants: Callable[[], list[TenantFigures]] = list,
    ) -> None:
        self._tenants = tenants
        self._cache = cache
        self._read_quarantine = read_quarantine
        self._calls = calls
        self._stats = stats
        self._telemetry = telemetry
        self._limiter = limiter
        self._batching = batching
        self._unreachable = ""  # why the store's figures were left out last, said once

    def collect(self) -> Iterator[Metric]:
        yield from self._rpc_metrics()
        yield from self._engine_metrics()
        try:
            stats = self._stats()
            info = self._cache() if self._cache is not None else None
        except KvgraftError as exc:  # the store's files cannot be reached: not a failed scrape
            if str(exc) != self._unreachable:
                log.warning("metrics: the store's figures are left out: %s", exc)
            self._unreachable = str(exc)
            stats = info = None
        else:
            self._unreachable = ""
        reachable = int(stats is not None)
        yield GaugeMetricFamily("kvgraft_store_reachable", "1: the store's files read", reachable)
        if stats is not None:
            yield from self._store_metrics(stats)
        if info is not None:
            yield from self._cache_metrics(info)
        if self._read_quarantine is not None:
            yield from self._damage_metrics(self._read_quarantine)
        if stats is not None:
            yield from self._tenant_metrics(self._tenants())

    def _tenant_metrics(self, tenants: list[TenantFigures]) -> Iterator[Metric]:
        if not tenants:
            return
        gauges = {
            "artifacts": "artifacts the tenant holds",
            "page_bytes": "page bytes they reference (what its budget counts)",
            "budget_bytes": "its store_budget_bytes (0: none of its own)",
            "requests_running": "its engine requests computing",
            "requests_queued": "its engine requests waiting in its line",
        }
        families = {
            name: GaugeMetricFamily(f"kvgraft_tenant_{name}", text, labels=["tenant"])
            for name, text in gauges.items()
        }
        evicted = CounterMetricFamily(
            "kvgraft_tenant_evicted_artifacts", "evicted within its budget", labels=["tenant"]
        )
        calls = CounterMetricFamily(
            "kvgraft_tenant_calls", "its calls, by method", labels=["tenant", "method"]
        )
        for t in tenants:
            for name, value in (
                ("artifacts", t.artifacts),
                ("page_bytes", t.page_bytes),
                ("budget_bytes", t.budget_bytes),
                ("requests_running", t.running),
                ("requests_queued", t.queued),
            ):
                families[name].add_metric([t.tenant], value)
            evicted.add_metric([t.tenant], t.evicted_artifacts)
            for method, count in sorted(t.calls.items()):
                calls.add_metric([t.tenant, method], count)
        yield from families.values()
        yield evicted
        yield calls

    def _damage_metrics(self, found: ReadQuarantine) -> Iterator[Metric]:
        for name, value, text in (
            ("corrupt_reads", found.pages, "stored pages reads found corrupt or unreadable"),
            ("read_quarantines", found.artifacts, "artifacts those reads quarantined"),
        ):
            yield CounterMetricFamily(f"kvgraft_store_{name}", text, value=value)

    def _cache_metrics(self, info: pb.InfoResponse) -> Iterator[Metric]:
        cache, scrub = info.cache, info.scrub
        for name, text in (
            ("evicted_artifacts", "artifacts evicted to stay within the budget"),
            ("evicted_bytes", "page bytes eviction gave back"),
            ("expired_artifacts", "artifacts deleted as their TTL pin expired"),
            ("auto_deposits", "finished contexts kept by cache = auto"),
            ("auto_deposits_skipped", "finished contexts not kept: no room"),
        ):
            yield CounterMetricFamily(f"kvgraft_cache_{name}", text, value=getattr(cache, name))
        for name, text in (
            ("budget_bytes", "store_budget_bytes (0: none)"),
            ("budget_artifacts", "store_budget_artifacts (0: none)"),
            ("quarantined_artifacts", "artifacts a read or scrub found corrupt, not yet repaired"),
        ):
            yield GaugeMetricFamily(f"kvgraft_cache_{name}", text, value=getattr(cache, name))
        for name, value, text in (
            ("pages_done", scrub.pages_done, "pages the last or running scrub hashed"),
            ("pages_total", scrub.pages_total, "pages stored when it began"),
            ("bytes_done", scrub.bytes_done, "bytes it hashed"),
            ("bytes_total", scrub.bytes_total, "bytes stored when it began"),
            ("corrupt_pages", scrub.corrupt_count, "corrupt pages it found"),
            ("running", int(scrub.running), "1 while a scrub runs"),
            ("last_finished_unix_seconds", scrub.finished_unix_ms / 1000, "when it ended"),
        ):
            yield GaugeMetricFamily(f"kvgraft_scrub_{name}", text, value=value)

    def _rpc_metrics(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "kvgraft_rpc_requests",
            "kvgraft calls answered, by method and status code",
            labels=["method", "code"],
        )
        for key, count in sorted(self._calls().items()):
            method, code = key.rsplit(":", 1)
            requests.add_metric([method, code], count)
        yield requests
        traffic = self._telemetry.snapshot()
        for name, figures, what in (
            ("kvgraft_rpc_received_bytes", traffic.bytes_received, "request"),
            ("kvgraft_rpc_sent_bytes", traffic.bytes_sent, "response"),
        ):
            family = CounterMetricFamily(
                name, f"{what} message bytes, by method", labels=["method"]
            )
            for method, count in sorted(figures.items()):
                family.add_metric([method], count)
            yield family
        yield GaugeMetricFamily(
            "kvgraft_rpc_in_progress",
            "kvgraft calls running or waiting for a worker",
            value=self._limiter.in_progress,
        )
        yield GaugeMetricFamily(
            "kvgraft_rpc_limit",
            "calls in progress beyond which calls are refused (max_concurrent_rpcs)",
            value=self._limiter.max_concurrent_rpcs,
        )

    def _engine_metrics(self) -> Iterator[Metric]:
        traffic = self._telemetry.snapshot()
        for name, figures, text in (
            ("kvgraft_computations", traffic.computations, "contexts computed (receipts issued)"),
            ("kvgraft_grafts", traffic.grafts, "computations that grafted stored KV pages"),
        ):
            family = CounterMetricFamily(name, f"{text}, by method", labels=["method"])
            for method, count in sorted(figures.items()):
                family.add_metric([method], count)
            yield family
        yield CounterMetricFamily(
            "kvgraft_reused_tokens", "tokens whose KV was grafted", value=traffic.reused_tokens
        )
        yield CounterMetricFamily(
            "kvgraft_computed_tokens", "tokens whose KV was computed", value=traffic.computed_tokens
        )
        yield from self._batch_metrics()

    def _batch_metrics(self) -> Iterator[Metric]:
        figures = self._batching()
        if figures is None:  # no model yet, or no batching (not the row-invariant forward)
            return
        steps = figures.counters
        for name, value, text in (
            ("kvgraft_batch_steps", steps.steps, "forward passes the batcher ran"),
            ("kvgraft_batch_contexts", steps.contexts, "contexts in those steps, summed"),
            ("kvgraft_batch_tokens", steps.tokens, "tokens computed in those steps"),
            ("kvgraft_batch_passes", steps.passes, "passes that reached a step"),
            ("kvgraft_batch_queue_seconds", steps.queue_seconds, "seconds passes waited for it"),
            ("kvgraft_batch_abandoned", steps.abandoned, "passes dropped: their client left"),
        ):
            yield CounterMetricFamily(name, text, value=value)
        for name, value, text in (
            ("kvgraft_batch_waiting_passes", steps.waiting, "passes waiting for a step now"),
            ("kvgraft_batch_largest_step_contexts", steps.largest_step_contexts, "most in a step"),
            ("kvgraft_requests_running", figures.running, "requests computing (admitted)"),
            ("kvgraft_requests_queued", figures.queued, "requests waiting to be admitted"),
            ("kvgraft_live_kv_bytes", figures.live_kv_bytes, "live KV the running ones reserved"),
            ("kvgraft_live_kv_budget_bytes", figures.max_live_kv_bytes, "0: unbounded"),
        ):
            yield GaugeMetricFamily(name, text, value=value)

    def _store_metrics(self, stats: pb.StatsResponse) -> Iterator[Metric]:
        tiered = {
            "hits": CounterMetricFamily("kvgraft_tier_hits", "page reads served", labels=["tier"]),
            "misses": CounterMetricFamily(
                "kvgraft_tier_misses", "page reads passed on", labels=["tier"]
            ),
            "evictions": CounterMetricFamily(
                "kvgraft_tier_evictions", "pages dropped to stay in budget", labels=["tier"]
            ),
            "used_bytes": GaugeMetricFamily(
                "kvgraft_tier_used_bytes", "bytes held", labels=["tier"]
            ),
            "capacity_bytes": GaugeMetricFamily(
                "kvgraft_tier_capacity_bytes", "budget or capacity (0: unbounded)", labels=["tier"]
            ),
            "peak_bytes": GaugeMetricFamily(
                "kvgraft_tier_peak_bytes", "highest use seen", labels=["tier"]
            ),
        }
        for tier in stats.tiers:
            for field, family in tiered.items():
                family.add_metric([tier.name], getattr(tier, field))
        yield from tiered.values()
        for field, text in (
            ("artifacts", "artifacts stored"),
            ("pages", "distinct pages stored"),
            ("page_bytes", "bytes of the stored pages"),
            ("staged_pages", "pages received but not yet referenced"),
            ("map_size_bytes", "the LMDB map's size"),
            ("map_used_bytes", "bytes of the LMDB map in use"),
            ("segment_disk_bytes", "disk the segment files hold"),
            ("disk_free_bytes", "free space where the store lives"),
            ("last_sequence", "newest change-feed sequence"),
        ):
            yield GaugeMetricFamily(f"kvgraft_store_{field}", text, value=getattr(stats, field))
        usage = stats.map_used_bytes / stats.map_size_bytes if stats.map_size_bytes else 0.0
        yield GaugeMetricFamily(
            "kvgraft_store_map_usage_ratio", "map_used_bytes / map_size_bytes", value=usage
        )


class MetricsServer:
    """The /metrics endpoint: started by the composition root, stopped before the store closes."""

    def __init__(self, endpoint: MetricsEndpoint) -> None:
        self._endpoint = endpoint
        self.port = endpoint.server_port

    @classmethod
    def start(cls, config: DaemonConfig, collector: KvgraftCollector) -> MetricsServer:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        ProcessCollector(registry=registry)
        host, port = config.metrics_listen.rsplit(":", 1)
        tls = None
        try:
            if config.tls_cert:
                tls = tls_context(config.tls_cert, config.tls_key, config.tls_client_ca)
            endpoint = MetricsEndpoint(host.strip("[]"), int(port), registry, tls)
        except OSError as exc:  # ssl.SSLError and socket.gaierror are OSErrors too
            raise OSError(f"cannot serve metrics on {config.metrics_listen}: {exc}") from None
        endpoint.start()
        scheme = "https" if tls else "http"
        log.info("metrics on %s://%s:%d/metrics", scheme, host, endpoint.server_port)
        return cls(endpoint)

    def stop(self) -> None:
        self._endpoint.stop()
