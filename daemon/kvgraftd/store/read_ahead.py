"""A request stream read ahead of its consumer, on a thread of its own.

`read_ahead(messages, depth)` yields the items of `messages` in order. A
reader thread takes each from the source as soon as the source has it (for
gRPC: as soon as a message is whole) and holds up to `depth` the consumer has
not taken yet. Two things follow:

* Receiving overlaps the consumer's work: while PutArtifact hashes and
  stores one message (hashlib and LMDB release the GIL), the next one is
  being taken off the connection.
* A cut call loses less. gRPC drops the messages it holds when a call is
  cancelled; the ones the reader took are the process's own: they are
  yielded first, and only then is the source's exception raised, so the
  consumer keeps (stages) every whole message that got this far.

With `idle_s`, a source that gives nothing for that long ends the consumer's
iteration with SourceIdle (the reader may still wait on it: for gRPC, until the
call ends, which it then does).

If the consumer stops early (an error, or closing the generator), the reader
takes nothing more than the message it may be waiting for and ends; the
source is not closed here (for gRPC, ending the call ends it).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
_POLL_S = 0.1  # how often a reader with no room looks whether the consumer left


class SourceIdle(TimeoutError):
    """The source gave nothing for `idle_s` (read_ahead)."""


class _End:
    """The source ended: normally (error None) or by raising `error`."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


def read_ahead(messages: Iterable[T], depth: int = 2, idle_s: float | None = None) -> Iterator[T]:
    """The items of `messages`, in order, with up to `depth` of them taken ahead; SourceIdle
    after `idle_s` without one (None: wait for ever)."""
    if depth < 1:
        raise ValueError("read_ahead needs depth >= 1")
    held: queue.SimpleQueue[T | _End] = queue.SimpleQueue()
    room = threading.Semaphore(depth)  # a permit per item the reader may take ahead
    consumer_left = threading.Event()

    def wait_for_room() -> bool:
        while not consumer_left.is_set():
            if room.acquire(timeout=_POLL_S):
                return True
        return False

    def read() -> None:
        source = iter(messages)
        try:
            while wait_for_room():
                try:
                    item = next(source)
                except StopIteration:
                    held.put(_End(None))
                    return
                held.put(item)
        except BaseException as exc:  # handed to the consumer, raised there
            held.put(_End(exc))

    threading.Thread(target=read, name="read-ahead", daemon=True).start()
    try:
        while True:
            try:
                item = held.get(timeout=idle_s)
            except queue.Empty:
                raise SourceIdle(f"nothing arrived for {idle_s:g} s") from None
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            room.release()
            yield item
    finally:
        consumer_left.set()
