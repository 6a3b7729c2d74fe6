"""The OpenAI-compatible HTTP API: routes, bearer token, errors, and engine calls on threads.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models` and
`GET /v1/models/{id}` (the model under its names, listed while it loads:
kvgraftd.http.served_models), llama.cpp's `POST /tokenize` and `POST /detokenize`
(kvgraftd.http.token_routes) and `GET /health` (open, for probes: 200 once the model is
ready, 503 before). Every other route needs `Authorization: Bearer <token>` when the daemon
has a token_file, compared as the gRPC interceptor compares it (kvgraftd.server.security).
A method a route does not take is 405 with Allow; with http_cors_origins, Starlette's
CORSMiddleware answers browsers' preflights (OPTIONS) and marks answers to those origins.

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
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvgraft.errors import (
    Cancelled,
    KvgraftError,
    ModelNotFound,
    NotFound,
    Unauthenticated,
    printable,
)
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.engine.requests.service import EngineService
from kvgraftd.http import token_routes
from kvgraftd.http.engine_run import EngineRun
from kvgraftd.http.openai_requests import Call, chat_request, completion_request, parse_body
from kvgraftd.http.openai_responses import Completion, TextDeltas
from kvgraftd.http.served_models import ServedModel
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
    "METHOD_NOT_ALLOWED": (405, "invalid_request_error"),
    "PAYLOAD_TOO_LARGE": (413, "invalid_request_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "cancelled"),
    "UNIMPLEMENTED": (501, "invalid_request_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "DEADLINE_EXCEEDED": (504, "timeout_error"),
}
RETRY_AFTER_S = {429: 1, 503: 5}
MAX_MESSAGE_CHARS = 2048
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class PayloadTooLarge(KvgraftError):
    code = "PAYLOAD_TOO_LARGE"


class MethodNotAllowed(KvgraftError):
    code = "METHOD_NOT_ALLOWED"


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
        served: ServedModel,
        tenant_engines: Mapping[str, EngineService] | None = None,
        cors_origins: tuple[str, ...] = (),
    ) -> None:
        self._engine = engine
        self._served = served
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
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
            ],
            exception_handlers={404: self._no_route, 405: self._no_method},
            middleware=_cors(cors_origins),
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
            "Models", request, lambda: {"object": "list", "data": self._listed()}
        )

    async def model(self, request: Request) -> Response:
        wanted = request.path_params["model"]

        def find() -> dict:
            for entry in self._listed():
                if entry["id"] == wanted:
                    return entry
            raise ModelNotFound(f"model {wanted!r} is not served here; GET /v1/models lists it")

        return await self._answer("Models", request, find)

    async def chat(self, request: Request) -> Response:
        return await self._complete("ChatCompletions", request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete("Completions", request, chat=False)

    async def tokenize(self, request: Request) -> Response:
        return await self._tokens("Tokenize", request, token_routes.tokenize)

    async def detokenize(self, request: Request) -> Response:
        return await self._tokens("Detokenize", request, token_routes.detokenize)

    # ------------------------------------------------------------------
    def _listed(self) -> list[dict[str, Any]]:
        """The model under each of its names, with its state (listed while it loads)."""
        info = pb.InfoResponse()
        self._engine.describe(info)
        return self._served.entries(info)

    async def _tokens(self, method: str, request: Request, answer: Callable) -> Response:
        """The model's tokenizer, the same for every caller (a tenant's token serves), on a
        pool thread under the call limits: a long text takes CPU-seconds."""
        try:
            self._caller(request)
            body = await self._json(request)
            adapter = self._engine.engine().adapter  # 503 while the model loads

            def run() -> dict:
                with self._limiter.admitted(method, lambda: True):
                    return answer(body, adapter)

            result = await asyncio.get_running_loop().run_in_executor(self._pool, run)
        except Exception as exc:
            return self._error(method, exc)
        self._counter.add(method, grpc.StatusCode.OK)
        return JSONResponse(result)

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
            self._served.check(call.model, engine.adapter.name)  # ModelNotFound: another name
            shape = Completion(call.model, engine.fingerprint, chat)  # echoes the name used
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
        return parse_body(raw)  # strict JSON, nested at most MAX_JSON_DEPTH levels

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
        param = None  # OpenAI's: the request field at fault, as the client spelled it
        if isinstance(exc, KvgraftError):
            status, kind = STATUS.get(exc.code, (500, "server_error"))
            # OpenAI's code where it has one (model_not_found, context_length_exceeded)
            message, code = _readable(str(exc)), exc.reason or exc.code.lower()
            grpc_code = getattr(grpc.StatusCode, exc.code, grpc.StatusCode.UNKNOWN)
            param = getattr(exc, "param", None)
            if code == "context_length_exceeded" and param is None:  # the engine's: the prompt
                param = "messages" if method == "ChatCompletions" else "prompt"
        else:
            log.exception("internal error in %s", method, exc_info=exc)
            status, kind, code = 500, "server_error", "internal"
            message = f"internal error ({type(exc).__name__}); see the daemon log"
            grpc_code = grpc.StatusCode.INTERNAL
        self._counter.add(method, grpc_code)
        if isinstance(exc, Unauthenticated):
            code = "invalid_api_key"
        if param is not None:
            param = _readable(param)  # the client's own key: escaped, as the message is
        return status, {"error": {"message": message, "type": kind, "code": code, "param": param}}

    async def _no_route(self, request: Request, exc: Exception) -> Response:
        return self._error(
            "NoRoute",
            NotFound(
                f"no route {request.url.path!r}: kvgraft serves /v1/chat/completions, "
                "/v1/completions, /v1/models, /tokenize and /detokenize"
            ),
        )

    async def _no_method(self, request: Request, exc: Exception) -> Response:
        allow = dict(getattr(exc, "headers", None) or {})  # Starlette's {"Allow": ...}
        cors = " (a browser's preflight: set http_cors_origins)" * (request.method == "OPTIONS")
        refused = MethodNotAllowed(
            f"{request.method} is not served on {request.url.path!r}{cors}; it takes "
            f"{allow.get('Allow', 'another method')}"
        )
        response = self._error("NoRoute", refused)
        response.headers.update(allow)
        return response


def _cors(origins: tuple[str, ...]) -> list[Middleware]:
    """Browser apps at `origins` (* for any) may call the API: their preflights are answered
    and answers carry Access-Control-Allow-Origin. The API reads no cookies: the bearer
    token is a header the page sends itself (without a token_file, any page of those
    origins may call: CORS is off unless named)."""
    if not origins:
        return []
    return [
        Middleware(
            CORSMiddleware,
            allow_origins=list(origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],  # the SDKs' own (x-stainless-*) as well as Authorization
            expose_headers=["Retry-After"],
            max_age=600,
        )
    ]


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _readable(message: str) -> str:
    text = printable(message)
    if len(text) > MAX_MESSAGE_CHARS:
        half = MAX_MESSAGE_CHARS // 2
        text = f"{text[:half]} …[{len(text) - 2 * half} chars]… {text[-half:]}"
    return text
