"""Bursts: many ticks due at one instant start in a batch (memory backend, loop time)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import math
import traceback
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from cronsim import CronSim

from sdcore.job_scheduler import (
    AttemptAcquireResult,
    AttemptBudget,
    JobAcquireOptions,
    JobAcquireResult,
    JobSchedulerStatus,
    JobSchedulerUnavailableError,
)
from sdcore.scheduling import Scheduler, Tick
from sdcore.scheduling._cron import CronSpec
from sdcore.scheduling._supervisor import BATCH_TICKS
from sdcore.scheduling._timer import SLICE
from sdcore.testing import MemoryJobScheduler
from tests.unit._looptime import in_loop_time, loop_clock


class _Counting(MemoryJobScheduler):
    """Records each batch call (its size) and each single acquire_attempt."""

    def __init__(self, clock: Any, delay: float = 0.0) -> None:
        super().__init__(clock=clock)
        self.batches: list[int] = []
        self.calls: list[tuple[float, int, int]] = []  # (loop time, keys, keys won)
        self.delay = delay
        self.down = False
        self.fail_next_larger_than: int | None = None  # one such call raises (then reset)
        self.raised: list[JobSchedulerUnavailableError] = []

    async def acquire_attempts(
        self, items: Sequence[tuple[JobAcquireOptions, AttemptBudget]]
    ) -> list[AttemptAcquireResult]:
        self.batches.append(len(items))
        at = asyncio.get_running_loop().time()
        limit = self.fail_next_larger_than
        if self.down or (limit is not None and len(items) > limit):
            self.fail_next_larger_than = None
            self.calls.append((at, len(items), 0))
            self.raised.append(JobSchedulerUnavailableError("injected: database down"))
            raise self.raised[-1]
        if self.delay:
            await asyncio.sleep(self.delay)
        results = await super().acquire_attempts(items)
        self.calls.append((at, len(items), sum(1 for r in results if r.result.acquired)))
        return results


@in_loop_time
async def test_a_burst_on_three_replicas_runs_each_tick_once_in_few_calls() -> None:
    jobs = _Counting(clock=loop_clock())
    ledger: list[tuple[str, str | None, int]] = []
    replicas = [Scheduler(clock=loop_clock(), jobs=jobs) for _ in range(3)]
    for replica, scheduler in enumerate(replicas):
        for i in range(300):

            async def handler(tick: Tick, replica: int = replica) -> None:
                assert tick.lease is not None
                ledger.append((tick.schedule, tick.run_key, replica))

            scheduler.add_cron(f"digest-{i:03d}", "*/2 * * * * *", handler)
    async with replicas[0], replicas[1], replicas[2]:
        await asyncio.sleep(4.5)
    per_tick = Counter((name, key) for name, key, _ in ledger)
    instants = {key for _, key in per_tick}
    assert len(instants) >= 2
    assert len(per_tick) == 300 * len(instants)
    assert set(per_tick.values()) == {1}
    # The timer closes a batch after the first start slice that brings it to BATCH_TICKS
    # ticks (or at the burst's end): one call per batch, replica and instant.
    per_call = math.ceil(BATCH_TICKS / SLICE) * SLICE
    per_instant = math.ceil(300 / per_call)
    assert len(jobs.batches) == 3 * len(instants) * per_instant
    assert sum(jobs.batches) == 3 * 300 * len(instants)
    assert max(jobs.batches) == min(per_call, 300)
    assert not any(r.status is JobSchedulerStatus.RUNNING for r in jobs.rows())


@in_loop_time
async def test_handlers_start_before_next_fire_times_are_computed() -> None:
    scheduler = Scheduler(clock=loop_clock())
    armed_when_started: list[bool] = []

    def add(i: int) -> None:
        async def handler(tick: Tick) -> None:
            # The instant it is armed at (next_fire_at shows the next one either way).
            upcoming = scheduler._entries[f"s{i}"].next_at
            armed_when_started.append(upcoming is not None and upcoming > tick.scheduled_at)

        scheduler.add_interval(f"s{i}", 1000, handler)

    for i in range(50):
        add(i)
    async with scheduler:
        await asyncio.sleep(1.5)
        assert len(armed_when_started) == 50
        assert not any(armed_when_started)  # every handler ran before any re-arm
        assert all(
            info.next_fire_at is not None and info.next_fire_at > loop_clock()()
            for info in scheduler.schedules()
        )


@in_loop_time
async def test_retries_in_a_burst_still_stop_at_the_next_tick() -> None:
    scheduler = Scheduler(clock=loop_clock())
    attempts: Counter[str] = Counter()
    for i in range(20):

        async def handler(tick: Tick) -> None:
            attempts[tick.schedule] += 1
            raise RuntimeError("always")

        scheduler.add_interval(f"s{i}", 300, handler, retries=5, retry_backoff_ms=250)
    async with scheduler:
        await asyncio.sleep(0.35)
    # The tick at 300 ms fails, retries at 550 ms; the next would be at 800 ms, past 600 ms.
    assert set(attempts.values()) == {2}


@in_loop_time
async def test_a_failed_batch_call_fails_only_that_turn() -> None:
    jobs = _Counting(clock=loop_clock())
    jobs.down = True
    ran: list[str | None] = []
    scheduler = Scheduler(clock=loop_clock(), jobs=jobs)
    for i in range(10):
        scheduler.add_interval(f"s{i}", 500, lambda tick: ran.append(tick.run_key))
    async with scheduler:
        await asyncio.sleep(0.6)
        assert not ran
        jobs.down = False
        await asyncio.sleep(0.5)
    assert len(ran) == 10


@in_loop_time
async def test_the_ticks_of_a_failed_call_do_not_lengthen_its_shared_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Every tick of the call raises the call's one exception; raised as it is, each raise would
    # add two frames to its traceback (600 for these 300 ticks), keeping every tick's frames alive.
    jobs = _Counting(clock=loop_clock())
    jobs.down = True
    scheduler = Scheduler(clock=loop_clock(), jobs=jobs)
    for i in range(300):
        scheduler.add_cron(f"digest-{i:03d}", "*/2 * * * * *", lambda tick: None)
    caplog.set_level(logging.ERROR)
    async with scheduler:
        await asyncio.sleep(2.5)
    not_run = [r for r in caplog.records if getattr(r, "action", None) == "tick_not_run"]
    assert len(not_run) == 300
    assert len(jobs.raised) == 1  # one call for the burst's 300 keys
    for error in jobs.raised:
        assert len(traceback.extract_tb(error.__traceback__)) <= 4


class _Buggy(MemoryJobScheduler):
    """A job scheduler with a bug: its first batch call, or every skip record, raises
    TypeError."""

    def __init__(self, clock: Any, *, broken_skips: bool = False) -> None:
        super().__init__(clock=clock)
        self.broken_calls = 1
        self.broken_skips = broken_skips

    async def acquire_attempts(
        self, items: Sequence[tuple[JobAcquireOptions, AttemptBudget]]
    ) -> list[AttemptAcquireResult]:
        if self.broken_calls:
            self.broken_calls -= 1
            raise TypeError("injected: a bug in the job scheduler")
        return await super().acquire_attempts(items)

    async def record_skipped(self, options: JobAcquireOptions, reason: str) -> bool:
        if self.broken_skips:
            raise TypeError("injected: a bug in record_skipped")
        return await super().record_skipped(options, reason)


def _unretrieved(contexts: list[dict[str, Any]]) -> list[str]:
    gc.collect()  # a task's unretrieved exception is reported when the task is collected
    return [str(c.get("message")) for c in contexts if "never retrieved" in str(c.get("message"))]


@in_loop_time
async def test_a_job_scheduler_bug_in_a_batch_call_is_logged_per_tick_and_ends_no_task_with_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # "Nothing here raises into the timer loop": an exception that is not a JobSchedulerError
    # (a custom job scheduler's bug) must not end every tick task of the call with it, each
    # reported by asyncio as "Task exception was never retrieved".
    contexts: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: contexts.append(context))
    jobs = _Buggy(clock=loop_clock())
    ran: list[str | None] = []
    scheduler = Scheduler(clock=loop_clock(), jobs=jobs)
    for i in range(40):
        scheduler.add_interval(f"s{i:02d}", 500, lambda tick: ran.append(tick.run_key))
    caplog.set_level(logging.ERROR)
    async with scheduler:
        await asyncio.sleep(1.2)
    not_run = [r for r in caplog.records if getattr(r, "action", None) == "tick_not_run"]
    assert len(not_run) == 40  # the first instant's ticks: their calls raised
    assert all("TypeError" in r.getMessage() and r.exc_info for r in not_run)
    assert len(ran) == 40  # the next instant's ticks ran: the loop went on
    assert _unretrieved(contexts) == []


@in_loop_time
async def test_an_unexpected_error_of_a_tick_task_is_logged_not_left_unretrieved(
    caplog: pytest.LogCaptureFixture,
) -> None:
    contexts: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: contexts.append(context))
    jobs = _Buggy(clock=loop_clock(), broken_skips=True)
    jobs.broken_calls = 0
    scheduler = Scheduler(clock=loop_clock(), jobs=jobs)

    async def slow(tick: Tick) -> None:
        await asyncio.sleep(0.25)  # overlaps the next tick: "skip" records it as skipped

    scheduler.add_interval("slow", 100, slow, overlap="skip")
    caplog.set_level(logging.ERROR)
    async with scheduler:
        await asyncio.sleep(0.5)
    ended = [r for r in caplog.records if getattr(r, "action", None) == "task_failed"]
    assert ended
    assert all("TypeError" in r.getMessage() and r.exc_info for r in ended)
    assert _unretrieved(contexts) == []


@in_loop_time
async def test_a_lease_won_after_shutdown_cancelled_its_tick_is_given_back() -> None:
    jobs = _Counting(clock=loop_clock(), delay=1.0)
    ran: list[str | None] = []
    scheduler = Scheduler(clock=loop_clock(), jobs=jobs, grace_period_ms=100)
    for i in range(5):
        scheduler.add_interval(f"s{i}", 1000, lambda tick: ran.append(tick.run_key))
    async with scheduler:
        await asyncio.sleep(1.2)  # the batch is in flight (it answers at 2.0 s)
    assert not ran
    rows = jobs.rows()
    assert len(rows) == 5
    assert all(r.status is JobSchedulerStatus.FAIL for r in rows)


async def test_the_default_batch_refuses_two_items_for_one_key() -> None:
    jobs = MemoryJobScheduler()
    options = JobAcquireOptions(code="a", run_key="k")
    budget = AttemptBudget(max_attempts=1, backoff_ms=0)
    with pytest.raises(ValueError, match="two items for one lock key"):
        await jobs.acquire_attempts([(options, budget), (options, budget)])
    assert not jobs.rows()


def test_cron_fire_times_do_not_parse_the_expression_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = CronSpec.parse("30 8 * * 1-5", ZoneInfo("Europe/Paris"))
    parsed = 0

    class Counting(CronSim):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            nonlocal parsed
            parsed += 1
            super().__init__(*args, **kwargs)

    monkeypatch.setattr("sdcore.scheduling._cron.CronSim", Counting)
    instant = datetime(2026, 3, 27, tzinfo=UTC)
    for _ in range(100):
        instant = spec.next_after(instant)
    assert parsed == 0
    assert instant.astimezone(ZoneInfo("Europe/Paris")).hour == 8


@pytest.mark.parametrize(
    ("expression", "zone"),
    [
        pytest.param("*/7 * * * * *", "UTC", id="seconds-utc"),
        pytest.param("30 2 * * *", "Europe/Paris", id="fixed-in-a-dst-zone"),
        pytest.param("*/20 * * * *", "America/New_York", id="wildcard-in-a-dst-zone"),
        pytest.param("0 0 */10 * 0", "Australia/Lord_Howe", id="day-rule-half-hour-dst"),
    ],
)
@pytest.mark.parametrize("day_rule", ["vixie", "nestjs"])
def test_cached_cron_agrees_with_a_fresh_parse(expression: str, zone: str, day_rule: str) -> None:
    tz = ZoneInfo(zone)
    cached = CronSpec.parse(expression, tz, day_rule=day_rule)
    instant = datetime(2026, 3, 1, tzinfo=UTC)
    for _ in range(400):
        fresh = dataclasses.replace(cached, _parsed=None)  # parses again on first use
        expected = fresh.next_after(instant)
        assert cached.next_after(instant) == expected
        instant = expected + timedelta(seconds=1) if expected == instant else expected


class _CountingMany(MemoryJobScheduler):
    def __init__(self, clock: Any) -> None:
        super().__init__(clock=clock)
        self.many: list[int] = []
        self.single = 0

    async def acquire_many(self, options: Sequence[Any]) -> list[JobAcquireResult]:
        self.many.append(len(options))
        return await super().acquire_many(options)

    async def acquire(self, options: Any) -> JobAcquireResult:
        self.single += 1
        return await super().acquire(options)


class _NoMany(_CountingMany):
    acquire_many = None  # type: ignore[assignment]  # a job scheduler without the batch call


@pytest.mark.parametrize("jobs_class", [_CountingMany, _NoMany], ids=["acquire_many", "fallback"])
@in_loop_time
async def test_cluster_overlap_guards_of_a_burst_share_one_call(jobs_class: type) -> None:
    jobs = jobs_class(clock=loop_clock())
    ledger: list[tuple[str, str | None]] = []
    replicas = [Scheduler(clock=loop_clock(), jobs=jobs) for _ in range(2)]
    for scheduler in replicas:
        for i in range(50):
            scheduler.add_interval(
                f"guarded-{i}",
                1000,
                lambda tick: ledger.append((tick.schedule, tick.run_key)),
                overlap="skip_cluster",
            )
    async with replicas[0], replicas[1]:
        await asyncio.sleep(2.5)
    per_tick = Counter(ledger)
    assert len(per_tick) == 100
    assert set(per_tick.values()) == {1}
    if jobs_class is _NoMany:
        assert not jobs.many
        assert jobs.single >= 200  # one guard acquire per tick and replica
    else:
        assert jobs.many == [50] * 4  # one call per replica and instant


@in_loop_time
async def test_a_replica_starts_a_task_only_for_the_ticks_it_won(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    jobs = _Counting(clock=loop_clock())
    ledger: list[tuple[str, str | None]] = []
    tick_tasks: list[str] = []
    create_task = asyncio.create_task

    def counting(coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        if str(kwargs.get("name", "")).startswith("sdcore-tick:"):
            tick_tasks.append(kwargs["name"])
        return create_task(coro, **kwargs)

    monkeypatch.setattr(asyncio, "create_task", counting)
    replicas = [Scheduler(clock=loop_clock(), jobs=jobs) for _ in range(3)]
    for scheduler in replicas:
        for i in range(100):

            async def handler(tick: Tick) -> None:
                ledger.append((tick.schedule, tick.run_key))

            scheduler.add_cron(f"digest-{i:03d}", "*/2 * * * * *", handler)
    async with replicas[0], replicas[1], replicas[2]:
        await asyncio.sleep(2.5)
    counts = Counter(ledger)
    assert len(counts) == 100
    assert set(counts.values()) == {1}
    # A lost tick (two thirds of each replica's burst) costs no task: one per tick run.
    assert len(tick_tasks) == len(ledger)


@in_loop_time
async def test_what_happens_before_an_instant_decides_at_the_instant() -> None:
    # A schedule stopped or removed before its instant does not fire; one added for it does.
    jobs = MemoryJobScheduler(clock=loop_clock())
    scheduler = Scheduler(clock=loop_clock(), jobs=jobs)
    ran: list[tuple[str, str | None, bool]] = []

    async def handler(tick: Tick) -> None:
        ran.append((tick.schedule, tick.run_key, tick.lease is not None))

    for i in range(5):
        scheduler.add_cron(f"s{i}", "*/2 * * * * *", handler)
    async with scheduler:
        await asyncio.sleep(1.7)
        assert not ran
        scheduler.stop("s1")
        scheduler.remove("s2")
        scheduler.add_cron("late", "*/2 * * * * *", handler)
        await asyncio.sleep(0.4)
    assert sorted(ran) == [
        (name, "2026-07-20T03:00:02Z", True) for name in ("late", "s0", "s3", "s4")
    ]


def test_schedules_with_equal_options_share_one_policy_and_no_catch_up_sets() -> None:
    """10,000 registered schedules: what each one holds is what the collector walks."""
    from sdcore.scheduling._entry import NO_INSTANTS
    from sdcore.scheduling._policy import build_policy

    scheduler = Scheduler(jobs=MemoryJobScheduler())

    async def handler(tick: Tick) -> None:
        return None

    for i in range(3):
        scheduler.add_cron(f"same-{i}", "0 3 * * *", handler, retries=2)
    scheduler.add_cron("other", "0 3 * * *", handler, retries=3)
    entries = scheduler._entries
    assert entries["same-0"].policy is entries["same-1"].policy is entries["same-2"].policy
    assert entries["other"].policy is not entries["same-0"].policy
    assert entries["other"].policy.retries == 3
    assert all(e.pending is NO_INSTANTS and e.offered is NO_INSTANTS for e in entries.values())
    # The cache of shared policies is bounded and answers equal values after it was emptied.
    for lease_ms in range(10_000, 12_000):
        policy = build_policy("p", {"lease_ms": lease_ms}, has_jobs=True, default_lease_ms=30_000)
        assert policy.lease_ms == lease_ms
    lease_ms = entries["same-0"].policy.lease_ms
    again = build_policy("p", {"retries": 2}, has_jobs=True, default_lease_ms=lease_ms)
    assert again == entries["same-0"].policy


def test_a_bucket_with_no_stale_entry_is_kept_as_it_is() -> None:
    """A later owner checks a burst's 10,000 entries at the instant: with none stale it keeps
    the bucket's lists as they are (no list, no object per entry for the collector); a stale
    one is dropped."""
    from sdcore.scheduling._timer import Bucket

    bucket = Bucket(datetime(2026, 7, 20, 3, 0, tzinfo=UTC), owned=True)
    bucket.entries = [object() for _ in range(10_000)]  # type: ignore[misc]
    bucket.versions = [1] * 10_000
    entries, versions = bucket.entries, bucket.versions
    assert bucket.keep(lambda entry, version: True) == 10_000
    assert bucket.entries is entries
    assert bucket.versions is versions
    stale = entries[5]
    assert bucket.keep(lambda entry, version: entry is not stale) == 9_999
    assert stale not in bucket.entries
    assert len(bucket.versions) == 9_999
