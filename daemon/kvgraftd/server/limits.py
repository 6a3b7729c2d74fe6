"""What one daemon accepts at once, and for how long: admission, workers, deadlines, lanes.

* **Admission**: at most `max_concurrent_rpcs` kvgraft calls are in progress
  (running or waiting for a worker); one more is refused at once with
  RESOURCE_EXHAUSTED instead of queueing without bound.
* **Workers**: at most `workers` of them run at once; the others wait, each
  on an idle thread of its own, and give up when their client goes away.
* **Long-lived streams** (Watch, Replicate: a follower watches for days, idle
  most of the time) neither hold a worker nor count against
  `max_concurrent_rpcs`: at most `max_follow_streams` are open at once, one more
  is refused at once, so idle followers never lock out the calls others make.
* **Deadlines**: a stream that has run `max_call_s` ends with
  DEADLINE_EXCEEDED at its next message (follow Watch streams are exempt:
  a replica follows for days; keepalive notices when it vanishes; so are
  Replicate pulls, which take as long as the copy does). A client stream
  (PutArtifact) that sends nothing for `put_idle_s` ends with
  DEADLINE_EXCEEDED then, not at a next message that may never come: its
  pages and memory are given back (a live client that stops sending is not
  what keepalive notices). So no upload runs past max_call_s + put_idle_s.
* **Threads** (`Lanes`): the server's pool has a thread for every admitted
  kvgraft call plus `RESERVE_THREADS` for refusals; health Check runs on a
  small pool of its own, and the other non-kvgraft streams (reflection,
  health Watch), which are not admitted by count, on another. So an
  overloaded daemon still answers its health probes at once, and reflection
  streams cannot starve kvgraft calls.
* **Transport**: per-connection stream limit, request size limit and
  keepalive pings (`server_options`), so a vanished client is noticed and its
  calls cancelled.

Raises only the kvgraft.errors taxonomy; kvgraftd.server.grpc_server maps it to codes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from contextlib import closing, contextmanager

import grpc
from grpc_health.v1 import health

from kvgraft import wire
from kvgraft.errors import Cancelled, DeadlineExceeded, ResourceExhausted
from kvgraftd.config import DaemonConfig
from kvgraftd.store.read_ahead import SourceIdle, read_ahead

RESERVE_THREADS = 4
HEALTH_THREADS = 2
SIDE_THREADS = 4  # reflection and health Watch
KVGRAFT_PREFIX = "/kvgraft."
WORKER_POLL_S = 0.25
UNBOUNDED_METHODS = frozenset({"Watch", "Replicate", "Scrub"})  # exempt from max_call_s
HEALTH_CHECK = f"/{health.SERVICE_NAME}/Check"


class CallLimiter:
    """Admission, workers and stream deadlines of the kvgraft calls."""

    def __init__(
        self,
        max_concurrent_rpcs: int,
        workers: int,
        max_call_s: float,
        max_follow_streams: int = 64,
        put_idle_s: float = 60.0,
    ) -> None:
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.workers = workers
        self.max_call_s = max_call_s
        self.max_follow_streams = max_follow_streams
        self.put_idle_s = put_idle_s
        self._lock = threading.Lock()
        self._in_progress = 0
        self._following = 0
        self._running = threading.BoundedSemaphore(workers)

    @classmethod
    def from_config(cls, config: DaemonConfig) -> CallLimiter:
        return cls(
            config.max_concurrent_rpcs,
            config.workers,
            config.max_call_s,
            config.max_follow_streams,
            config.put_idle_s,
        )

    @property
    def in_progress(self) -> int:
        with self._lock:
            return self._in_progress

    def pool_threads(self) -> int:
        """Threads the server's pool needs: one per admitted call or long-lived stream,
        plus the reserve."""
        return self.max_concurrent_rpcs + self.max_follow_streams + RESERVE_THREADS

    def admitted(self, method: str, is_active: Callable[[], bool]):
        """A context holding what the call needs while its body runs; refuses when full."""
        if method in UNBOUNDED_METHODS:
            return self._following_stream(method)
        return self._worker(method, is_active)

    @contextmanager
    def _following_stream(self, method: str) -> Iterator[None]:
        with self._lock:
            if self._following >= self.max_follow_streams:
                raise ResourceExhausted(
                    f"kvgraftd has {self._following} Watch, Replicate and Scrub streams open, its "
                    f"limit (max_follow_streams); {method} was not started: close idle "
                    "followers or raise the limit"
                )
            self._following += 1
        try:
            yield
        finally:
            with self._lock:
                self._following -= 1

    @contextmanager
    def _worker(self, method: str, is_active: Callable[[], bool]) -> Iterator[None]:
        """Hold an admission slot and a worker for the body; refuse when full."""
        with self._lock:
            if self._in_progress >= self.max_concurrent_rpcs:
                raise ResourceExhausted(
                    f"kvgraftd is busy: {self._in_progress} calls in progress, its limit "
                    f"(max_concurrent_rpcs); {method} was not started: retry with backoff"
                )
            self._in_progress += 1
        try:
            while not self._running.acquire(timeout=WORKER_POLL_S):
                if not is_active():
                    raise Cancelled(f"{method} was cancelled while waiting for a worker")
            try:
                yield
            finally:
                self._running.release()
        finally:
            with self._lock:
                self._in_progress -= 1

    def bounded(
        self, method: str, messages: Iterable[bytes], from_client: bool = False
    ) -> Iterator:
        """`messages`, ended with DeadlineExceeded once the call has run max_call_s, and,
        `from_client` (a request stream), once the client has sent nothing for put_idle_s."""
        if method in UNBOUNDED_METHODS:
            yield from messages
            return
        deadline = time.monotonic() + self.max_call_s
        # one message taken ahead, on a thread: waiting for it can time out
        source = read_ahead(messages, 1, self.put_idle_s) if from_client else iter(messages)
        with closing(source):
            try:
                for message in source:
                    if time.monotonic() > deadline:
                        raise DeadlineExceeded(
                            f"{method} ran longer than the daemon allows (max_call_s = "
                            f"{self.max_call_s:g} s); split the work into smaller calls"
                        )
                    yield message
            except SourceIdle:
                raise DeadlineExceeded(
                    f"{method} sent no message for {self.put_idle_s:g} s, the daemon's limit "
                    "(put_idle_s): send without pauses; to resume, ask MissingPages and send "
                    "what is missing in a new call"
                ) from None


def peer_host(peer: str) -> str:
    """The client host of a gRPC peer address, its port left out ("ipv4:10.0.0.1:5000" ->
    "ipv4:10.0.0.1", "ipv6:[::1]:5000" -> "ipv6:[::1]"): what one client is charged as,
    however many connections it opens. Every Unix-socket client is one ("unix")."""
    if peer.startswith("unix"):
        return "unix"
    return peer.rpartition(":")[0] or peer


class Lanes(grpc.ServerInterceptor):
    """Runs health Check, and the other non-kvgraft calls, on pools of their own.

    Install it first (outermost), so the behavior it moves is the final one.
    """

    def __init__(self) -> None:
        self.health_pool = futures.ThreadPoolExecutor(HEALTH_THREADS, thread_name_prefix="health")
        self.side_pool = futures.ThreadPoolExecutor(SIDE_THREADS, thread_name_prefix="side")

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(KVGRAFT_PREFIX):
            return handler
        pool = self.health_pool if method == HEALTH_CHECK else self.side_pool
        field = behavior_field(handler)
        behavior = getattr(handler, field)

        def laned(request, context):
            return behavior(request, context)

        # grpc runs a behavior on its `experimental_thread_pool` when it has one.
        laned.experimental_thread_pool = pool  # type: ignore[attr-defined]
        return handler._replace(**{field: laned})


def behavior_field(handler: grpc.RpcMethodHandler) -> str:
    if handler.request_streaming:
        return "stream_stream" if handler.response_streaming else "stream_unary"
    return "unary_stream" if handler.response_streaming else "unary_unary"


def server_options(config: DaemonConfig) -> list[tuple[str, int]]:
    """gRPC server options for the limits of `config`."""
    return [
        ("grpc.so_reuseport", 0),
        *wire.CHANNEL_OPTIONS,
        ("grpc.max_concurrent_streams", config.max_streams_per_connection),
        ("grpc.max_receive_message_length", config.max_request_bytes),
        # The daemon pings every connection, idle ones too, and hangs up on silence.
        ("grpc.keepalive_time_ms", int(config.keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        # gRPC 1.85 waits for a ping's answer up to ping_timeout_ms (60 s by default),
        # whatever keepalive_timeout_ms says: set both.
        ("grpc.http2.ping_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        # Clients may ping it too (Watch followers behind NAT), every 10 s at most.
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
    ]
