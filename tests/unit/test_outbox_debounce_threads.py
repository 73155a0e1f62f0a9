"""The outbox's ``NOTIFY`` debounce used from many threads at once (blocking enqueues of
``sdcore.sync`` beside each other and beside an event loop): every plan and settle is atomic."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest

from sdcore.outbox import _debounce


@pytest.fixture
def busy_switching() -> Iterator[None]:
    """Switch threads as often as the interpreter can, so interleavings show up."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def test_threads_giving_slots_back_at_once_never_fail(busy_switching: None) -> None:
    # Each enqueue takes the interval's slot (or a cover slot) and inserts nothing (a duplicate
    # key): it gives the slot back, and the last one out deletes the interval, exactly once. A
    # 1 ms interval: intervals open and close all the time.
    key = ("threads", "outbox", "channel")
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def enqueue_duplicates() -> None:
        start.wait()
        try:
            for _ in range(10_000):
                _debounce.settle(_debounce.plan_notify(key, 1), None)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=enqueue_duplicates) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert key not in _debounce._intervals
