"""One engine call on a pool thread, its events handed to the HTTP app's event loop.

The engine's calls block (they run under the call limits and the engine's admission), so
kvgraftd.http.openai_app runs each on a thread of its pool; `EngineRun` carries the events
across, one by one, and carries a cancellation back: a client that hangs up turns the
call's `is_active` false, and the engine drops its pass at the next step. Nothing here
chooses a status or writes a response.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

from starlette.requests import Request

from kvgraft.errors import Cancelled
from kvgraft.v1 import kvgraft_pb2 as pb

WAIT_POLL_S = 0.5  # how often a waiting non-streamed request looks for a hang-up


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
