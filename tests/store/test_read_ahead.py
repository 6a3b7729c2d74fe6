"""kvgraftd.store.read_ahead: order, the source's error after what was taken, bounded hold,
early exit."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvgraftd.store.read_ahead import read_ahead
from tests.support.replica_audit import wait_until


class Source:
    """Numbered items, counting how many were taken; fails after `fail_after` if set."""

    def __init__(self, count: int | None, fail_after: int | None = None) -> None:
        self.count, self.fail_after = count, fail_after
        self.taken = 0
        self.error = ConnectionResetError("the call was cut")

    def __iter__(self) -> Iterator[int]:
        while self.count is None or self.taken < self.count:
            if self.taken == self.fail_after:
                raise self.error
            self.taken += 1
            yield self.taken - 1


def _reader_alive() -> bool:
    return any(thread.name == "read-ahead" for thread in threading.enumerate())


def test_every_item_in_order() -> None:
    assert list(read_ahead(Source(1000), depth=2)) == list(range(1000))
    assert list(read_ahead(Source(0))) == []


def test_the_source_error_comes_after_every_item_taken_before_it() -> None:
    source = Source(None, fail_after=5)
    received = []
    with pytest.raises(ConnectionResetError) as raised:
        for item in read_ahead(source, depth=3):
            received.append(item)
    assert received == [0, 1, 2, 3, 4]
    assert raised.value is source.error


def test_holds_at_most_depth_items_the_consumer_has_not_taken() -> None:
    source = Source(None)
    items = read_ahead(source, depth=2)
    assert next(items) == 0
    wait_until(lambda: source.taken == 3, "the reader took two items ahead")
    time.sleep(0.3)  # a reader that did not stop would have taken many more by now
    assert source.taken == 3
    assert [next(items) for _ in range(3)] == [1, 2, 3]
    items.close()


def test_a_consumer_that_leaves_early_ends_the_reader() -> None:
    source = Source(None)
    items = read_ahead(source, depth=2)
    assert next(items) == 0
    items.close()
    wait_until(lambda: not _reader_alive(), "the reader thread ended")
    taken = source.taken
    time.sleep(0.3)
    assert source.taken == taken <= 4  # nothing taken after it ended
