"""kvgraftd's composition root: build everything from one frozen config, run, drain.

Start order: config -> logging -> data-directory lock -> store -> service ->
server -> health SERVING. Stop order on SIGTERM/SIGINT: health NOT_SERVING ->
follow Watch streams end (UNAVAILABLE) -> server stops taking calls and drains
in-flight ones (up to drain_s) -> store
closes -> lock released -> exit 0. Nothing else constructs these objects.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from kvgraft import __version__
from kvgraft.errors import KvgraftError
from kvgraftd.config import ConfigError, DaemonConfig, build_parser, load_config, to_toml
from kvgraftd.engine_service import EngineService
from kvgraftd.lockfile import DataDirLock
from kvgraftd.server import create_server, set_serving
from kvgraftd.service import ServiceLimits, StoreService
from kvgraftd.store import Store

if TYPE_CHECKING:
    from kvgraftd.engine import Engine

log = logging.getLogger("kvgraftd")

HOUSEKEEPING_INTERVAL_S = 3600.0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args)
    except ConfigError as exc:
        print(f"kvgraftd: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_toml(config), end="")
        return 0
    logging.basicConfig(
        level=config.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return run(config)
    except (KvgraftError, OSError) as exc:
        log.error("%s", exc)
        return 1


def run(config: DaemonConfig) -> int:
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda number, frame: stop.set())

    lock = DataDirLock(config.data)
    try:
        store = Store(
            config.data / "store",
            initial_map_bytes=config.map_initial_bytes,
            min_free_bytes=config.min_free_bytes,
        )
        try:
            serve(config, store, stop)
        finally:
            store.close()
            log.info("store closed")
    finally:
        lock.release()
    return 0


def build_engine(config: DaemonConfig, store: Store) -> Engine:
    """Load the model and build the engine (on the model-load thread).

    Imported here so that a store-only daemon (--model none) never loads torch.
    """
    from kvgraftd.engine import Engine
    from kvgraftd.model_adapter import ModelAdapter

    cache = Path(config.model_cache) if config.model_cache else config.data / "models"
    adapter = ModelAdapter.load(config.model or None, cache)
    engine = Engine(
        adapter,
        store,
        page_tokens=config.page_tokens,
        block_tokens=config.block_tokens,
        max_context_tokens=config.max_context_tokens,
    )
    log.info(
        "engine ready: %s, fingerprint %s, page_tokens %d",
        adapter.name,
        engine.fingerprint.hex()[:16],
        config.page_tokens,
    )
    return engine


def serve(config: DaemonConfig, store: Store, stop: threading.Event) -> None:
    store.collect_staged(config.staged_ttl_s)
    service = StoreService(store, ServiceLimits(spill_bytes=config.spill_bytes))
    engine = EngineService(None if config.model == "none" else lambda: build_engine(config, store))
    server, port, health_servicer = create_server(
        service, engine, config.listen, workers=config.workers
    )
    server.start()
    set_serving(health_servicer, True)
    host = config.listen.rsplit(":", 1)[0]
    log.info("kvgraftd %s serving on %s:%d (data %s)", __version__, host, port, config.data)
    while not stop.wait(HOUSEKEEPING_INTERVAL_S):
        store.collect_staged(config.staged_ttl_s)
    log.info("shutting down: draining in-flight calls (up to %.0f s)", config.drain_s)
    set_serving(health_servicer, False)
    service.stop_watches()
    server.stop(grace=config.drain_s).wait()
    log.info("server stopped")
