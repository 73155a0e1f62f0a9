"""When the control plane polls: every poll interval without notifications; with them, only
when a tick may start here before the paused state held goes stale, and at the heartbeat. The
view a tick starts on is never older than with a poll every interval."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from sdcore.scheduling import ScheduleAdmin, ScheduleControl, Scheduler, Tick
from sdcore.scheduling._control import Changes
from sdcore.scheduling._policy import StartPath
from sdcore.testing import MemoryJobScheduler, MemoryScheduleStore


class _Counting(MemoryScheduleStore):
    """The in-memory store, noting when each poll began (its first statement)."""

    def __init__(self, jobs: MemoryJobScheduler) -> None:
        super().__init__(jobs)
        self.polls: list[float] = []

    async def changes(self) -> Changes:
        self.polls.append(time.monotonic())
        return await super().changes()


async def _polls(*, listen: bool, schedule: bool, seconds: float) -> tuple[list[float], Any]:
    jobs = MemoryJobScheduler()
    store = _Counting(jobs)
    scheduler = Scheduler(jobs=jobs, lease_ms=2_000)
    starts: list[tuple[float, float]] = []  # (tick start, age of the view it started on)
    control = ScheduleControl(
        scheduler, store, poll_interval_ms=100, heartbeat_ms=1_000, listen=listen
    )

    async def beat(tick: Tick) -> None:
        fresh = control._fresh_at
        assert fresh is not None
        starts.append((time.monotonic(), time.monotonic() - fresh))

    if schedule:
        scheduler.add_interval("beat", 1_000, beat)
    async with control, scheduler:
        await asyncio.sleep(0.3)
        store.polls.clear()
        await asyncio.sleep(seconds)
        polls = list(store.polls)
    return polls, starts


async def test_without_notifications_a_replica_polls_every_interval() -> None:
    polls, _ = await _polls(listen=False, schedule=False, seconds=2.0)
    assert len(polls) >= 12, len(polls)


async def test_a_listening_replica_with_no_tick_near_polls_at_the_heartbeat() -> None:
    polls, _ = await _polls(listen=True, schedule=False, seconds=2.0)
    assert 1 <= len(polls) <= 4, len(polls)


async def test_a_listening_replica_polls_before_each_of_its_ticks_and_starts_them_fresh(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sdcore")
    polls, starts = await _polls(listen=True, schedule=True, seconds=3.2)
    assert len(starts) >= 3
    # Each tick started on a view read within the poll interval and the lead before it,
    # never on one the gate would call stale.
    assert max(age for _, age in starts) < 1.0, starts
    assert not [r for r in caplog.records if getattr(r, "action", "") == "tick_gate_unknown"]
    # ... and that took a poll or two per tick, not one every 100 ms.
    assert len(polls) <= 3 * len(starts) + 4, (len(polls), len(starts))


async def test_a_catch_up_tick_refused_on_a_stale_view_starts_once_the_view_is_read() -> None:
    jobs = MemoryJobScheduler()
    store = MemoryScheduleStore(jobs)
    scheduler = Scheduler(jobs=jobs, lease_ms=30_000)  # the next sweep is 30 s away
    ran: list[str | None] = []
    scheduler.add_interval("beat", 3_600_000, lambda tick: ran.append(tick.run_key), catch_up="all")
    control = ScheduleControl(scheduler, store, poll_interval_ms=60_000, listen=False)
    async with control, scheduler:
        entry = scheduler._entries["beat"]
        instant = datetime.now(UTC).replace(microsecond=0)
        control._fresh_at = time.monotonic() - 120.0  # as after a long SIGSTOP
        scheduler._sup.start_pending(entry, [instant], StartPath.SWEEP, log_level=logging.INFO)
        assert ran == []  # refused: the paused state is unknown; the gate asked for a poll
        deadline = time.monotonic() + 3.0
        while not ran and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    assert len(ran) == 1, ran


async def test_a_listening_replica_polls_every_interval_while_an_action_is_open() -> None:
    jobs = MemoryJobScheduler()
    store = _Counting(jobs)
    scheduler = Scheduler(jobs=jobs, lease_ms=30_000)
    release = asyncio.Event()

    async def slow(tick: Tick) -> None:
        await release.wait()

    scheduler.add_interval("beat", 3_600_000, slow)
    control = ScheduleControl(
        scheduler, store, poll_interval_ms=100, heartbeat_ms=1_000, listen=True
    )
    async with control, scheduler:
        await asyncio.sleep(0.3)
        await ScheduleAdmin(store).trigger("beat", actor="ops")  # open while its run waits
        await asyncio.sleep(0.3)
        store.polls.clear()
        await asyncio.sleep(1.5)
        polls = len(store.polls)
        release.set()
    assert polls >= 10, polls
