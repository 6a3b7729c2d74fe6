"""The gRPC server: method table, error mapping, health and reflection.

This is the only daemon module that knows gRPC status codes. Every handler
runs through `_guard`, which maps the kvgraft.errors taxonomy to status codes
(an unexpected exception becomes INTERNAL and is logged with its traceback)
and counts calls by method and code. The bulk RPCs (PutArtifact,
GetArtifact) carry hand-encoded bytes (kvgraft.wire); every other RPC uses the
generated protobuf classes.

Before a call reaches its handler it passes the access interceptor
(kvgraftd.server.security: bearer token, probe socket) and the thread lanes
(kvgraftd.server.limits); `_guard` then admits it under the call limits
(kvgraftd.server.limits.CallLimiter), and Telemetry counts its bytes and receipts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvgraft import wire
from kvgraft.errors import InvalidArgument, KvgraftError, printable
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.engine.requests.service import EngineService
from kvgraftd.library.service import LibraryService
from kvgraftd.remote.service import RemoteService
from kvgraftd.replication.pulls import Pulls
from kvgraftd.server.bind_errors import why_not_bound
from kvgraftd.server.limits import CallLimiter, Lanes, peer_host
from kvgraftd.server.security import AccessInterceptor, TokenCheck
from kvgraftd.server.status import info_response, own_figures, stats_response
from kvgraftd.server.telemetry import CallCounter, Telemetry
from kvgraftd.store.service import StoreService

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Kvgraft"].full_name


# What an error message may repeat of the caller's input: a message quotes what it refuses
# (an id, a tag, a label), and a refused input may be anything.
MAX_WORD_CHARS = 256  # one word: an id or a hash is 64 characters, a path rarely longer
KEPT_WORD_CHARS = 64
MAX_MESSAGE_CHARS = 2048
# The message travels in the grpc-message trailer, percent-encoded: every byte outside
# printable ASCII (and "%") takes 3. A client refuses trailers past its metadata limit (8 KiB
# by default, some at random from there to 16 KiB) and sees RESOURCE_EXHAUSTED instead of
# the error: 2,048 characters of CJK text are 18 KiB there. Half the limit leaves room.
MAX_MESSAGE_WIRE_BYTES = 4096


def _readable(message: str) -> str:
    """The message as a terminal or a log may show it: every character that moves the cursor,
    reorders text or hides (controls, bidirectional overrides, invisible format
    characters) escaped as Python writes it (\\x1b, \\u202e); a word longer than
    MAX_WORD_CHARS cut to its start and its length; a message longer than MAX_MESSAGE_CHARS,
    or longer than MAX_MESSAGE_WIRE_BYTES once encoded for the trailer, cut in the middle,
    so the end that says what to do stays."""
    escaped = printable(message)
    words = [
        word if len(word) <= MAX_WORD_CHARS else f"{word[:KEPT_WORD_CHARS]}…[{len(word)} chars]"
        for word in escaped.split(" ")
    ]
    text = " ".join(words)
    if len(text) > MAX_MESSAGE_CHARS:
        text = _cut_middle(text, [1] * len(text), MAX_MESSAGE_CHARS)
    costs = [_wire_bytes(c) for c in text]
    if sum(costs) > MAX_MESSAGE_WIRE_BYTES:
        text = _cut_middle(text, costs, MAX_MESSAGE_WIRE_BYTES)
    return text


def _wire_bytes(char: str) -> int:
    """What `char` takes in a grpc-message trailer (percent-encoded)."""
    return 1 if " " <= char <= "~" and char != "%" else 3 * len(char.encode())


def _cut_middle(text: str, costs: list[int], budget: int) -> str:
    """`text` with its middle replaced by a count, its start and its end costing at most
    `budget` together (the marker's own cost is set aside first)."""
    half = (budget - 64) // 2  # the marker: " …[N chars]… ", at most 64 bytes encoded
    head = _fitting(costs, half)
    tail = _fitting(costs[::-1], half)
    cut = len(text) - head - tail
    return f"{text[:head]} …[{cut} chars]… {text[len(text) - tail :]}"


def _fitting(costs: list[int], budget: int) -> int:
    """How many leading characters cost at most `budget`."""
    spent = 0
    for count, cost in enumerate(costs):
        spent += cost
        if spent > budget:
            return count
    return len(costs)


def _status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, KvgraftError):
        return grpc.StatusCode[exc.code], _readable(str(exc))
    log.exception("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the daemon log"


def _guard(
    method: str,
    fn: Callable,
    counter: CallCounter,
    streaming: bool,
    *,
    limiter: CallLimiter | None = None,
    request_streaming: bool = False,
) -> Callable:
    """Wrap a handler so errors map to status codes in one place, within the limits."""

    def abort(context: grpc.ServicerContext, exc: BaseException):
        code, message = _status(exc)
        counter.add(method, code)
        context.abort(code, message)

    def admitted(context: grpc.ServicerContext):
        return limiter.admitted(method, context.is_active) if limiter else nullcontext()

    def bounded(messages, from_client: bool = False):
        return limiter.bounded(method, messages, from_client) if limiter else messages

    if streaming:

        def stream_handler(request, context: grpc.ServicerContext) -> Iterator:
            try:
                with admitted(context):
                    yield from bounded(fn(request, context))
            except grpc.RpcError:
                counter.add(method, grpc.StatusCode.CANCELLED)
                raise
            except Exception as exc:
                abort(context, exc)
            counter.add(method, grpc.StatusCode.OK)

        return stream_handler

    def unary_handler(request, context: grpc.ServicerContext):
        try:
            with admitted(context):
                response = fn(bounded(request, True) if request_streaming else request, context)
        except grpc.RpcError:
            counter.add(method, grpc.StatusCode.CANCELLED)
            raise
        except Exception as exc:
            abort(context, exc)
        counter.add(method, grpc.StatusCode.OK)
        return response

    return unary_handler


def _parsed(fn: Callable, request_cls) -> Callable:
    """Parse the request inside the guard: gRPC's own deserializer would turn
    undecodable bytes into INTERNAL, where they are the caller's INVALID_ARGUMENT."""

    def handler(raw: bytes, context: grpc.ServicerContext):
        try:
            request = request_cls.FromString(raw)
        except DecodeError as exc:
            raise InvalidArgument(
                f"the request does not parse as a {request_cls.DESCRIPTOR.full_name} ({exc}); "
                "send the message of proto/kvgraft/v1/kvgraft.proto"
            ) from None
        return fn(request, context)

    return handler


@dataclass(frozen=True)
class Services:
    """What the RPCs call, every one built by kvgraftd.main (the composition root): the
    operator's, and with [tenants] one set per tenant (kvgraftd.server.tenants)."""

    store: StoreService
    engine: EngineService
    library: LibraryService
    remote: RemoteService  # RemoteService(None) when no [remote] is configured
    pulls: Pulls
    tenant: str = ""  # whose calls they answer ("": the operator's)
    tenants: tuple[str, ...] = ()  # the operator's: the tenants configured


Route = Callable[[grpc.ServicerContext, str], Services]  # the services of a call's caller


def _info(s: Services, r: pb.InfoRequest) -> pb.InfoResponse:
    response = info_response(s.store, s.engine, r, s.remote)
    response.tenant = s.tenant
    response.tenants.extend(s.tenants)
    if s.tenant:
        own_figures(response)
    return response


def _stats(s: Services, counter: CallCounter, r: pb.StatsRequest) -> pb.StatsResponse:
    response = stats_response(s.store, s.engine, counter, s.remote, r)
    if s.tenant:
        own_figures(response)
    return response


def _method_table(
    route: Route, counter: CallCounter, limiter: CallLimiter | None = None
) -> dict[str, grpc.RpcMethodHandler]:
    def serialize(message) -> bytes:
        return message.SerializeToString()

    def routed(name: str, fn: Callable) -> Callable:
        return lambda request, context: fn(route(context, name), request, context)

    def unary(name: str, fn: Callable, request_cls) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            _guard(name, _parsed(routed(name, fn), request_cls), counter, False, limiter=limiter),
            request_deserializer=None,  # parsed by _parsed, inside the guard
            response_serializer=serialize,
        )

    def streaming(name: str, fn: Callable, request_cls, serializer=None) -> grpc.RpcMethodHandler:
        return grpc.unary_stream_rpc_method_handler(
            _guard(name, _parsed(routed(name, fn), request_cls), counter, True, limiter=limiter),
            request_deserializer=None,  # parsed by _parsed, inside the guard
            response_serializer=serializer,  # None: the handler yields wire bytes
        )

    table = {
        "Info": unary("Info", lambda s, r, c: _info(s, r), pb.InfoRequest),
        "MissingPages": unary(
            "MissingPages", lambda s, r, c: s.store.missing_pages(r), pb.MissingPagesRequest
        ),
        "List": unary("List", lambda s, r, c: s.store.list(r), pb.ListRequest),
        "Stat": unary("Stat", lambda s, r, c: s.store.stat(r), pb.StatRequest),
        "Delete": unary("Delete", lambda s, r, c: s.store.delete(r), pb.DeleteRequest),
        "Pin": unary("Pin", lambda s, r, c: s.store.pin(r), pb.PinRequest),
        "Publish": unary("Publish", lambda s, r, c: s.store.publish(r), pb.PublishRequest),
        "Stats": unary(
            "Stats",
            lambda s, r, c: _stats(s, counter, r),
            pb.StatsRequest,
        ),
        "RemoteStatus": unary(
            "RemoteStatus", lambda s, r, c: s.remote.status(r), pb.RemoteStatusRequest
        ),
        "RemoteSync": unary("RemoteSync", lambda s, r, c: s.remote.sync(r), pb.RemoteSyncRequest),
        "GetArtifact": streaming(
            "GetArtifact", lambda s, r, c: s.store.get_artifact(r), pb.GetArtifactRequest
        ),
        "Watch": streaming(
            "Watch", lambda s, r, c: s.store.watch(r, c.is_active), pb.WatchRequest, serialize
        ),
        "Replicate": streaming(
            "Replicate",
            lambda s, r, c: s.pulls.replicate(r, c.is_active),
            pb.ReplicateRequest,
            serialize,
        ),
        "Scrub": streaming(
            "Scrub", lambda s, r, c: s.store.scrub(r, c.is_active), pb.ScrubRequest, serialize
        ),
        "PutArtifact": grpc.stream_unary_rpc_method_handler(
            _guard(
                "PutArtifact",
                # staged per host
                routed(
                    "PutArtifact", lambda s, it, c: s.store.put_artifact(it, peer_host(c.peer()))
                ),
                counter,
                streaming=False,
                limiter=limiter,
                request_streaming=True,
            ),
            request_deserializer=None,  # raw bytes, parsed by kvgraft.wire
            response_serializer=serialize,
        ),
    }
    table.update(
        Lookup=unary("Lookup", lambda s, r, c: s.engine.lookup(r), pb.LookupRequest),
        Deposit=unary(
            "Deposit", lambda s, r, c: s.engine.deposit(r, c.is_active), pb.DepositRequest
        ),
        Verify=unary("Verify", lambda s, r, c: s.engine.verify(r, c.is_active), pb.VerifyRequest),
        Generate=streaming(
            "Generate",
            lambda s, r, c: s.engine.generate(r, c.is_active),
            pb.GenerateRequest,
            serialize,
        ),
        Graft=streaming(
            "Graft", lambda s, r, c: s.engine.graft(r, c.is_active), pb.GraftRequest, serialize
        ),
    )
    table.update(
        LibraryAdd=unary("LibraryAdd", lambda s, r, c: s.library.add(r), pb.LibraryAddRequest),
        LibraryList=unary("LibraryList", lambda s, r, c: s.library.list(r), pb.LibraryListRequest),
        LibraryRemove=unary(
            "LibraryRemove", lambda s, r, c: s.library.remove(r), pb.LibraryRemoveRequest
        ),
        Ask=unary("Ask", lambda s, r, c: s.library.ask(r), pb.AskRequest),
    )
    return table


@dataclass(frozen=True)
class ServerSettings:
    """What the server enforces and counts besides its method table (built by kvgraftd.main)."""

    limiter: CallLimiter | None = None
    options: list[tuple[str, int]] = field(
        default_factory=lambda: [("grpc.so_reuseport", 0), *wire.CHANNEL_OPTIONS]
    )
    credentials: grpc.ServerCredentials | None = None  # None: plaintext
    token_check: TokenCheck | None = None
    probe_socket: str = ""  # "unix:PATH" for kvgraftd.ops.readiness when TLS is on; "": none
    counter: CallCounter = field(default_factory=CallCounter)
    telemetry: Telemetry = field(default_factory=Telemetry)


def _aborter(counter: CallCounter) -> Callable[[grpc.ServicerContext, str, KvgraftError], NoReturn]:
    """How the access interceptor ends a call it refuses: counted, with the error's code."""

    def abort(context: grpc.ServicerContext, method: str, exc: KvgraftError) -> NoReturn:
        code, message = _status(exc)
        counter.add(method.removeprefix(f"/{SERVICE_NAME}/").lstrip("/"), code)
        context.abort(code, message)
        raise AssertionError("context.abort returns only by raising")

    return abort


def create_server(
    services: Services | Route,
    listen: str,
    *,
    workers: int = 16,
    settings: ServerSettings | None = None,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Build (not start) the server; returns it, the bound port and the health servicer.
    `services`: what every call reaches, or a Route choosing them by the caller."""
    settings = settings or ServerSettings()
    limiter = settings.limiter
    counter = settings.counter
    server = grpc.server(
        futures.ThreadPoolExecutor(
            max_workers=limiter.pool_threads() if limiter else workers, thread_name_prefix="rpc"
        ),
        options=settings.options,
        interceptors=[
            Lanes(),  # first: it moves the final behavior, refusals included
            AccessInterceptor(
                settings.token_check, _aborter(counter), probe_socket=bool(settings.probe_socket)
            ),
        ],
    )
    route = services if callable(services) else (lambda context, method: services)
    table = _method_table(route, counter, limiter)
    instrumented = {name: settings.telemetry.instrument(name, h) for name, h in table.items()}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, instrumented),)
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    set_serving(health_servicer, False)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = _bind(server, listen, settings.credentials)
    if settings.probe_socket:
        _bind(server, settings.probe_socket, None)
    return server, port, health_servicer


def _bind(server: grpc.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """The port bound; an OSError saying why and what to do when gRPC cannot bind."""
    try:
        if credentials is not None:
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # "Failed to bind to address": the reason is worked out below
        port = 0
    if port == 0:
        raise OSError(why_not_bound(address))
    return port


def set_serving(health_servicer: health.HealthServicer, serving: bool) -> None:
    """Health of the whole server ("") and of the kvgraft service."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else (health_pb2.HealthCheckResponse.NOT_SERVING)
    )
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, status)
