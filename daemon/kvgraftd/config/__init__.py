"""The daemon's configuration: one frozen dataclass, its values checked, and the model it names.

Every field is a setting with one name (`map_initial_bytes`), read from the
command line and the TOML file of --config by kvgraftd.ops.command_line (which
also says how each is spelled there). Here: the defaults and help of each
field, the conversion of a given value to the field's type (`coerce`: byte sizes
take plain integers or strings with a unit, "64MiB", "2GB"), the checks of the
values, alone and together (`DaemonConfig.__post_init__`, ConfigError naming the
setting and the fix), and the check of the model a configuration names on this
machine (`check_model`, run at start before the daemon takes its port or lock).
A value's conversion, the numeric ranges (BOUNDS), byte sizes and the error are
kvgraftd.config.values'; the [tenants.NAME] tables, which have no flag,
kvgraftd.config.tenants'.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgraft.public_keys import is_degenerate
from kvgraft.replication.addresses import TARGETS, address_problem
from kvgraftd.config.tenants import TenantConfig
from kvgraftd.config.values import ConfigError, check_bounds, convert

DEFAULT_LISTEN = "127.0.0.1:50551"
DEFAULT_HTTP_LISTEN = "127.0.0.1:8551"
DEFAULT_CONTEXT_TOKENS = 32768  # max_context_tokens, unset, where the model allows as many
# the CPU forward's arithmetic over GGUF blocks (kvgraftd.engine.model.native_forward)
PRODUCTS = ("int8-dot", "fp32")
# the tiny random models --model tiny:FAMILY:SEED names (kvgraftd.engine.model.tiny_models)
TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class DaemonConfig:
    listen: str = _opt(DEFAULT_LISTEN, "address to serve gRPC on (host:port; port 0 picks one)")
    data: Path = _opt(Path("./kvgraft-data"), "data directory (the store and caches)")
    log_level: str = _opt("info", "debug, info, warning or error")
    workers: int = _opt(32, "calls that run at once; more wait, up to max_concurrent_rpcs")
    drain_s: float = _opt(30.0, "seconds in-flight calls may take to finish on shutdown")
    map_initial_bytes: int = _opt(1 << 30, "initial LMDB map size; it grows by itself")
    min_free_bytes: int = _opt(256 << 20, "disk space kept free: writes beyond it are refused")
    spill_bytes: int = _opt(256 << 20, "page bytes one upload holds in memory before staging")
    upload_memory_bytes: int = _opt(
        1 << 30,
        "page bytes all uploads in progress hold in memory together; past it they stage "
        "their pages early, and a page arriving in pieces that does not fit is refused",
    )
    staged_ttl_s: float = _opt(900.0, "seconds unclaimed staged pages are kept for a resume")
    staged_max_bytes: int = _opt(
        16 << 30,
        "disk the staged pages of unfinished uploads may take, all uploads together (whole "
        "4 KiB blocks: a 4-byte page counts 4 KiB; outside store_budget_bytes); raise it for "
        "one upload larger than this",
    )
    staged_max_bytes_per_connection: int = _opt(
        4 << 30,
        "staged disk one client host's unfinished uploads may take within staged_ttl_s "
        "(0: no limit; at most store_budget_bytes, where set: a larger artifact could not be "
        "stored)",
    )
    # The store as a cache (kvgraftd.store.eviction, kvgraftd.store.scrub).
    store_budget_bytes: int = _opt(
        0,
        "disk the stored pages may take (0: no budget); past 95% of it unpinned artifacts "
        "nobody is reading are evicted down to 85%, in eviction_policy's order",
    )
    store_budget_artifacts: int = _opt(0, "artifacts the store may hold (0: no such budget)")
    conversation_budget_bytes: int = _opt(
        0,
        "disk the conversation contexts that chat_cache and cache = auto keep may take (pages "
        "shared between turns counted in each; pinned ones not counted); past 95% of it they "
        "are evicted down to 85%, in eviction_policy's order, and under any budget they go "
        "first. 0: store_budget_bytes where set, else a tenth of the data disk's size at "
        "start, at most 4GiB",
    )
    eviction_policy: str = _opt(
        "lru",
        "lru (least recently used first) or cost-aware (keep what saved the most "
        "recomputation per byte: tokens reused from it, aged)",
    )
    cache: str = _opt(
        "explicit",
        "explicit: only deposits are kept; auto: every Generate keeps its finished context, "
        "a conversation context (a prefix cache within conversation_budget_bytes)",
    )
    scrub_interval_s: float = _opt(
        7 * 86400.0, "seconds between background scrubs of every page's SHA-256 (0: never)"
    )
    scrub_bytes_per_s: int = _opt(64 << 20, "how fast a scrub reads the store")
    malloc_top_pad_bytes: int = _opt(
        64 << 20,
        "freed memory glibc's allocator keeps at the top of each heap (M_TOP_PAD) instead of "
        "handing it back and faulting it in again: puts took ~15% less CPU here, for 50-90 "
        "MiB more resident memory; 0 leaves glibc's default",
    )
    model: str = _opt(
        "",
        "a GGUF file, a Hugging Face directory, tiny:SEED or tiny:FAMILY:SEED (small random "
        "test models) or none (store only); empty: the default model, SmolLM2-135M-Instruct",
    )
    model_cache: str = _opt("", "where converted models are cached (empty: DATA/models)")
    chat_template: str = _opt(
        "", "a Jinja chat template file to render conversations with instead of the model's own"
    )
    tokenizer: str = _opt(
        "",
        "a GGUF file whose tokenizer and chat template the model uses instead of its own (a "
        "vocabulary-only GGUF will do; a tiny:FAMILY:SEED model is built with its size)",
    )
    products: str = _opt(
        "int8-dot",
        "the CPU forward's arithmetic over a GGUF file's blocks: int8-dot (activations "
        "quantized to 8 bits, integer dot products, as llama.cpp; fastest) or fp32 (the "
        "dequantized weights in float, transformers' numbers); each is exact, and an artifact "
        "of one is refused by the other",
    )
    page_tokens: int = _opt(64, "tokens per KV page")
    block_tokens: int = _opt(4096, "keys per attention block (a multiple of page_tokens)")
    max_context_tokens: int = _opt(
        0,
        "longest context one request may build; 0: the model's trained context "
        f"(max_position_embeddings), at most {DEFAULT_CONTEXT_TOKENS}. A value above the "
        "trained context is served, with a warning at load",
    )
    # Continuous batching (kvgraftd.engine.scheduling.batcher; the row-invariant forward only).
    max_batch_tokens: int = _opt(
        128,
        "tokens one forward pass holds: every decoding context's row, then prompt chunks "
        "(more: prompts a little faster; fewer: others' tokens less delayed by a long prompt)",
    )
    max_batch_rows: int = _opt(
        64, "contexts one forward pass holds; 1 turns batching off (a context per pass)"
    )
    max_running_contexts: int = _opt(
        16, "requests computing at once (at most half the workers); more wait in a queue"
    )
    max_queued_requests: int = _opt(
        8,
        "requests waiting beyond max_running_contexts (at most the workers the running ones "
        "leave, less one for the store's calls); more are refused (RESOURCE_EXHAUSTED)",
    )
    max_live_kv_bytes: int = _opt(
        2 << 30,
        "RAM the running requests' computed KV may take together (each reserves its prompt's "
        "and max_new_tokens' when admitted; beyond, requests wait; one needing more alone is "
        "refused); 0: unbounded",
    )
    # Tiers (kvgraftd.tiers.device_pool, kvgraftd.tiers.host_cache).
    device: str = _opt("auto", "where attention runs: cpu, cuda or auto (cuda when present)")
    device_budget_bytes: int = _opt(
        2 << 30, "device memory for attention blocks; KV beyond it streams in as needed"
    )
    host_budget_bytes: int = _opt(4 << 30, "RAM for checked copies of stored pages (0: none)")
    # Exposure (kvgraftd.server.security): a non-loopback listen needs TLS or a token, or insecure.
    insecure: bool = _opt(False, "allow a non-loopback listen address without TLS or a token")
    tls_cert: str = _opt(
        "", "PEM certificate (chain) to serve TLS with; needs tls_key (empty: plaintext)"
    )
    tls_key: str = _opt("", "PEM private key of tls_cert (empty: no TLS)")
    tls_client_ca: str = _opt(
        "",
        "PEM CA certificates: clients must present a certificate they signed (mutual TLS; "
        "empty: clients present none)",
    )
    token_file: str = _opt(
        "",
        "file holding the bearer token every call must carry (health Check excepted; empty: "
        "no token)",
    )
    # Limits (kvgraftd.server.limits).
    max_concurrent_rpcs: int = _opt(
        64,
        "calls in progress at once, running or waiting for a worker; more are refused at "
        "once with RESOURCE_EXHAUSTED",
    )
    max_follow_streams: int = _opt(
        64,
        "Watch, Replicate and Scrub streams open at once (long-lived: they take no worker and do "
        "not count in max_concurrent_rpcs); more are refused with RESOURCE_EXHAUSTED",
    )
    max_streams_per_connection: int = _opt(
        100, "calls one client connection may carry at once (HTTP/2 streams)"
    )
    max_request_bytes: int = _opt(4 << 20, "largest request message accepted")
    max_call_s: float = _opt(
        3600.0, "longest a call may run, checked between stream messages (Watch exempt)"
    )
    put_idle_s: float = _opt(60.0, "longest a PutArtifact may wait for its next message")
    keepalive_s: float = _opt(60.0, "seconds between pings that notice a vanished client")
    keepalive_timeout_s: float = _opt(20.0, "seconds a ping may go unanswered before hanging up")
    metrics_listen: str = _opt("", "host:port serving Prometheus metrics at /metrics; empty: off")
    http_listen: str = _opt(
        DEFAULT_HTTP_LISTEN,
        "host:port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models; same token and TLS as gRPC); empty: off (and with --model none)",
    )
    served_model_name: tuple[str, ...] = _opt(
        (),
        "names the HTTP API serves the model under, as vLLM's --served-model-name: /v1/models "
        "lists them, a request may name any (its answer echoes the one named) and no other; "
        "none: the model's file name",
    )
    http_cors_origins: tuple[str, ...] = _opt(
        (),
        "origins (scheme://host[:port], or * for any) whose browser apps may call the HTTP API "
        "(CORS; the token is still required); none: CORS off, and OPTIONS is 405",
    )
    chat_cache: str = _opt(
        "auto",
        "auto: every HTTP completion keeps its finished context as a conversation context "
        "(within conversation_budget_bytes, evicted first), so a conversation's next turn "
        "reuses every earlier one; explicit: only what `cache` keeps",
    )
    # Replication (kvgraftd.replication.follower). TOML: [replication] follow = ["host:port", ...].
    replication_follow: tuple[str, ...] = _opt(
        (),
        "peers (host:port, or a gRPC target: unix:PATH, dns:///host:port) whose artifacts "
        "and deletes this daemon copies",
    )
    replication_pull_from: tuple[str, ...] = _opt(
        (),
        "sources (host:port or a gRPC target, as in follow; * for any) a Replicate call may "
        "make this daemon "
        "copy from, besides its follow peers; it sends its KVGRAFT_* credentials (token, "
        "client certificate) only to sources named here or in follow, never to one * allows",
    )
    # Trust (kvgraftd.store.signing). TOML: [trust] keys = ["hex", ...].
    trust_keys: tuple[str, ...] = _opt(
        (),
        "Ed25519 public keys (64 hex characters) whose signatures this daemon accepts: "
        "artifacts they signed are grafted at once (kvgraft info shows a daemon's key)",
    )
    # Remote tier (kvgraftd.remote.tier). TOML: [remote] endpoint, bucket, prefix, write, ...
    # Credentials: the standard AWS variables or credentials file, never this file.
    remote_endpoint: str = _opt("", "S3 endpoint URL of the remote tier (empty: AWS S3)")
    remote_bucket: str = _opt("", "S3 bucket of the remote tier (empty: no remote tier)")
    remote_prefix: str = _opt("kvgraft", "key prefix in the bucket (objects: PREFIX/MODEL/...)")
    remote_write: str = _opt(
        "through", "through: commits upload before returning; back: uploads queue and drain later"
    )
    remote_timeout_s: float = _opt(10.0, "seconds one S3 request may take to connect or answer")
    remote_connections: int = _opt(8, "S3 requests in flight at once")

    # Tenants ([tenants.NAME] tables; kvgraft.tenancy): no flag, the TOML file only.
    tenants: tuple[TenantConfig, ...] = field(
        default=(), metadata={"help": "tenants: [tenants.NAME] token_file, ...", "table": True}
    )

    def engine_limits(self) -> tuple[int, int]:
        """(running, queued) engine requests: each holds a worker while it runs or waits, so
        the running ones take at most half the workers and the queue what is left but one,
        for the store's calls."""
        running = max(1, min(self.max_running_contexts, self.workers // 2))
        queued = max(0, min(self.max_queued_requests, self.workers - running - 1))
        return running, queued

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level {self.log_level!r}: use debug, info, warning or error")
        _check_address("listen", self.listen)
        if self.products not in PRODUCTS:
            raise ConfigError(f"products {self.products!r}: use {' or '.join(PRODUCTS)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device {self.device!r}: use cpu, cuda or auto")
        if self.block_tokens % self.page_tokens:
            raise ConfigError("block_tokens must be a multiple of page_tokens")
        _check_exposure_fields(self)
        if self.tenants and not self.token_file:
            raise ConfigError(
                "[tenants] need the operator's token_file: the daemon's own token sees every "
                "tenant and runs replication; set token_file too"
            )
        if self.model.startswith("tiny:"):
            family, _, seed = self.model[5:].rpartition(":")
            if not seed.isdigit() or (family and family not in TINY_FAMILIES):
                raise ConfigError(
                    f"model {self.model!r}: use tiny:SEED (a whole number, e.g. tiny:0) or "
                    f"tiny:FAMILY:SEED with a family of {', '.join(TINY_FAMILIES)}"
                )
        for source in self.replication_pull_from:
            if source != "*" and (problem := address_problem(source)):
                raise ConfigError(
                    f"replication_pull_from {source!r}: {problem}; use host:port, {TARGETS} or *"
                )
        for peer in self.replication_follow:
            if problem := address_problem(peer):
                raise ConfigError(
                    f"replication_follow {peer!r}: {problem}; use host:port or {TARGETS}"
                )
        for key in self.trust_keys:
            if len(key) != 64 or key.strip("0123456789abcdef"):
                raise ConfigError(
                    f"trust_keys {key!r}: a key is 64 lowercase hex characters (the "
                    "signing_key that `kvgraft info` shows on the daemon to trust)"
                )
            if is_degenerate(bytes.fromhex(key)):
                raise ConfigError(
                    f"trust_keys {key!r} is a point of small order, not a daemon's key: "
                    "anything would pass as signed by it; take it out of [trust] keys"
                )
        if self.eviction_policy not in ("lru", "cost-aware"):
            raise ConfigError(f"eviction_policy {self.eviction_policy!r}: use lru or cost-aware")
        if self.cache not in ("explicit", "auto"):
            raise ConfigError(f"cache {self.cache!r}: use explicit or auto")
        if self.chat_cache not in ("explicit", "auto"):
            raise ConfigError(f"chat_cache {self.chat_cache!r}: use explicit or auto")
        if self.remote_write not in ("through", "back"):
            raise ConfigError(f"remote_write {self.remote_write!r}: use through or back")
        if not self.remote_prefix.strip("/"):
            raise ConfigError("remote_prefix must not be empty")
        if self.tokenizer and not Path(self.tokenizer).is_file():
            raise ConfigError(f"tokenizer {self.tokenizer!r} is not a file: give a GGUF file")
        if self.chat_template and not Path(self.chat_template).is_file():
            raise ConfigError(
                f"chat_template {self.chat_template!r} is not a file: give a Jinja template file"
            )


MODEL_CHOICES = "give a GGUF file, a Hugging Face model directory, tiny:[FAMILY:]SEED or none"


def check_model(config: DaemonConfig) -> None:
    """Refuse (ConfigError) a model path that cannot be loaded: missing, unreadable, neither a
    GGUF file nor a Hugging Face model directory.

    Run at start, before the daemon takes its port and its data directory: the model loads
    in the background, where a typo would show only seconds later, in the log, while the
    daemon served without a model. The empty default is the installed package's file (its
    load says how to install it).
    """
    model = config.model
    if model in ("", "none") or model.startswith("tiny:"):
        return
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"model {model} is a directory without config.json, not a Hugging Face model "
                f"directory: {MODEL_CHOICES}"
            )
        return
    if not path.exists():
        raise ConfigError(f"model {model} does not exist: {MODEL_CHOICES}")
    if not path.is_file():  # a pipe or a device: reading it could wait for ever
        raise ConfigError(f"model {model} is not a regular file: {MODEL_CHOICES}")
    try:
        with path.open("rb") as file:
            magic = file.read(4)
    except OSError as exc:
        raise ConfigError(
            f"model {model} cannot be read ({exc.strerror}): make it readable by the daemon's user"
        ) from None
    if magic != b"GGUF":
        raise ConfigError(f"model {model} is not a GGUF file: {MODEL_CHOICES}")


def _check_exposure_fields(config: DaemonConfig) -> None:
    """The security and limit fields (the exposure rule itself is kvgraftd.server.security's)."""
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ConfigError("tls_cert and tls_key go together: give both, or neither")
    if config.tls_client_ca and not config.tls_cert:
        raise ConfigError("tls_client_ca needs TLS: give tls_cert and tls_key too")
    if config.max_concurrent_rpcs < config.workers:
        raise ConfigError(
            f"max_concurrent_rpcs ({config.max_concurrent_rpcs}) must be at least workers "
            f"({config.workers})"
        )
    if config.metrics_listen:
        _check_address("metrics_listen", config.metrics_listen)
    if config.http_listen:
        _check_address("http_listen", config.http_listen)
    for origin in config.http_cors_origins:  # a browser's Origin header: no path, no slash
        scheme, sep, host = origin.partition("://")
        if origin != "*" and (not scheme or not sep or not host or "/" in host):
            raise ConfigError(
                f"http_cors_origins {origin!r}: give an origin as a browser sends it, "
                "scheme://host[:port] with no path (e.g. https://app.example), or *"
            )
    if len(set(config.served_model_name)) != len(config.served_model_name):
        raise ConfigError("served_model_name gives a name twice: list each name once")


def _check_address(name: str, address: str) -> None:
    _, colon, port = address.rpartition(":")  # an empty host: every interface
    if not colon or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(
            f"{name} {address!r}: use host:port with a port in 0..65535, e.g. {DEFAULT_LISTEN}"
        )


# the settings with a flag and a key of their own (the tenants' tables are read apart)
FIELDS = {f.name: f for f in dataclasses.fields(DaemonConfig) if "table" not in f.metadata}


def coerce(name: str, value: Any) -> Any:
    """`value` (from a flag or the TOML file) as setting `name` holds it; ConfigError if it
    cannot be (kvgraftd.config.values.convert)."""
    return convert(name, value, FIELDS[name].type)
