"""Run an async test on an event loop whose time only moves when every task waits (``looptime``).

The ``looptime`` pytest plugin patches every pytest-asyncio loop, and with pytest-asyncio 1.x that
left event-loop sockets unclosed in unrelated tests (``ResourceWarning`` turned into errors), so
the suite disables the plugin (``-p no:looptime_plugin``) and the tests that want loop time say so
with :func:`in_loop_time`: a fresh loop per test, time 0 at the start, closed at the end.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any, ParamSpec, TypeVar

import looptime

P = ParamSpec("P")
T = TypeVar("T")


def in_loop_time(test: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, T]:
    """Decorate an ``async def`` test to run it on a fresh fast-forwarding loop."""

    @functools.wraps(test)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        with asyncio.Runner(loop_factory=lambda: looptime.new_event_loop(start=0)) as runner:
            return runner.run(test(*args, **kwargs))

    return run


def block_loop(seconds: float) -> None:
    """What a blocking call (``time.sleep`` in async code) does to a loop-time loop: ``seconds``
    pass at once, and no callback runs meanwhile."""
    loop = asyncio.get_running_loop()
    assert isinstance(loop, looptime.LoopTimeEventLoop), "only inside @in_loop_time"
    loop.setup_looptime(start=loop.time() + seconds)


BASE = datetime(2026, 7, 20, 3, 0, tzinfo=UTC)


def loop_clock(offset_ms: int = 0) -> Callable[[], datetime]:
    """A wall clock that follows the running loop's time: ``BASE + loop.time()`` (+ a skew)."""
    loop = asyncio.get_running_loop()
    skew = timedelta(milliseconds=offset_ms)
    return lambda: BASE + timedelta(seconds=loop.time()) + skew
