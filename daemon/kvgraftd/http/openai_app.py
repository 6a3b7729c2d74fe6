"""The OpenAI-compatible HTTP API: routes, bearer token, errors, and engine calls on threads.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`,
`GET /v1/models/{id}` and `GET /health` (open, for probes: 200 once the model is ready,
503 before). Every other route needs `Authorization: Bearer <token>` when the daemon
has a token_file, compared as the gRPC interceptor compares it (kvgraftd.server.security).

An engine call runs on a thread of this app's pool, inside the same admission as a gRPC
call (CallLimiter: max_concurrent_rpcs, workers, max_call_s) and the engine's own
(max_running_contexts, queue): a request beyond them is 429 with Retry-After, one that
waits while the model loads 503 with Retry-After. A stream answers its status only once
its first event is known, so a refusal is a real status, never an error inside a 200.
A client that hangs up cancels its request: the engine drops its pass at the next step.

This module is the only place HTTP statuses are chosen: `STATUS` maps the kvgraft.errors
taxonomy (what gRPC maps to its codes) to a status and OpenAI's error type, and every
error is OpenAI's error JSON, `{"error": {"message", "type", "code", "param"}}`, with the
message escaped and cut as the gRPC trailer's is. No traceback reaches a client or the
log for a client's mistake; an unexpected exception is logged once and answered 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvgraft.errors import (
    Cancelled,
    InvalidArgument,
    KvgraftError,
    NotFound,
    Unauthenticated,
    printable,
)
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.engine.requests.service import EngineService
from kvgraftd.http.openai_requests import Call, chat_request, completion_request
from kvgraftd.http.openai_responses import Completion, TextDeltas
from kvgraftd.server.limits import CallLimiter
from kvgraftd.server.security import TokenCheck
from kvgraftd.server.telemetry import CallCounter, Telemetry

log = logging.getLogger(__name__)

# kvgraft.errors code -> (HTTP status, OpenAI error type)
STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "PAYLOAD_TOO_LARGE": (413, "invalid_request_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "cancelled"),
    "UNIMPLEMENTED": (501, "invalid_request_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "DEADLINE_EXCEEDED": (504, "timeout_error"),
}
RETRY_AFTER_S = {429: 1, 503: 5}
MAX_MESSAGE_CHARS = 2048
WAIT_POLL_S = 0.5  # how often a waiting non-streamed request looks for a hang-up
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class PayloadTooLarge(KvgraftError):
    code = "PAYLOAD_TOO_LARGE"


class OpenAiApp:
    """The Starlette application over the engine service (built by kvgraftd.main)."""

    def __init__(
        self,
        engine: EngineService,
        limiter: CallLimiter,
        token_check: TokenCheck | None,
        counter: CallCounter,
        telemetry: Telemetry,
        keep_conversations: bool,
        max_request_bytes: int,
        tenant_engines: Mapping[str, EngineService] | None = None,
    ) -> None:
        self._engine = engine
        self._tenant_engines = dict(tenant_engines or {})  # a tenant's token: its engine
        self._limiter = limiter
        self._token_check = token_check
        self._counter = counter
        self._telemetry = telemetry
        self._keep = keep_conversations
        self._max_request_bytes = max_request_bytes
        self._pool = ThreadPoolExecutor(limiter.pool_threads(), thread_name_prefix="http")
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
            ],
            exception_handlers={404: self._no_route, 405: self._no_method},
        )

    # ------------------------------------------------------------------
    # routes

    async def health(self, request: Request) -> Response:
        info = pb.InfoResponse()
        self._engine.describe(info)
        status = 200 if info.model_state in ("ready", "none") else 503
        return JSONResponse({"status": info.model_state}, status_code=status)

    async def models(self, request: Request) -> Response:
        return await self._answer(
            "Models", request, lambda: {"object": "list", "data": self._served()}
        )

    async def model(self, request: Request) -> Response:
        wanted = request.path_params["model"]

        def find() -> dict:
            for entry in self._served():
                if entry["id"] == wanted:
                    return entry
            raise NotFound(f"model {wanted!r} is not served here; GET /v1/models lists it")

        return await self._answer("Models", request, find)

    async def chat(self, request: Request) -> Response:
        return await self._complete("ChatCompletions", request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete("Completions", request, chat=False)

    # ------------------------------------------------------------------
    def _served(self) -> list[dict[str, Any]]:
        """The model this daemon serves (none before it is ready, or without one)."""
        info = pb.InfoResponse()
        self._engine.describe(info)
        if info.model_state != "ready":
            return []
        return [
            {
                "id": info.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "kvgraft",
                "kvgraft": {
                    "fingerprint": info.model_fingerprint.hex(),
                    "page_tokens": info.page_tokens,
                    "attention": info.profile.attention,
                    "products": info.profile.products,
                },
            }
        ]

    async def _answer(self, method: str, request: Request, build: Callable[[], Any]) -> Response:
        try:
            self._caller(request)
            body = build()
        except Exception as exc:
            return self._error(method, exc)
        self._counter.add(method, grpc.StatusCode.OK)
        return JSONResponse(body)

    async def _complete(self, method: str, request: Request, chat: bool) -> Response:
        try:
            service = self._caller(request)
            body = await self._json(request)
            call = chat_request(body, self._keep) if chat else completion_request(body)
            engine = service.engine()  # 503 while the model loads
            if call.model != engine.adapter.name:
                raise NotFound(
                    f"model {call.model!r} is not served here (this daemon serves "
                    f"{engine.adapter.name!r}); GET /v1/models lists it"
                )
            shape = Completion(call.model, engine.fingerprint, chat)
            run = EngineRun(self._run_engine(method, call, service))
            self._pool.submit(run.pump, asyncio.get_running_loop())
            first = await run.next_or_disconnect(request)
        except Exception as exc:
            return self._error(method, exc)
        if call.stream:
            decode = lambda ids: engine.adapter.decode(ids, skip_special=True)  # noqa: E731
            stops = list(call.request.options.stop)
            events = self._stream(method, run, first, shape, call, TextDeltas(decode, stops))
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            tokens = []
            event = first
            while event.WhichOneof("event") != "result":
                tokens.append(event.token)
                event = await run.next_or_disconnect(request)
        except Exception as exc:
            return self._error(method, exc)
        self._counter.add(method, grpc.StatusCode.OK)
        self._telemetry.observe_receipt(method, event.result.receipt)
        return JSONResponse(shape.whole(event.result, tokens, call.logprobs))

    async def _stream(
        self,
        method: str,
        run: EngineRun,
        first: pb.GenerateResponse,
        shape: Completion,
        call: Call,
        deltas: TextDeltas,
    ) -> AsyncIterator[str]:
        event, started, ended = first, False, False
        try:
            while event.WhichOneof("event") == "token":
                text = deltas.add(event.token.token_id)
                if text or call.logprobs or not started:
                    yield _sse(
                        shape.chunk(text, event.token if call.logprobs else None, not started)
                    )
                    started = True
                event = await run.next()
            result = event.result
            yield _sse(shape.last_chunk(deltas.rest(result.text), result))
            if call.include_usage:
                yield _sse(shape.usage_chunk(result))
            yield "data: [DONE]\n\n"
            ended = True
            self._counter.add(method, grpc.StatusCode.OK)
            self._telemetry.observe_receipt(method, result.receipt)
        except Exception as exc:  # after the 200: the error travels as an event
            ended = True
            _, body = self._error_body(method, exc)
            yield _sse(body)
        finally:
            if not ended:  # the client hung up (the task was cancelled): counted as such
                self._counter.add(method, grpc.StatusCode.CANCELLED)
            run.cancel()  # its pass is dropped at the engine's next step

    def _run_engine(
        self, method: str, call: Call, service: EngineService
    ) -> Callable[[Callable[[], bool]], Iterator]:
        """The engine call of `call`, to run on a pool thread under the call limits."""

        def run(is_active: Callable[[], bool]) -> Iterator[pb.GenerateResponse]:
            with self._limiter.admitted(method, is_active):
                if isinstance(call.request, pb.GraftRequest):
                    events = service.graft(call.request, is_active)
                else:
                    events = service.generate(call.request, is_active)
                yield from self._limiter.bounded(method, events)

        return run

    # ------------------------------------------------------------------
    def _caller(self, request: Request) -> EngineService:
        """The engine service of the caller its bearer token names (a tenant's own: its
        reuse, deposits and share of the engine, kvgraftd.engine.requests.tenant_engine)."""
        if self._token_check is None:
            return self._engine
        given = request.headers.get("authorization")
        tenant = self._token_check.verify([("authorization", given)] if given is not None else [])
        return self._tenant_engines[tenant] if tenant else self._engine

    async def _json(self, request: Request) -> Any:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._max_request_bytes:
            raise self._too_large()
        raw = bytearray()
        try:
            async for piece in request.stream():
                raw += piece
                if len(raw) > self._max_request_bytes:
                    raise self._too_large()
        except ClientDisconnect:
            raise Cancelled("the client hung up while sending its request") from None
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidArgument(
                f"the request body is not JSON ({exc}); send a JSON object"
            ) from None

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"the request body is larger than max_request_bytes ({self._max_request_bytes} "
            "bytes); send a shorter prompt or raise the daemon's max_request_bytes"
        )

    def _error(self, method: str, exc: BaseException) -> Response:
        status, body = self._error_body(method, exc)
        retry = RETRY_AFTER_S.get(status)
        headers = {"Retry-After": str(retry)} if retry else None
        return JSONResponse(body, status_code=status, headers=headers)

    def _error_body(self, method: str, exc: BaseException) -> tuple[int, dict]:
        if isinstance(exc, KvgraftError):
            status, kind = STATUS.get(exc.code, (500, "server_error"))
            message, code = _readable(str(exc)), exc.code.lower()
            grpc_code = getattr(grpc.StatusCode, exc.code, grpc.StatusCode.UNKNOWN)
        else:
            log.exception("internal error in %s", method, exc_info=exc)
            status, kind, code = 500, "server_error", "internal"
            message = f"internal error ({type(exc).__name__}); see the daemon log"
            grpc_code = grpc.StatusCode.INTERNAL
        self._counter.add(method, grpc_code)
        if isinstance(exc, Unauthenticated):
            code = "invalid_api_key"
        return status, {"error": {"message": message, "type": kind, "code": code, "param": None}}

    async def _no_route(self, request: Request, exc: Exception) -> Response:
        return self._error(
            "NoRoute",
            NotFound(
                f"no route {request.url.path!r}: kvgraft serves /v1/chat/completions, "
                "/v1/completions and /v1/models"
            ),
        )

    async def _no_method(self, request: Request, exc: Exception) -> Response:
        return self._error(
            "NoRoute",
            InvalidArgument(f"{request.method} is not served on {request.url.path!r}"),
        )


class EngineRun:
    """One engine call on a pool thread, its events handed to the event loop one by one.

    `pump` runs on the thread: it calls the engine with an `is_active` that turns false
    once the request is cancelled, and puts every event (then an end marker, or the
    exception) on an asyncio queue. The loop side takes them with `next`.
    """

    _END = object()

    def __init__(self, start: Callable[[Callable[[], bool]], Iterator]) -> None:
        self._start = start
        self._active = threading.Event()
        self._active.set()
        self._queue: asyncio.Queue = asyncio.Queue()

    def pump(self, loop: asyncio.AbstractEventLoop) -> None:
        def put(item: object) -> None:
            loop.call_soon_threadsafe(self._queue.put_nowait, item)

        try:
            events = self._start(self._active.is_set)
            try:
                for event in events:
                    put(event)
                    if not self._active.is_set():
                        break
            finally:
                events.close()
            put(self._END)
        except BaseException as exc:  # handed to the loop, which answers it
            put(exc)

    def cancel(self) -> None:
        self._active.clear()

    async def next(self) -> pb.GenerateResponse:
        item = await self._queue.get()
        if item is self._END:
            raise Cancelled("the request was cancelled before its result")
        if isinstance(item, BaseException):
            raise item
        return item

    async def next_or_disconnect(self, request: Request) -> pb.GenerateResponse:
        """The next event; Cancelled (and the call cancelled) once the client hangs up."""
        task = asyncio.ensure_future(self.next())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=WAIT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise Cancelled("the client hung up")
        except BaseException:
            self.cancel()
            task.cancel()
            raise


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _readable(message: str) -> str:
    text = printable(message)
    if len(text) > MAX_MESSAGE_CHARS:
        half = MAX_MESSAGE_CHARS // 2
        text = f"{text[:half]} …[{len(text) - 2 * half} chars]… {text[-half:]}"
    return text
