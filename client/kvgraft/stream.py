"""`Stream`: the messages of a server stream, and `cancel()` to end it early.

What a streaming call of kvgraft.Client returns (Watch, GetArtifact as raw
messages) and what replication tracks to cancel a stalled transfer
(kvgraft.replication.stream_guard). `cancel()` may come from any thread and
is a no-op once the call has ended; the reader then sees
kvgraft.errors.Cancelled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


class Stream(Iterator[T]):
    """The messages of a server stream, and `cancel()` to end it early (from any thread)."""

    def __init__(self, messages: Iterator[T], cancel: Callable[[], object]) -> None:
        self._messages = messages
        self._cancel = cancel

    def __next__(self) -> T:
        return next(self._messages)

    def cancel(self) -> None:
        self._cancel()  # a no-op once the call has ended

    def close(self) -> None:
        """Cancel the call and close the iterator (as for a generator)."""
        self._cancel()
        close = getattr(self._messages, "close", None)
        if close is not None:
            close()
