"""The gRPC server: method table, error mapping, health and reflection.

This is the only daemon module that knows gRPC status codes. Every handler
runs through `_guard`, which maps the kvgraft.errors taxonomy to status codes
(an unexpected exception becomes INTERNAL and is logged with its traceback)
and counts calls by method and code. The bulk RPCs (PutArtifact,
GetArtifact) carry hand-encoded bytes (kvgraft.wire); every other RPC uses the
generated protobuf classes.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvgraft import wire
from kvgraft.errors import InvalidArgument, KvgraftError
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.engine_service import EngineService
from kvgraftd.service import StoreService

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Kvgraft"].full_name


class CallCounter:
    """Calls served, by "Method:CODE"."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, method: str, code: grpc.StatusCode) -> None:
        with self._lock:
            self._counts[f"{method}:{code.name}"] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def _status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, KvgraftError):
        return grpc.StatusCode[exc.code], str(exc)
    log.exception("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the daemon log"


def _guard(method: str, fn: Callable, counter: CallCounter, streaming: bool) -> Callable:
    """Wrap a handler so errors map to status codes in one place."""

    def abort(context: grpc.ServicerContext, exc: BaseException):
        code, message = _status(exc)
        counter.add(method, code)
        context.abort(code, message)

    if streaming:

        def stream_handler(request, context: grpc.ServicerContext) -> Iterator:
            try:
                yield from fn(request, context)
            except grpc.RpcError:
                counter.add(method, grpc.StatusCode.CANCELLED)
                raise
            except Exception as exc:
                abort(context, exc)
            counter.add(method, grpc.StatusCode.OK)

        return stream_handler

    def unary_handler(request, context: grpc.ServicerContext):
        try:
            response = fn(request, context)
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


def _method_table(
    service: StoreService, engine: EngineService, counter: CallCounter
) -> dict[str, grpc.RpcMethodHandler]:
    def serialize(message) -> bytes:
        return message.SerializeToString()

    def unary(name: str, fn: Callable, request_cls) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            _guard(name, _parsed(fn, request_cls), counter, streaming=False),
            request_deserializer=None,  # parsed by _parsed, inside the guard
            response_serializer=serialize,
        )

    def streaming(name: str, fn: Callable, request_cls, serializer=None) -> grpc.RpcMethodHandler:
        return grpc.unary_stream_rpc_method_handler(
            _guard(name, _parsed(fn, request_cls), counter, streaming=True),
            request_deserializer=None,  # parsed by _parsed, inside the guard
            response_serializer=serializer,  # None: the handler yields wire bytes
        )

    table = {
        "Info": unary("Info", lambda r, c: _info(service, engine, r), pb.InfoRequest),
        "MissingPages": unary(
            "MissingPages", lambda r, c: service.missing_pages(r), pb.MissingPagesRequest
        ),
        "List": unary("List", lambda r, c: service.list(r), pb.ListRequest),
        "Stat": unary("Stat", lambda r, c: service.stat(r), pb.StatRequest),
        "Delete": unary("Delete", lambda r, c: service.delete(r), pb.DeleteRequest),
        "Pin": unary("Pin", lambda r, c: service.pin(r), pb.PinRequest),
        "Stats": unary("Stats", lambda r, c: _stats(service, counter, r), pb.StatsRequest),
        "GetArtifact": streaming(
            "GetArtifact", lambda r, c: service.get_artifact(r), pb.GetArtifactRequest
        ),
        "Watch": streaming(
            "Watch", lambda r, c: service.watch(r, c.is_active), pb.WatchRequest, serialize
        ),
        "PutArtifact": grpc.stream_unary_rpc_method_handler(
            _guard("PutArtifact", lambda it, c: service.put_artifact(it), counter, streaming=False),
            request_deserializer=None,  # raw bytes, parsed by kvgraft.wire
            response_serializer=serialize,
        ),
    }
    table.update(
        Lookup=unary("Lookup", lambda r, c: engine.lookup(r), pb.LookupRequest),
        Deposit=unary("Deposit", lambda r, c: engine.deposit(r), pb.DepositRequest),
        Verify=unary("Verify", lambda r, c: engine.verify(r), pb.VerifyRequest),
        Generate=streaming(
            "Generate", lambda r, c: engine.generate(r), pb.GenerateRequest, serialize
        ),
        Graft=streaming("Graft", lambda r, c: engine.graft(r), pb.GraftRequest, serialize),
    )
    return table


def _info(service: StoreService, engine: EngineService, request: pb.InfoRequest) -> pb.InfoResponse:
    response = service.info(request)
    engine.describe(response)
    return response


def _stats(
    service: StoreService, counter: CallCounter, request: pb.StatsRequest
) -> pb.StatsResponse:
    response = service.stats(request)
    response.rpc_calls.update(counter.snapshot())
    return response


def create_server(
    service: StoreService, engine: EngineService, listen: str, *, workers: int = 16
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Build (not start) the server; returns it, the bound port and the health servicer."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rpc"),
        options=[("grpc.so_reuseport", 0), *wire.CHANNEL_OPTIONS],
    )
    counter = CallCounter()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE_NAME, _method_table(service, engine, counter)
            ),
        )
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    set_serving(health_servicer, False)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {listen}: the address is in use or not local")
    return server, port, health_servicer


def set_serving(health_servicer: health.HealthServicer, serving: bool) -> None:
    """Health of the whole server ("") and of the kvgraft service."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else (health_pb2.HealthCheckResponse.NOT_SERVING)
    )
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, status)
