"""The pause gate also holds a tick admitted before the pause: after its jitter, and before each
of its retries (``TickRunner.held``, set by the supervisor)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from zoneinfo import ZoneInfo

from sdcore.job_scheduler import JobAcquireOptions
from sdcore.scheduling._policy import build_policy
from sdcore.scheduling._runner import TickRunner
from sdcore.scheduling._triggers import IntervalTrigger, ScheduleKind, Tick, make_tick
from sdcore.testing import InMemoryJobScheduler

LOG = logging.getLogger("tests.pause_gate")
AT = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)


def _tick() -> Tick:
    return make_tick("beat", IntervalTrigger(60_000), ZoneInfo("UTC"), AT)


async def test_a_tick_paused_during_its_jitter_does_not_run_and_is_recorded_paused() -> None:
    jobs = InMemoryJobScheduler()
    runner = TickRunner(jobs, LOG)
    paused = {"beat"}
    runner.held = lambda name: "paused" if name in paused else None
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
    jobs = InMemoryJobScheduler()
    runner = TickRunner(jobs, LOG)
    paused: set[str] = set()
    runner.held = lambda name: "paused" if name in paused else None
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
