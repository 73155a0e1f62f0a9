"""The pause gate also holds a tick admitted before the pause: after its jitter, and before each
of its retries (``TickRunner.held``, set by the supervisor)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from sdcore.job_scheduler import JobAcquireOptions
from sdcore.scheduling._policy import build_policy
from sdcore.scheduling._runner import GATE_UNKNOWN, TickRunner
from sdcore.scheduling._supervisor import TickStarter
from sdcore.scheduling._triggers import IntervalTrigger, ScheduleKind, Tick, make_tick
from sdcore.testing import MemoryJobScheduler

LOG = logging.getLogger("tests.pause_gate")
AT = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)


def _gate(paused: set[str]) -> Callable[[str, datetime | None], Awaitable[str | None]]:
    async def held(name: str, until: datetime | None) -> str | None:
        return "paused" if name in paused else None

    return held


def _tick() -> Tick:
    return make_tick("beat", IntervalTrigger(60_000), ZoneInfo("UTC"), AT)


async def test_a_tick_paused_during_its_jitter_does_not_run_and_is_recorded_paused() -> None:
    jobs = MemoryJobScheduler()
    runner = TickRunner(jobs, LOG)
    paused = {"beat"}
    runner.held = _gate(paused)
    calls: list[Tick] = []
    policy = build_policy("beat", {"jitter_ms": 20}, has_jobs=True, default_lease_ms=30_000)
    outcome = await runner.run(
        name="beat",
        kind=ScheduleKind.INTERVAL,
        handler=calls.append,
        policy=policy,
        tick=_tick(),
        deadline=None,
        clock=lambda: datetime.now(UTC),
    )
    assert calls == []
    assert not outcome.ran
    key = JobAcquireOptions(code="beat", run_key=_tick().run_key).lock_key
    record = (await jobs.tick_records([key]))[key]
    assert (record.attempts, record.skipped) == (0, "paused")


async def test_a_pause_applied_after_a_failed_attempt_stops_its_retries() -> None:
    jobs = MemoryJobScheduler()
    runner = TickRunner(jobs, LOG)
    paused: set[str] = set()
    runner.held = _gate(paused)
    attempts: list[int] = []

    def failing(tick: Tick) -> None:
        attempts.append(tick.attempt)
        paused.add("beat")  # the operator pauses while attempt 1 runs
        raise RuntimeError("wrong amounts")

    policy = build_policy(
        "beat", {"retries": 2, "retry_backoff_ms": 10}, has_jobs=True, default_lease_ms=30_000
    )
    outcome = await runner.run(
        name="beat",
        kind=ScheduleKind.INTERVAL,
        handler=failing,
        policy=policy,
        tick=_tick(),
        deadline=None,
        clock=lambda: datetime.now(UTC),
    )
    assert attempts == [1]
    assert not outcome.succeeded


async def test_a_retry_after_a_sleep_waits_for_the_paused_state_to_be_read_again() -> None:
    """The process slept through the backoff (its view is stale: the gate says unknown) and a
    pause was committed meanwhile: the retry waits for the re-read, which says paused."""
    jobs = MemoryJobScheduler()
    runner = TickRunner(jobs, LOG)
    sup = TickStarter(runner, jobs, lambda: datetime.now(UTC), LOG, 1.0)
    view: list[str | None] = [None]
    sup.gate = lambda name: view[0]
    attempts: list[int] = []

    def reread() -> None:
        view[0] = "paused"
        sup.release_unknown()

    def failing(tick: Tick) -> None:
        attempts.append(tick.attempt)
        view[0] = GATE_UNKNOWN
        loop.call_later(0.3, reread)
        raise RuntimeError("wrong amounts")

    loop = asyncio.get_running_loop()
    policy = build_policy(
        "beat", {"retries": 2, "retry_backoff_ms": 10}, has_jobs=True, default_lease_ms=30_000
    )
    outcome = await runner.run(
        name="beat",
        kind=ScheduleKind.INTERVAL,
        handler=failing,
        policy=policy,
        tick=_tick(),
        deadline=None,
        clock=lambda: datetime.now(UTC),
    )
    assert attempts == [1]
    assert not outcome.succeeded


async def test_a_state_still_unknown_at_the_next_tick_starts_nothing_and_records_no_skip() -> None:
    """Jitter, then a gate that stays unknown until the next tick: the tick is neither run nor
    settled as skipped (no row: a missed tick, for the catch-up policy)."""
    jobs = MemoryJobScheduler()
    runner = TickRunner(jobs, LOG)
    sup = TickStarter(runner, jobs, lambda: datetime.now(UTC), LOG, 1.0)
    sup.gate = lambda name: GATE_UNKNOWN
    calls: list[Tick] = []
    policy = build_policy("beat", {"jitter_ms": 20}, has_jobs=True, default_lease_ms=30_000)
    outcome = await runner.run(
        name="beat",
        kind=ScheduleKind.INTERVAL,
        handler=calls.append,
        policy=policy,
        tick=_tick(),
        deadline=datetime.now(UTC) + timedelta(seconds=0.3),
        clock=lambda: datetime.now(UTC),
    )
    assert calls == []
    assert not outcome.ran
    key = JobAcquireOptions(code="beat", run_key=_tick().run_key).lock_key
    assert key not in await jobs.tick_records([key])


def test_a_scheduler_run_on_a_second_event_loop_can_wait_for_the_gate_again() -> None:
    """The wait for a re-read binds to the loop of the run; the next run (another loop) waits
    afresh instead of spinning on an event bound to the first loop (each wait failing at once
    with 'bound to a different event loop')."""
    jobs = MemoryJobScheduler()
    sup = TickStarter(TickRunner(jobs, LOG), jobs, lambda: datetime.now(UTC), LOG, 1.0)
    reads: list[str] = []

    def gate(name: str) -> str:
        reads.append(name)
        return GATE_UNKNOWN

    sup.gate = gate

    async def one_run() -> str | None:
        until = datetime.now(UTC) + timedelta(seconds=0.1)
        reason = await sup._held("beat", until)
        await sup.shutdown()
        return reason

    assert asyncio.run(one_run()) == GATE_UNKNOWN
    reads.clear()
    assert asyncio.run(one_run()) == GATE_UNKNOWN
    assert len(reads) < 10, f"the gate was read {len(reads)} times in 0.1 s"


async def _won_while_unknown(reread: str | None) -> tuple[list[Tick], object, object]:
    """A tick whose lease was just won while the view is stale (unknown); the poll reads the
    state again 0.3 s later and finds ``reread``."""
    jobs = MemoryJobScheduler()
    runner = TickRunner(jobs, LOG)
    sup = TickStarter(runner, jobs, lambda: datetime.now(UTC), LOG, 1.0)
    view: list[str | None] = [GATE_UNKNOWN]
    sup.gate = lambda name: view[0]

    def read_again() -> None:
        view[0] = reread
        sup.release_unknown()

    asyncio.get_running_loop().call_later(0.3, read_again)
    calls: list[Tick] = []
    policy = build_policy("beat", {}, has_jobs=True, default_lease_ms=30_000)
    outcome = await runner.run(
        name="beat",
        kind=ScheduleKind.INTERVAL,
        handler=calls.append,
        policy=policy,
        tick=_tick(),
        deadline=None,
        clock=lambda: datetime.now(UTC),
    )
    key = JobAcquireOptions(code="beat", run_key=_tick().run_key).lock_key
    return calls, outcome, (await jobs.tick_records([key]))[key]


async def test_a_lease_won_while_the_view_is_stale_runs_once_the_state_is_read_again() -> None:
    """Under load the poll falls behind (the view goes stale) while a tick wins its lease: the
    other replicas have asked already, so giving it back would leave it to catch-up. It waits for
    the re-read and runs."""
    calls, outcome, record = await _won_while_unknown(None)
    assert len(calls) == 1
    assert outcome.succeeded  # type: ignore[attr-defined]
    assert record.status.value == "SUCCESS"  # type: ignore[attr-defined]


async def test_a_lease_won_while_the_view_is_stale_is_given_back_if_the_re_read_is_paused() -> None:
    calls, outcome, record = await _won_while_unknown("paused")
    assert calls == []
    assert not outcome.ran  # type: ignore[attr-defined]
    assert record.given_back_reason == "paused"  # type: ignore[attr-defined]
