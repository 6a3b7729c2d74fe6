"""kvgraftd's composition root: build everything from one frozen config, run, drain.

Start order: config (kvgraftd.ops.command_line) -> exposure check
(kvgraftd.server.security) and model check (kvgraftd.config.check_model) -> logging ->
data-directory lock -> store -> remote tier (kvgraftd.remote.service) ->
the services (store, engine, library, Replicate's pulls; with [tenants], each tenant's:
kvgraftd.server.tenants) -> server (limits, TLS, tokens) ->
metrics endpoint -> the OpenAI-compatible HTTP API (kvgraftd.http) -> health SERVING ->
followers of [replication] peers (kvgraftd.replication.follower) -> READY=1 to systemd
once a real health probe answers (kvgraftd.ops.readiness; then WATCHDOG=1 after each
probe). Stop order on SIGTERM/SIGINT: watchdog pings stop, STOPPING=1 -> health NOT_SERVING ->
follow Watch streams end (UNAVAILABLE) -> followers stop -> the gRPC and HTTP servers stop
taking calls and drain in-flight ones (up to drain_s) -> the remote write-back drain
stops -> metrics endpoint closes ->
store closes -> lock released -> exit 0 at once (`leave`: a model still loading is
abandoned). Nothing else constructs these objects.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import kvgraftd.ops.quiet_grpc  # noqa: F401  first: grpc reads its log level when it loads
from kvgraft import __version__
from kvgraft.errors import KvgraftError
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.config import DEFAULT_CONTEXT_TOKENS, ConfigError, DaemonConfig, check_model
from kvgraftd.engine.requests.service import EngineService
from kvgraftd.http.http_server import HttpServer
from kvgraftd.http.openai_app import OpenAiApp
from kvgraftd.http.served_models import ServedModel
from kvgraftd.library.service import LibraryService
from kvgraftd.ops.command_line import build_parser, load_config, to_toml
from kvgraftd.ops.lockfile import DataDirLock
from kvgraftd.ops.metrics import KvgraftCollector, MetricsServer
from kvgraftd.ops.notify import Notifier
from kvgraftd.ops.readiness import HealthProbe, Readiness, probe_target
from kvgraftd.remote.service import RemoteService
from kvgraftd.replication.follower import LocalTarget, start_followers
from kvgraftd.replication.pulls import Pulls
from kvgraftd.server import security
from kvgraftd.server.grpc_server import ServerSettings, Services, create_server, set_serving
from kvgraftd.server.limits import CallLimiter, server_options
from kvgraftd.server.status import info_response, stats_response
from kvgraftd.server.tenants import TenantRoute, tenant_services
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.eviction import CacheBudget, CacheKeeper, conversation_budget
from kvgraftd.store.scrub import Scrubber
from kvgraftd.store.service import ServiceLimits, StoreService
from kvgraftd.store.signing import Signer, TrustPolicy

if TYPE_CHECKING:
    from kvgraftd.engine.requests.engine import Engine

log = logging.getLogger("kvgraftd")

HOUSEKEEPING_INTERVAL_S = 60.0  # staged pages are collected within a minute of their TTL
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
M_TOP_PAD = -2  # glibc's malloc.h


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args)
        if args.print_config:
            print(to_toml(config), end="")
            return 0
        # before the lock and the port: what the configuration names must exist
        security.check(config)
        check_model(config)
    except ConfigError as exc:
        print(f"kvgraftd: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        code = run(config)
    except (KvgraftError, OSError) as exc:
        log.error("%s", exc)
        code = 1
    leave(code)


def leave(code: int) -> NoReturn:
    """Exit with `code` now, without the interpreter's teardown.

    Everything the daemon owns is closed by then (server, store, lock). The teardown
    would only garbage-collect torch's and transformers' modules (1-2 s after "store
    closed" here) and run their exit handlers while a model load may still be running on
    its thread; nothing in it is the daemon's to save. Only the log is flushed.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(config: DaemonConfig) -> int:
    stop = StopSignals()
    keep_heap_top(config.malloc_top_pad_bytes)
    lock = DataDirLock(config.data)
    try:
        store = Store(
            config.data / "store",
            initial_map_bytes=config.map_initial_bytes,
            min_free_bytes=config.min_free_bytes,
            budget=CacheBudget(
                bytes=config.store_budget_bytes,
                artifacts=config.store_budget_artifacts,
                policy=config.eviction_policy,
                conversation_bytes=conversation_budget(
                    config.conversation_budget_bytes, config.store_budget_bytes, config.data
                ),
            ),
        )
        log.info(
            "conversation contexts (chat_cache, cache = auto) kept within %d bytes "
            "(conversation_budget_bytes)",
            store.evictor.budget.conversation_bytes,
        )
        try:
            loading = serve(config, store, stop)
        finally:
            store.close()
            log.info("store closed")
    finally:
        lock.release()
    if loading:
        log.info("stopped while the model was loading: its load is abandoned")
    return 0


def context_tokens(configured: int, trained: int | None) -> int:
    """max_context_tokens as the engine keeps it: `configured`, warning (once, at load) when
    it passes the model's trained context (`trained`: max_position_embeddings, None where
    the model does not say); 0: the trained context, at most DEFAULT_CONTEXT_TOKENS."""
    if not configured:
        limit = min(DEFAULT_CONTEXT_TOKENS, trained or DEFAULT_CONTEXT_TOKENS)
        log.info("max_context_tokens %d (the model's trained context, at most %d)",
                 limit, DEFAULT_CONTEXT_TOKENS)  # fmt: skip
        return limit
    if trained and configured > trained:
        log.warning(
            "max_context_tokens=%d is more than the model was trained on (%d positions): "
            "positions past %d give answers it was never trained to give; unset "
            "max_context_tokens (0) to keep within them",
            configured, trained, trained,
        )  # fmt: skip
    return configured


def build_engine(config: DaemonConfig, store: Store, trust: TrustPolicy) -> Engine:
    """Load the model and build the engine (on the model-load thread).

    Imported here so that a store-only daemon (--model none) never loads torch.
    """
    import torch

    from kvgraftd.engine.model.model_adapter import ModelAdapter
    from kvgraftd.engine.requests.engine import Engine
    from kvgraftd.engine.scheduling.compute_thread import ComputeThread
    from kvgraftd.tiers.device_pool import DevicePool
    from kvgraftd.tiers.host_cache import HostCache
    from kvgraftd.tiers.stack import Tiers

    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cache = Path(config.model_cache) if config.model_cache else config.data / "models"
    # Loaded on the thread that runs every forward pass (kvgraftd.engine.scheduling.compute_thread).
    compute = ComputeThread()
    template = Path(config.chat_template).read_text() if config.chat_template else ""
    adapter = compute.run(
        ModelAdapter.load,
        config.model or None,
        cache,
        device=device,
        products=config.products,
        chat_template=template,
        tokenizer=config.tokenizer,
    )
    freed = adapter.release_float_weights()
    if freed:
        log.info("the model's float32 weights the kernels do not read freed: %d MiB", freed >> 20)
    geometry = adapter.geometry
    pool = DevicePool(
        config.device_budget_bytes,
        (2, geometry.kv_heads, config.block_tokens, geometry.head_dim),
        device=device,
    )
    tiers = Tiers(pool, HostCache(store, config.host_budget_bytes))
    running, queued = config.engine_limits()
    if (running, queued) != (config.max_running_contexts, config.max_queued_requests):
        log.info(
            "engine requests: %d running, %d queued (what %d workers allow: each holds one)",
            running, queued, config.workers,
        )  # fmt: skip
    engine = Engine(
        adapter,
        store,
        page_tokens=config.page_tokens,
        block_tokens=config.block_tokens,
        max_context_tokens=context_tokens(
            config.max_context_tokens, adapter.rope_description()["max_position_embeddings"]
        ),
        tiers=tiers,
        trust=trust,
        max_batch_tokens=config.max_batch_tokens,
        max_batch_rows=config.max_batch_rows,
        max_running_contexts=running,
        max_queued_requests=queued,
        max_live_kv_bytes=config.max_live_kv_bytes,
        auto_cache=config.cache == "auto",
        compute=compute,
    )
    log.info(
        "engine ready: %s on %s, fingerprint %s, page_tokens %d, device pool %d slots of %d bytes",
        adapter.name,
        device,
        engine.fingerprint.hex()[:16],
        config.page_tokens,
        pool.capacity,
        pool.slot_bytes,
    )
    if adapter.row_invariant:
        from kvgraftd.engine.model import decode_attention, linear

        log.info(
            "kernels: products %s (%s build), attention %s build",
            adapter.products,
            linear.kernel_name(),
            decode_attention.kernel_build(),
        )
    return engine


def keep_heap_top(pad_bytes: int) -> None:
    """Have glibc keep `pad_bytes` of freed memory at each heap's top (M_TOP_PAD).

    A put allocates and frees a 4 MiB message, its page records and LMDB's
    dirty pages over and over; by default glibc hands the freed top of a heap
    back to the kernel each time, and the next allocation faults every page
    in again (zeroed). Measured with 64 MiB: puts of 1.1 GB into a tmpfs
    store took 3.2-3.7 s of daemon CPU instead of 4.3-4.4 s (0.35-0.40
    against 0.30-0.31 GB/s), for 50-90 MiB more RssAnon.
    Nothing to do on another C library, or with 0.
    """
    if not pad_bytes:
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.info("malloc_top_pad_bytes: this C library has no mallopt; ignored")
        return
    if not mallopt(M_TOP_PAD, min(pad_bytes, 2**31 - 1)):
        log.warning("malloc_top_pad_bytes: mallopt refused %d; glibc's default stays", pad_bytes)


class StopSignals:
    """SIGTERM and SIGINT, whichever thread the kernel hands them to.

    A Python handler runs only in the main thread and only once it wakes; a
    signal delivered to another thread (a gRPC or BLAS thread) does not wake
    a main thread asleep in a wait, so a stop could sit out the whole
    housekeeping interval. The C-level handler writes every signal's number
    to the wakeup socket from the thread that took it, and `wait` selects on
    that socket. Construct it in the main thread.
    """

    def __init__(self) -> None:
        self._read, self._write = socket.socketpair()
        self._read.setblocking(False)
        self._write.setblocking(False)
        signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        for signum in STOP_SIGNALS:
            signal.signal(signum, lambda number, frame: None)  # the wakeup byte is the news

    def wait(self, timeout_s: float) -> bool:
        """True once a stop signal arrived; False after `timeout_s` without one."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([self._read], [], [], left)[0]:
                return False
            for number in self._read.recv(64):
                if number in STOP_SIGNALS:
                    log.info("received %s", signal.Signals(number).name)
                    return True
        return False


def server_settings(config: DaemonConfig, notifier: Notifier) -> ServerSettings:
    """Limits, TLS, token and (TLS under systemd only) the health probe socket."""
    probe_socket = ""
    if notifier.enabled and config.tls_cert and not config.listen.startswith("unix"):
        path = security.probe_socket_path(config.data)
        if len(str(path)) > 100:
            raise OSError(f"the health probe socket path {path} is too long: shorten --data")
        probe_socket = f"unix:{path}"
    return ServerSettings(
        limiter=CallLimiter.from_config(config),
        options=server_options(config),
        credentials=security.server_credentials(config),
        token_check=security.TokenCheck(
            security.load_token(config.token_file),
            {t.name: security.load_token(t.token_file) for t in config.tenants},
        )
        if config.token_file
        else None,
        probe_socket=probe_socket,
    )


def start_http(
    config: DaemonConfig, services: Services, tenants: dict[str, Services], settings: ServerSettings
) -> HttpServer | None:
    """The OpenAI-compatible API on http_listen (None when it is off, or without a model:
    a store-only daemon, such as a replica beside a serving one, has nothing to answer
    there), under the same token, TLS, call limits and counters as gRPC."""
    if not config.http_listen or config.model == "none":
        return None
    assert settings.limiter is not None  # server_settings always builds one
    app = OpenAiApp(
        services.engine,
        settings.limiter,
        settings.token_check,
        settings.counter,
        settings.telemetry,
        keep_conversations=config.chat_cache == "auto",
        max_request_bytes=config.max_request_bytes,
        served=ServedModel.of(config),  # its names and creation time, known while it loads
        tenant_engines={name: tenant.engine for name, tenant in tenants.items()},
        cors_origins=config.http_cors_origins,
    )
    http = HttpServer.start(config, app.app)
    host = config.http_listen.rsplit(":", 1)[0]
    log.info("OpenAI-compatible API at %s://%s:%d/v1", http.scheme, host, http.port)
    return http


def serve(config: DaemonConfig, store: Store, stop: StopSignals) -> bool:
    """Serve until a stop signal, then drain; True when the model was still loading."""
    store.collect_staged(config.staged_ttl_s)
    # What this daemon vouches for, and whose signatures it believes (kvgraftd.store.signing).
    trust = TrustPolicy(
        Signer.load_or_create(config.data), (bytes.fromhex(key) for key in config.trust_keys)
    )
    log.info("signing key %s", trust.signer.public_key.hex())
    # [trust] keys changed since the last start: every stored signature is judged again
    rejudged = store.reevaluate_trust(trust)
    if rejudged is not None and any(rejudged):
        log.info(
            "[trust] keys changed: trusted now %d artifacts (signed by a key added), "
            "untrusted now %d (signed only by keys taken out)",
            *rejudged,
        )
    # The remote tier ([remote]): bad credentials stop the daemon here, before it serves.
    remote = RemoteService.open(config, store, trust)
    # The store runs itself as a cache: budgets, expired pins, last uses, scrubs (their
    # threads start with the server).
    keeper = CacheKeeper(store, store.evictor)
    scrubber = Scrubber(store, config.scrub_bytes_per_s)
    service = StoreService(
        remote.view(store, read_through=False),
        ServiceLimits.of(config),
        trust,
        scrubber,
        config.cache,
    )
    engine_store = remote.view(store, read_through=True)
    engine = EngineService(
        None if config.model == "none" else lambda: build_engine(config, engine_store, trust)
    )
    notifier = Notifier.from_environment()
    settings = server_settings(config, notifier)
    allowed = (*config.replication_pull_from, *config.replication_follow)
    # Replicate: copies from a named daemon
    pulls = Pulls(LocalTarget(service, store), allowed, service.instance_id)
    names = tuple(tenant.name for tenant in config.tenants)
    services = Services(service, engine, LibraryService(engine), remote, pulls, tenants=names)
    tenants = tenant_services(config, services, engine_store)
    route = TenantRoute(services, tenants, settings.token_check) if tenants else services
    server, port, health_servicer = create_server(
        route, config.listen, workers=config.workers, settings=settings
    )
    http = start_http(config, services, tenants, settings)  # bound here: a port in use stops it
    metrics = None
    if config.metrics_listen:
        stats = lambda: stats_response(service, engine, settings.counter, remote)  # noqa: E731
        collector = KvgraftCollector(
            settings.counter.snapshot,
            stats,
            settings.telemetry,
            settings.limiter,
            engine.batch_figures,
            lambda: info_response(service, engine, pb.InfoRequest(), remote),
            store.read_quarantine,
            route.figures if isinstance(route, TenantRoute) else list,
        )
        metrics = MetricsServer.start(config, collector)
    keeper.start()
    scrubber.start_periodic(config.scrub_interval_s)
    server.start()
    set_serving(health_servicer, True)
    host = config.listen.rsplit(":", 1)[0]
    log.info("kvgraftd %s serving on %s:%d (data %s)", __version__, host, port, config.data)
    followers = start_followers(config.replication_follow, service, store, config.data)
    readiness = None
    if notifier.enabled:
        probe = HealthProbe(probe_target(config.listen, port, settings.probe_socket))
        readiness = Readiness(notifier, probe, f"serving on {host}:{port}")
        readiness.start()
    while not stop.wait(HOUSEKEEPING_INTERVAL_S):
        store.collect_staged(config.staged_ttl_s)
    log.info("shutting down: draining in-flight calls (up to %.0f s)", config.drain_s)
    if readiness is not None:
        readiness.stop()  # no watchdog ping may follow STOPPING=1
    notifier.stopping(f"draining in-flight calls (up to {config.drain_s:g} s)")
    set_serving(health_servicer, False)
    service.stop_watches()
    followers.stop(config.drain_s)  # they write through the service: before the store closes
    pulls.stop(config.drain_s)  # so do Replicate calls still running
    stopped = server.stop(grace=config.drain_s)
    if http is not None:
        http.stop(config.drain_s)  # drains alongside gRPC
    stopped.wait()
    log.info("server stopped")
    remote.stop()  # the write-back drain reads the store: before it closes
    scrubber.stop()
    keeper.stop()
    if metrics is not None:
        metrics.stop()
    notifier.close()
    return config.model != "none" and not engine.wait_ready(0)
