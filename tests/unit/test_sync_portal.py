"""The portal under a stop or an interrupt: every caller returns, whatever the moment its call
reached the loop or the interrupt reached the caller."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from sdcore._internal.threads import PLAIN_CALLS
from sdcore.runtime import RuntimeStateError
from sdcore.sync._portal import Portal


async def _nap() -> int:
    await asyncio.sleep(0)
    return 1


def _race(callers: int) -> tuple[list[threading.Thread], list[str]]:
    """``callers`` threads calling the portal in a loop while it stops."""
    portal = Portal(name="race")
    portal.start()
    outcomes: list[str] = []
    go = threading.Event()

    def caller() -> None:
        go.wait()
        while True:
            try:
                portal.call(_nap)
            except RuntimeStateError as exc:
                outcomes.append(str(exc))
                return

    threads = [threading.Thread(target=caller) for _ in range(callers)]
    for thread in threads:
        thread.start()
    go.set()
    portal.stop()
    for thread in threads:
        thread.join(5)
    return threads, outcomes


def test_calls_racing_a_stop_all_return_a_clear_error() -> None:
    for _ in range(30):
        threads, outcomes = _race(4)
        assert not any(thread.is_alive() for thread in threads), "a caller waits for ever"
        assert len(outcomes) == 4
        assert all("portal" in text for text in outcomes), outcomes


def test_the_callers_work_is_settled_on_the_loop_so_an_interrupt_cannot_strand_it() -> None:
    # An interrupt may land inside Future.set_result in the caller's thread, after the state
    # changed but before the callback that wakes the awaiting task: the callback raising
    # KeyboardInterrupt in the caller's thread stands for it. The task waits for the work as
    # run_exclusive waits for a thread it cannot stop; it must never wait for ever.
    portal = Portal(name="settle")
    portal.start()
    caller: list[int] = []
    settled_in: list[str] = []
    outcome: list[object] = []

    def interrupt(_: object) -> None:
        settled_in.append(threading.current_thread().name)
        if threading.get_ident() == caller[0]:
            raise KeyboardInterrupt

    async def run() -> int:
        executor = PLAIN_CALLS.get()
        assert executor is not None
        future = executor.submit(lambda: 1)
        future.add_done_callback(interrupt)  # before the callback of the task's wrapper
        waiting = asyncio.wrap_future(future)
        try:
            return await asyncio.shield(waiting)
        except asyncio.CancelledError:
            await asyncio.wait({waiting})
            raise

    def call() -> None:
        caller.append(threading.get_ident())
        try:
            outcome.append(portal.call_here(run))
        except KeyboardInterrupt:
            outcome.append("interrupted")

    thread = threading.Thread(target=call, daemon=True)  # stranded: must not hold the exit
    thread.start()
    thread.join(10)
    stranded = thread.is_alive()
    portal.stop()
    assert not stranded, "the interrupted caller waits for ever"
    assert outcome == [1]
    assert settled_in == ["settle"]


@pytest.mark.parametrize("scheduled", [True, False], ids=["after-the-spawn", "before-the-spawn"])
def test_an_interrupt_around_the_spawn_cancels_the_call(scheduled: bool) -> None:
    portal = Portal(name="spawn")
    portal.start()
    loop = portal.loop
    real = loop.call_soon_threadsafe

    def interrupting(callback: Callable[..., object], *args: Any, **kwargs: Any) -> object:
        if getattr(callback, "__name__", "") != "_spawn":
            return real(callback, *args, **kwargs)
        if scheduled:
            real(callback, *args, **kwargs)
        raise KeyboardInterrupt

    async def others() -> int:
        return len(asyncio.all_tasks()) - 1

    loop.call_soon_threadsafe = interrupting  # type: ignore[method-assign, assignment]
    try:
        with pytest.raises(KeyboardInterrupt):
            portal.call(asyncio.sleep, 3600)
    finally:
        del loop.call_soon_threadsafe
    try:
        assert portal.call(others) == 0, "a spawned call outlives its interrupted caller"
        assert not portal._calls
    finally:
        portal.stop()
