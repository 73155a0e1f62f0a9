"""``Supervisor``: restart with back-off, grace then cancellation, nothing running after aclose.

Driven by loop time (``in_loop_time``): back-offs and graces are seconds long, the tests are not.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import pytest

from sdcore._internal.supervisor import Supervisor
from tests.unit._looptime import in_loop_time

LOG = logging.getLogger("tests.supervisor")


def _ours() -> set[asyncio.Task[object]]:
    """Tasks of the running loop other than the test's own."""
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}


@in_loop_time
async def test_a_crashing_loop_is_logged_and_restarted_with_a_growing_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = asyncio.get_running_loop()
    starts: list[float] = []

    async def flaky() -> None:
        starts.append(loop.time())
        if len(starts) < 4:
            raise RuntimeError(f"boom {len(starts)}")
        await asyncio.Event().wait()  # the fourth run stays up

    sup = Supervisor("t", logger=LOG, backoff_s=1.0, backoff_max_s=3.0)
    await sup.start()
    sup.spawn("flaky", flaky)
    await asyncio.sleep(20)
    assert [round(b - a, 3) for a, b in itertools.pairwise(starts)] == [1.0, 2.0, 3.0]
    assert sup.restarts == 3
    assert [str(e) for _, e in sup.failures] == ["boom 1", "boom 2", "boom 3"]
    assert sum("t-flaky crashed; restarting" in r.getMessage() for r in caplog.records) == 3
    await sup.aclose(grace_s=1.0)
    assert not sup.running
    assert _ours() == set()


@in_loop_time
async def test_a_one_shot_child_that_raises_is_logged_once_and_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs = 0

    async def once() -> None:
        nonlocal runs
        runs += 1
        raise ValueError("bad input")

    sup = Supervisor("t", logger=LOG)
    await sup.start()
    task = sup.spawn("once", once, restart=False)
    await asyncio.wait({task})
    assert task.exception() is None  # the guard never lets it reach the group
    assert runs == 1
    assert [(n, str(e)) for n, e in sup.failures] == [("once", "bad input")]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert [m for m in errors if "t-once crashed" in m] == ["t-once crashed: ValueError: bad input"]
    await sup.aclose()


@in_loop_time
async def test_one_child_failing_does_not_cancel_its_siblings() -> None:
    beats = 0

    async def steady() -> None:
        nonlocal beats
        while True:
            await asyncio.sleep(1)
            beats += 1

    async def broken() -> None:
        raise RuntimeError("x")

    sup = Supervisor("t", logger=LOG, backoff_s=5.0, backoff_max_s=5.0)
    await sup.start()
    sup.spawn("steady", steady, cancel_on_close=True)
    sup.spawn("broken", broken)
    await asyncio.sleep(10.5)
    assert beats == 10
    await sup.aclose(grace_s=0)
    assert _ours() == set()


@in_loop_time
async def test_aclose_waits_for_the_grace_then_cancels_and_names_the_late_child(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    finished: list[str] = []
    cancelled: list[str] = []

    async def polite() -> None:
        await stop.wait()
        await asyncio.sleep(1)  # finishes its batch
        finished.append("polite")

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append("stubborn")
            raise

    sup = Supervisor("t", logger=LOG)
    await sup.start()
    sup.spawn("polite", polite)
    sup.spawn("stubborn", stubborn)
    stop.set()
    started = loop.time()
    await sup.aclose(grace_s=5.0)
    assert round(loop.time() - started, 3) == 5.0
    assert finished == ["polite"]
    assert cancelled == ["stubborn"]
    late = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert late == ["t-stubborn still running after 5.0 s: cancelling it"]
    assert _ours() == set()


@in_loop_time
async def test_cancel_on_close_children_do_not_wait_for_the_grace() -> None:
    loop = asyncio.get_running_loop()

    async def forever() -> None:
        await asyncio.Event().wait()

    sup = Supervisor("t", logger=LOG)
    await sup.start()
    sup.spawn("listen", forever, cancel_on_close=True)
    started = loop.time()
    await sup.aclose(grace_s=30.0)
    assert loop.time() - started < 0.01
    assert _ours() == set()


@in_loop_time
async def test_a_cancelled_aclose_still_leaves_no_child_running() -> None:
    async def forever() -> None:
        await asyncio.Event().wait()

    sup = Supervisor("t", logger=LOG)
    await sup.start()
    sup.spawn("a", forever)
    sup.spawn("b", forever)
    closing = asyncio.ensure_future(sup.aclose(grace_s=60.0))
    await asyncio.sleep(1)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert not sup.running
    assert _ours() == set()


@in_loop_time
async def test_spawn_needs_a_running_supervisor_and_it_can_start_again() -> None:
    ran: list[int] = []

    async def once() -> None:
        ran.append(1)

    sup = Supervisor("t", logger=LOG)
    with pytest.raises(RuntimeError, match="not running"):
        sup.spawn("x", once)
    await sup.start()
    await asyncio.wait({sup.spawn("x", once)})
    await sup.aclose()
    with pytest.raises(RuntimeError, match="not running"):
        sup.spawn("x", once)
    await sup.start()
    await asyncio.wait({sup.spawn("x", once)})
    await sup.aclose()
    assert ran == [1, 1]
    with pytest.raises(ValueError, match="backoff_s"):
        Supervisor("t", logger=LOG, backoff_s=0)
