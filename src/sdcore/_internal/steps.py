"""Statement sequences written once and run by an async or a blocking driver.

A sequence is a generator: it yields one statement at a time (whatever the caller's ``run``
takes), is sent what ``run`` answered, and returns its result. The async core awaits each
statement on an ``AsyncConnection`` (or a driver of another library); ``sdcore.sync`` runs the
same generator on a blocking connection. So the order of the statements, the decisions between
them and the bookkeeping around them (the outbox's ``NOTIFY`` slots) exist once.

Invariant: the drivers close the generator however the run ends (an error from ``run``, a
cancellation, an interrupt), so its ``finally`` blocks run at once, in the caller's frame, never
later from the garbage collector.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import TypeVar

S = TypeVar("S")  # one statement (and its parameters)
R = TypeVar("R")  # what running it answers
T = TypeVar("T")  # the sequence's result

Steps = Generator[S, R, T]


async def run_async(steps: Generator[S, R, T], run: Callable[[S], Awaitable[R]]) -> T:
    """Run every statement of ``steps`` with ``run`` (awaited) and return the sequence's result."""
    try:
        step = next(steps)
        while True:
            step = steps.send(await run(step))
    except StopIteration as done:
        result: T = done.value
        return result
    finally:
        steps.close()


def run_blocking(steps: Generator[S, R, T], run: Callable[[S], R]) -> T:
    """Run every statement of ``steps`` with ``run`` (blocking) and return the sequence's result."""
    try:
        step = next(steps)
        while True:
            step = steps.send(run(step))
    except StopIteration as done:
        result: T = done.value
        return result
    finally:
        steps.close()
