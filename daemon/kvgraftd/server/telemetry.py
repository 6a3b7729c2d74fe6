"""Counters of what passes through the server: bytes by RPC, and the engine's receipts.

`Telemetry.instrument(method, handler)` wraps a method handler's request
deserializer and response serializer, so every message is counted exactly
as it crosses the wire (`len` of its bytes, no second serialization), and
every receipt leaving Deposit, Generate or Graft is tallied: computations,
grafts (receipts that reused stored KV), reused and computed tokens.

Counting happens here, where the RPC results pass, never inside the engine
or the store. Plain Python: kvgraftd.ops.metrics exposes these figures to
Prometheus. `CallCounter` counts the calls served by method and status code
(what kvgraftd.server.grpc_server's error mapping decided).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from kvgraft.v1 import kvgraft_pb2 as pb

RECEIPT_METHODS = frozenset({"Deposit", "Generate", "Graft"})


@dataclass(frozen=True)
class TelemetrySnapshot:
    bytes_received: dict[str, int]
    bytes_sent: dict[str, int]
    computations: dict[str, int]
    grafts: dict[str, int]
    reused_tokens: int
    computed_tokens: int


class Telemetry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._received: Counter[str] = Counter()
        self._sent: Counter[str] = Counter()
        self._computations: Counter[str] = Counter()
        self._grafts: Counter[str] = Counter()
        self._reused_tokens = 0
        self._computed_tokens = 0

    def snapshot(self) -> TelemetrySnapshot:
        with self._lock:
            return TelemetrySnapshot(
                dict(self._received),
                dict(self._sent),
                dict(self._computations),
                dict(self._grafts),
                self._reused_tokens,
                self._computed_tokens,
            )

    def observe_receipt(self, method: str, receipt: pb.Receipt) -> None:
        with self._lock:
            self._computations[method] += 1
            if receipt.reused_tokens:
                self._grafts[method] += 1
            self._reused_tokens += receipt.reused_tokens
            self._computed_tokens += receipt.computed_tokens

    # ------------------------------------------------------------------
    def instrument(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """`handler` with its messages counted (and its receipts, for the engine RPCs)."""
        return handler._replace(
            request_deserializer=self._receiver(method, handler.request_deserializer),
            response_serializer=self._sender(method, handler.response_serializer),
        )

    def _receiver(self, method: str, parse: Callable | None) -> Callable:
        def receive(raw: bytes):
            with self._lock:
                self._received[method] += len(raw)
            return parse(raw) if parse is not None else raw

        return receive

    def _sender(self, method: str, serialize: Callable | None) -> Callable:
        watch_receipts = method in RECEIPT_METHODS

        def send(message) -> bytes:
            if watch_receipts:
                self._observe_message(method, message)
            raw = serialize(message) if serialize is not None else message
            with self._lock:
                self._sent[method] += len(raw)
            return raw

        return send

    def _observe_message(self, method: str, message) -> None:
        if isinstance(message, pb.DepositResponse):
            self.observe_receipt(method, message.receipt)
        elif isinstance(message, pb.GenerateResponse) and message.HasField("result"):
            self.observe_receipt(method, message.result.receipt)


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
