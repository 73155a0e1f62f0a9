"""Scheduler behaviour with the in-memory lease: exclusivity, policies, failures, registry."""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sdcore.job_scheduler import (
    AttemptBudget,
    JobAcquireOptions,
    JobSchedulerStatus,
    JobSchedulerUnavailableError,
)
from sdcore.scheduling import (
    InvalidScheduleError,
    ScheduleKind,
    ScheduleNotFoundError,
    Scheduler,
    Tick,
)
from sdcore.testing import MemoryJobScheduler
from tests.unit._looptime import block_loop, in_loop_time, loop_clock


async def _seen_at_start(jobs: MemoryJobScheduler, code: str) -> None:
    """Give ``code`` a row at time 0: the schedule existed, so catch-up applies to it."""
    old = await jobs.acquire({"code": code, "run_key": "2000-01-01T00:00:00Z"})
    assert old.acquired
    await jobs.complete(old.lease)


def _statuses(jobs: MemoryJobScheduler, code: str) -> Counter[str]:
    return Counter(row.status.value for row in jobs.rows() if row.code == code)


@in_loop_time
async def test_every_tick_runs_once_across_replicas() -> None:
    jobs = MemoryJobScheduler(clock=loop_clock())
    ledger: list[tuple[str, int]] = []
    schedulers = [Scheduler(clock=loop_clock(), jobs=jobs) for _ in range(3)]
    for replica, scheduler in enumerate(schedulers):

        @scheduler.interval(200, name="tick")
        async def handler(tick: Tick, replica: int = replica) -> None:
            assert tick.lease is not None
            assert tick.run_key is not None
            ledger.append((tick.run_key, replica))

    async with schedulers[0], schedulers[1], schedulers[2]:
        await asyncio.sleep(1.5)
    per_tick = Counter(key for key, _ in ledger)
    assert len(per_tick) >= 5
    assert set(per_tick.values()) == {1}
    assert _statuses(jobs, "tick")["RUNNING"] == 0


@in_loop_time
async def test_without_jobs_every_process_runs_every_tick() -> None:
    ledger: list[str] = []
    a, b = Scheduler(clock=loop_clock()), Scheduler(clock=loop_clock())
    for scheduler in (a, b):
        scheduler.add_interval("tick", 200, lambda tick: ledger.append(tick.run_key or ""))
    async with a, b:
        await asyncio.sleep(0.9)
    assert set(Counter(ledger).values()) == {2}


@in_loop_time
async def test_run_key_is_the_scheduled_instant_not_now() -> None:
    seen: list[Tick] = []
    scheduler = Scheduler(
        clock=loop_clock(), jobs=MemoryJobScheduler(clock=loop_clock()), time_zone="Europe/Paris"
    )

    @scheduler.cron("* * * * * *", name="sec")
    async def handler(tick: Tick) -> None:
        seen.append(tick)

    async with scheduler:
        await asyncio.sleep(1.3)
    assert seen
    tick = seen[0]
    assert tick.scheduled_at.microsecond == 0
    assert tick.scheduled_at.tzinfo is UTC
    assert tick.run_key == tick.scheduled_at.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert (
        tick.local_time.utcoffset()
        == tick.scheduled_at.astimezone(tick.local_time.tzinfo).utcoffset()
    )
    assert str(tick.local_time.tzinfo) == "Europe/Paris"


@in_loop_time
async def test_handler_errors_are_logged_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    jobs = MemoryJobScheduler(clock=loop_clock())
    calls = 0
    scheduler = Scheduler(clock=loop_clock(), jobs=jobs)

    @scheduler.interval(200, name="flaky")
    async def handler(tick: Tick) -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError(f"boom {tick.run_key}\nforged log line")

    with caplog.at_level(logging.ERROR, logger="sdcore.scheduling"):
        async with scheduler:
            await asyncio.sleep(0.9)
    assert calls >= 3
    failures = [r for r in caplog.records if getattr(r, "action", None) == "tick_failed"]
    assert len(failures) == calls
    assert all(r.schedule == "flaky" and r.run_key for r in failures)  # type: ignore[attr-defined]
    assert all(r.getMessage().startswith("Scheduler: schedule 'flaky'") for r in failures)
    assert _statuses(jobs, "flaky") == Counter({"FAIL": calls})


async def test_plain_ticks_log_failures_report_telemetry_and_run_sync_handlers_in_threads(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Non-exclusive ticks without retries take the one-frame path (run_plain): the same logs,
    outcomes and telemetry as the general path, sync handlers in a worker thread."""
    import threading

    from sdcore._internal.telemetry import Observer, Telemetry

    class Seen(Observer):
        def __init__(self) -> None:
            self.events: list[tuple[str, str, str]] = []

        def tick_started(self, run: Any) -> None:
            self.events.append(("started", run.schedule, run.run_key))

        def tick_finished(self, run: Any, outcome: str, duration_s: float) -> None:
            self.events.append((outcome, run.schedule, run.run_key))

    main = threading.get_ident()
    threads: list[int] = []
    attempts: list[int] = []
    scheduler = Scheduler()
    hub = Telemetry()
    seen = Seen()
    hub.add(seen)
    scheduler.telemetry = hub

    async def failing(tick: Tick) -> None:
        attempts.append(tick.attempt)
        raise RuntimeError("boom")

    def sync_ok(tick: Tick) -> None:
        threads.append(threading.get_ident())

    scheduler.add_interval("plain-fail", 200, failing)
    scheduler.add_interval("plain-sync", 200, sync_ok)
    with caplog.at_level(logging.ERROR, logger="sdcore.scheduling"):
        async with scheduler, asyncio.timeout(5):
            while len(attempts) < 2 or len(threads) < 2:
                await asyncio.sleep(0.01)
    assert set(attempts) == {1}
    assert threads
    assert main not in threads
    failures = [r for r in caplog.records if getattr(r, "action", None) == "tick_failed"]
    assert failures
    assert all(getattr(r, "schedule", None) == "plain-fail" for r in failures)
    assert all(r.exc_info is not None for r in failures)
    fail_events = [e for e in seen.events if e[1] == "plain-fail"]
    sync_events = [e for e in seen.events if e[1] == "plain-sync"]
    assert [e[0] for e in fail_events[:2]] == ["started", "failure"]
    assert [e[0] for e in sync_events[:2]] == ["started", "success"]
    assert fail_events[0][2] == fail_events[1][2]  # the same tick's run key


def test_equal_cron_expressions_share_one_spec_and_one_trigger() -> None:
    """Stored per-customer schedules of one expression share their parsed spec and trigger, so
    a burst of them computes its next fire time once and is recognized by identity."""
    from zoneinfo import ZoneInfo

    from sdcore.scheduling._cron import CronSpec

    paris = ZoneInfo("Europe/Paris")
    first = CronSpec.parse("0 8 * * *", paris, "a")
    assert CronSpec.parse("0 8 * * *", paris, "b") is first
    assert CronSpec.parse("0 8 * * *", ZoneInfo("UTC")) is not first
    assert CronSpec.parse("0 8 * * *", paris, day_rule="nestjs") is not first
    with pytest.raises(InvalidScheduleError, match="invalid cron expression"):
        CronSpec.parse("0 0 32 * *", paris)
    with pytest.raises(InvalidScheduleError, match="invalid cron expression"):
        CronSpec.parse("0 0 32 * *", paris)  # an error is never cached as a spec
    scheduler = Scheduler(time_zone="Europe/Paris")
    scheduler.add_cron("one", "0 8 * * *", lambda tick: None)
    scheduler.add_cron("two", "0 8 * * *", lambda tick: None)
    scheduler.add_cron("other", "0 9 * * *", lambda tick: None)
    triggers = {name: scheduler._entries[name].trigger for name in ("one", "two", "other")}
    assert triggers["one"] is triggers["two"]
    assert triggers["other"] is not triggers["one"]


@in_loop_time
async def test_a_burst_of_one_expression_computes_its_next_fire_time_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sdcore.scheduling._cron import CronSpec

    calls = 0
    original = CronSpec.next_after

    def counting(self: CronSpec, after: datetime) -> datetime:
        nonlocal calls
        calls += 1
        return original(self, after)

    monkeypatch.setattr(CronSpec, "next_after", counting)
    scheduler = Scheduler(clock=loop_clock())
    ticks: list[str | None] = []
    at_burst: list[int] = []

    async def handler(tick: Tick) -> None:
        if not ticks or ticks[-1] != tick.run_key:
            at_burst.append(calls)
        ticks.append(tick.run_key)

    for i in range(600):
        scheduler.add_cron(f"s{i}", "*/2 * * * * *", handler)
    async with scheduler:
        await asyncio.sleep(4.5)
    assert len(ticks) >= 1200
    assert len(at_burst) >= 2
    # Between the first handler of one burst and of the next: one computation for the 600.
    assert at_burst[1] - at_burst[0] == 1, at_burst


async def test_sync_handlers_run_in_a_thread() -> None:
    import threading

    main = threading.get_ident()
    threads: list[int] = []
    scheduler = Scheduler(jobs=MemoryJobScheduler())
    scheduler.add_interval("sync", 200, lambda tick: threads.append(threading.get_ident()))
    async with scheduler, asyncio.timeout(5):
        while not threads:  # the first tick, within 200 ms
            await asyncio.sleep(0.01)
    assert threads
    assert main not in threads


@pytest.mark.parametrize(("overlap", "expect_overlap"), [("skip", False), ("allow", True)])
@in_loop_time
async def test_overlap_policy_on_this_process(overlap: str, expect_overlap: bool) -> None:
    scheduler = Scheduler(clock=loop_clock())
    active = 0
    peak = 0

    async def slow(tick: Tick) -> None:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.5)
        active -= 1

    scheduler.add_interval("slow", 200, slow, overlap=overlap)  # type: ignore[arg-type]
    async with scheduler:
        await asyncio.sleep(1.3)
    assert (peak > 1) is expect_overlap


@in_loop_time
async def test_cluster_wide_overlap_skip() -> None:
    jobs = MemoryJobScheduler(clock=loop_clock())
    active = 0
    peak = 0
    runs = 0
    schedulers = [Scheduler(clock=loop_clock(), jobs=jobs) for _ in range(2)]

    async def slow(tick: Tick) -> None:
        nonlocal active, peak, runs
        active += 1
        runs += 1
        peak = max(peak, active)
        await asyncio.sleep(0.5)
        active -= 1

    for scheduler in schedulers:
        scheduler.add_interval("slow", 200, slow, overlap="skip_cluster", lease_ms=3000)
    async with schedulers[0], schedulers[1]:
        await asyncio.sleep(1.6)
    assert runs >= 2
    assert peak == 1


@in_loop_time
async def test_failed_tick_is_retried_with_backoff() -> None:
    jobs = MemoryJobScheduler(clock=loop_clock())
    attempts: list[int] = []
    scheduler = Scheduler(clock=loop_clock(), jobs=jobs)

    @scheduler.cron("*/2 * * * * *", name="retry", retries=2, retry_backoff_ms=100)
    async def handler(tick: Tick) -> None:
        attempts.append(tick.attempt)
        if tick.attempt == 1:
            raise RuntimeError("first attempt fails")

    async with scheduler:
        await asyncio.sleep(2.4)
    assert attempts[:2] == [1, 2]
    row = next(r for r in jobs.rows() if r.code == "retry")
    assert row.status is JobSchedulerStatus.SUCCESS
    assert row.fencing_token == 2


@in_loop_time
async def test_retries_never_pass_the_next_tick() -> None:
    attempts: list[int] = []
    scheduler = Scheduler(clock=loop_clock(), jobs=MemoryJobScheduler(clock=loop_clock()))

    @scheduler.interval(300, name="short", retries=5, retry_backoff_ms=250)
    async def handler(tick: Tick) -> None:
        attempts.append(tick.attempt)
        raise RuntimeError("always")

    async with scheduler:
        await asyncio.sleep(0.65)
    assert max(attempts) <= 2


class _DownThenUp(MemoryJobScheduler):
    def __init__(self, clock: Any) -> None:
        super().__init__(clock=clock)
        self.down = True

    async def acquire(self, options: Any) -> Any:
        if self.down:
            raise JobSchedulerUnavailableError("injected: database down")
        return await super().acquire(options)


@in_loop_time
async def test_database_outage_does_not_kill_the_loop(caplog: pytest.LogCaptureFixture) -> None:
    jobs = _DownThenUp(clock=loop_clock())
    ran: list[str] = []
    scheduler = Scheduler(clock=loop_clock(), jobs=jobs)
    scheduler.add_interval("tick", 200, lambda tick: ran.append(tick.run_key or ""))
    with caplog.at_level(logging.ERROR, logger="sdcore.scheduling"):
        async with scheduler:
            await asyncio.sleep(0.7)
            assert not ran
            jobs.down = False
            await asyncio.sleep(0.7)
    assert ran
    assert any(getattr(r, "action", None) == "tick_not_run" for r in caplog.records)


@in_loop_time
async def test_shutdown_mid_run_leaves_fail_not_running() -> None:
    jobs = MemoryJobScheduler(clock=loop_clock())
    started = asyncio.Event()
    scheduler = Scheduler(clock=loop_clock(), jobs=jobs, grace_period_ms=100)

    @scheduler.interval(200, name="long")
    async def handler(tick: Tick) -> None:
        started.set()
        await asyncio.sleep(30)

    async with scheduler:
        await asyncio.wait_for(started.wait(), 2)
    rows = [r for r in jobs.rows() if r.code == "long"]
    assert rows
    assert all(r.status is JobSchedulerStatus.FAIL for r in rows)


@in_loop_time
async def test_graceful_shutdown_lets_short_runs_finish() -> None:
    jobs = MemoryJobScheduler(clock=loop_clock())
    started = asyncio.Event()
    scheduler = Scheduler(clock=loop_clock(), jobs=jobs, grace_period_ms=2000)

    @scheduler.interval(200, name="short")
    async def handler(tick: Tick) -> None:
        started.set()
        await asyncio.sleep(0.3)

    async with scheduler:
        await asyncio.wait_for(started.wait(), 2)
    assert {r.status for r in jobs.rows()} == {JobSchedulerStatus.SUCCESS}


@pytest.mark.parametrize(("mode", "expected"), [("latest", 1), ("all", 3), ("off", 0)])
@in_loop_time
async def test_catch_up_after_all_replicas_were_down(mode: str, expected: int) -> None:
    jobs = MemoryJobScheduler(clock=loop_clock())
    await _seen_at_start(jobs, "m")
    await asyncio.sleep(3 * 60 + 30)  # 03:01, 03:02, 03:03 missed while every replica was down
    ran: list[str] = []
    scheduler = Scheduler(jobs=jobs, clock=loop_clock())
    # Per-minute ticks, a window of three minutes: three ticks were missed.
    scheduler.add_cron(
        "m",
        "* * * * *",
        lambda tick: ran.append(tick.run_key or ""),
        catch_up=mode,  # type: ignore[arg-type]
        catch_up_window_ms=180_000,
    )
    async with scheduler:
        await asyncio.sleep(0.3)
    assert len(ran) == expected
    if mode == "latest":
        assert ran == ["2026-07-20T03:03:00Z"]


@in_loop_time
async def test_catch_up_latest_does_not_walk_back_past_a_success() -> None:
    jobs = MemoryJobScheduler(clock=loop_clock())
    await _seen_at_start(jobs, "m")
    await asyncio.sleep(3 * 60 + 30)
    done = await jobs.acquire(JobAcquireOptions(code="m", run_key="2026-07-20T03:03:00Z"))
    assert done.acquired
    await jobs.complete(done.lease)
    ran: list[str] = []
    scheduler = Scheduler(jobs=jobs, clock=loop_clock())
    scheduler.add_cron(
        "m",
        "* * * * *",
        lambda tick: ran.append(tick.run_key or ""),
        catch_up="latest",
        catch_up_window_ms=120_000,
    )
    async with scheduler:
        await asyncio.sleep(0.3)
    # The latest tick of the window succeeded: "latest" has nothing to do (the tick before it is
    # not the "latest" one; running it would make each sweep walk one tick further back).
    assert ran == []


async def test_missed_ticks_tell_a_tick_given_back_from_a_failed_run() -> None:
    jobs = MemoryJobScheduler()
    scheduler = Scheduler(jobs=jobs)
    scheduler.add_cron("m", "*/10 * * * *", lambda tick: None)
    start = datetime(2026, 7, 20, 3, 0, tzinfo=UTC)
    budget = AttemptBudget(max_attempts=1, backoff_ms=1_000)
    for minute in (0, 10):
        options = JobAcquireOptions(code="m", run_key=f"2026-07-20T03:{minute:02d}:00Z")
        got, attempt = await jobs.acquire_attempt(options, budget)
        assert (got.acquired, attempt) == (True, 1)
        assert got.acquired
        if minute:
            assert await jobs.give_back(got.lease, "acquire answered too late")
        else:
            assert await jobs.fail(got.lease, {"error": "boom"})
    missed = await scheduler.missed_ticks("m", start, start + timedelta(minutes=20))
    assert [(m.status, m.attempts, m.given_back) for m in missed] == [
        (JobSchedulerStatus.FAIL, 1, None),  # a run that started and failed
        (JobSchedulerStatus.FAIL, 0, "acquire answered too late"),  # never ran
    ]


async def test_missed_ticks_query() -> None:
    jobs = MemoryJobScheduler()
    scheduler = Scheduler(jobs=jobs)
    scheduler.add_cron("m", "*/10 * * * *", lambda tick: None)
    start = datetime(2026, 7, 20, 3, 0, tzinfo=UTC)
    for minute, finish in [(0, "complete"), (10, "fail")]:
        got = await jobs.acquire(
            {
                "code": "m",
                "run_key": (start + timedelta(minutes=minute)).strftime("%Y-%m-%dT%H:%M:%SZ"),
            }
        )
        assert got.acquired
        await getattr(jobs, finish)(got.lease)
    missed = await scheduler.missed_ticks("m", start, start + timedelta(minutes=40))
    assert [(m.run_key, m.status) for m in missed] == [
        ("2026-07-20T03:10:00Z", JobSchedulerStatus.FAIL),
        ("2026-07-20T03:20:00Z", None),
        ("2026-07-20T03:30:00Z", None),
    ]
    with pytest.raises(ValueError, match="aware"):
        await scheduler.missed_ticks("m", datetime(2026, 1, 1), datetime(2026, 1, 2))  # noqa: DTZ001
    with pytest.raises(ValueError, match="more than"):
        await scheduler.missed_ticks("m", start, start + timedelta(days=365))


@in_loop_time
async def test_timeout_once_per_process_initial_once_per_cluster() -> None:
    jobs = MemoryJobScheduler(clock=loop_clock())
    ran: list[str] = []
    schedulers = [Scheduler(clock=loop_clock(), jobs=jobs) for _ in range(3)]
    for i, scheduler in enumerate(schedulers):
        scheduler.add_timeout("warm-up", 100, lambda tick, i=i: ran.append(f"timeout-{i}"))  # type: ignore[misc]
        scheduler.add_initial("seed", lambda tick: ran.append("initial"))
    async with schedulers[0], schedulers[1], schedulers[2]:
        await asyncio.sleep(0.5)
    # A second start of the cluster does not run the initial job again.
    again = Scheduler(clock=loop_clock(), jobs=jobs)
    again.add_initial("seed", lambda tick: ran.append("initial"))
    async with again:
        await asyncio.sleep(0.2)
    assert sorted(ran) == ["initial", "timeout-0", "timeout-1", "timeout-2"]
    (row,) = [r for r in jobs.rows() if r.code == "seed"]
    assert row.run_key is None
    assert row.status is JobSchedulerStatus.SUCCESS


@in_loop_time
async def test_registry_lookup_stop_start_add_remove() -> None:
    ran: list[str] = []
    scheduler = Scheduler(clock=loop_clock(), time_zone="Europe/Paris")
    scheduler.add_cron("nightly", "0 01 * * *", lambda tick: None)
    scheduler.add_interval("fast", 200, lambda tick: ran.append("fast"))
    info = scheduler.get("nightly")
    assert info.kind is ScheduleKind.CRON
    assert info.description == "0 01 * * *"
    assert info.time_zone == "Europe/Paris"
    assert info.next_fire_local is not None
    assert info.next_fire_local.hour == 1
    assert [i.name for i in scheduler.schedules()] == ["fast", "nightly"]
    with pytest.raises(ScheduleNotFoundError):
        scheduler.get("nope")
    async with scheduler:
        await asyncio.sleep(0.5)
        scheduler.stop("fast")
        assert not scheduler.get("fast").active
        assert scheduler.get("fast").next_fire_at is None
        count = len(ran)
        await asyncio.sleep(0.5)
        assert len(ran) == count
        scheduler.start("fast")
        scheduler.add_interval("late", 200, lambda tick: ran.append("late"))
        await asyncio.sleep(0.5)
        scheduler.remove("late")
        assert "late" not in [i.name for i in scheduler.schedules()]
    assert ran.count("fast") > count
    assert "late" in ran


@pytest.mark.parametrize(
    ("register", "message"),
    [
        (lambda s: s.add_cron("a", "0 0 31 2 *", print), "day-of-month"),
        (
            lambda s: s.add_cron("a", "* * * * *", print, time_zone="Mars/Olympus"),
            "unknown time zone",
        ),
        (lambda s: s.add_cron("", "* * * * *", print), "name"),
        (lambda s: s.add_cron("x" * 65, "* * * * *", print), "64"),
        (lambda s: s.add_interval("a", 0, print), "every_ms"),
        (lambda s: s.add_interval("a", True, print), "every_ms"),
        (lambda s: s.add_interval("a", 1000, print, retries=-1), "retries"),
        (lambda s: s.add_interval("a", 1000, print, overlap="sometimes"), "sometimes"),
        (
            lambda s: s.add_interval("a", 1000, print, lease_ms=1000, heartbeat_ms=600),
            "heartbeat_ms",
        ),
        (lambda s: s.add_interval("a", 1000, print, waitForCompletion=True), "unknown option"),
        (lambda s: s.add_interval("a", 1000, print, exclusive=True), "needs a job scheduler"),
        (lambda s: s.add_initial("a", print), "need a job scheduler"),
        (lambda s: s.add_interval("a", 1000, "not callable"), "callable"),
    ],
)
def test_bad_registrations_fail_clearly(register: Any, message: str) -> None:
    scheduler = Scheduler()
    with pytest.raises(InvalidScheduleError, match=message):
        register(scheduler)
    assert scheduler.schedules() == []


def test_duplicate_names_fail() -> None:
    scheduler = Scheduler()
    scheduler.add_interval("a", 1000, print)
    with pytest.raises(InvalidScheduleError, match="already exists"):
        scheduler.add_cron("a", "* * * * *", print)


def test_unknown_default_zone() -> None:
    with pytest.raises(InvalidScheduleError, match="unknown time zone"):
        Scheduler(time_zone="Nowhere/City")


@in_loop_time
async def test_sweep_reruns_a_tick_whose_owner_died() -> None:
    jobs = MemoryJobScheduler(clock=loop_clock())
    grid = 500
    now = loop_clock()()
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    past = epoch + timedelta(
        milliseconds=((now - epoch) // timedelta(milliseconds=grid) - 2) * grid
    )
    run_key = past.strftime("%Y-%m-%dT%H:%M:%S.") + f"{past.microsecond // 1000:03d}Z"
    # A replica took this tick and died: the row stays RUNNING until its lease expires.
    dead = await jobs.acquire({"code": "s", "run_key": run_key, "lease_ms": 1000})
    assert dead.acquired
    ran: list[str] = []
    scheduler = Scheduler(clock=loop_clock(), jobs=jobs)
    scheduler.add_interval(
        "s",
        grid,
        lambda tick: ran.append(tick.run_key or ""),
        catch_up="all",
        catch_up_window_ms=5_000,
        lease_ms=1000,
    )
    async with scheduler:
        await asyncio.sleep(2.6)
    assert ran.count(run_key) == 1
    row = next(r for r in jobs.rows() if r.run_key == run_key)
    assert row.status is JobSchedulerStatus.SUCCESS
    # Taken over: a later token (tokens come from one counter per table, not per key).
    assert row.fencing_token > dead.fencing_token
    assert set(Counter(ran).values()) == {1}


@in_loop_time
async def test_a_sweep_round_reads_many_schedules_ticks_in_few_statements() -> None:
    """1,500 schedules whose owner died holding a tick each: the sweep reruns every one once,
    reading the rows of a round's ticks in statements of up to ``SWEEP_KEYS`` keys, not one
    statement per schedule."""
    from sdcore.scheduling._supervisor import SWEEP_KEYS

    clock = loop_clock()
    reads: list[tuple[float, int]] = []  # (loop time, keys) of each tick_records call

    class Counting(MemoryJobScheduler):
        async def tick_records(self, lock_keys: Any) -> Any:
            reads.append((asyncio.get_running_loop().time(), len(lock_keys)))
            return await super().tick_records(lock_keys)

    jobs = Counting(clock=clock)
    grid, count = 500, 1_500
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    past = epoch + timedelta(
        milliseconds=((clock() - epoch) // timedelta(milliseconds=grid) - 2) * grid
    )
    run_key = past.strftime("%Y-%m-%dT%H:%M:%S.") + f"{past.microsecond // 1000:03d}Z"
    for i in range(count):
        dead = await jobs.acquire({"code": f"s{i}", "run_key": run_key, "lease_ms": 1000})
        assert dead.acquired
    ran: list[tuple[str, str]] = []
    scheduler = Scheduler(clock=clock, jobs=jobs)
    for i in range(count):
        scheduler.add_interval(
            f"s{i}",
            grid,
            lambda tick: ran.append((tick.schedule, tick.run_key or "")),
            catch_up="all",
            catch_up_window_ms=5_000,
            lease_ms=1000,
        )
    started = asyncio.get_running_loop().time()
    async with scheduler:
        await asyncio.sleep(2.6)
    assert {name for name, key in ran if key == run_key} == {f"s{i}" for i in range(count)}
    assert set(Counter(ran).values()) == {1}
    # After start-up catch-up (one read per schedule at the start), the sweep rounds.
    calls: Counter[int] = Counter()
    keys: Counter[int] = Counter()
    for at, n in reads:
        if at - started > 0.5:
            calls[round(at - started)] += 1
            keys[round(at - started)] += n
    assert calls, "no sweep round ran"
    assert max(n for _, n in reads) <= SWEEP_KEYS
    for second, n in calls.items():
        assert n <= keys[second] // (SWEEP_KEYS // 2) + 1, (second, n, keys[second])


@in_loop_time
async def test_start_up_catch_up_reads_many_schedules_in_few_statements() -> None:
    """1,500 schedules that ran before and missed their last tick while no replica ran: each
    missed tick starts once at start, read in two ``first_seen_many`` calls and a few
    ``tick_records`` calls of at most ``SWEEP_KEYS`` keys, not two statements per schedule."""
    from sdcore.scheduling._supervisor import SWEEP_KEYS

    clock = loop_clock()
    reads: list[tuple[str, int]] = []

    class Counting(MemoryJobScheduler):
        async def first_seen(self, code: str) -> Any:
            reads.append(("first_seen", 1))
            return await super().first_seen(code)

        async def first_seen_many(self, codes: Any) -> Any:
            reads.append(("first_seen_many", len(codes)))
            return await super().first_seen_many(codes)

        async def tick_records(self, lock_keys: Any) -> Any:
            reads.append(("tick_records", len(lock_keys)))
            return await super().tick_records(lock_keys)

    jobs = Counting(clock=clock)
    grid, count = 1_000, 1_500
    for i in range(count):
        got = await jobs.acquire({"code": f"s{i}", "run_key": "2026-07-20T02:59:00Z"})
        assert got.acquired
        assert await jobs.complete(got.lease)
    await asyncio.sleep(3.5)  # no replica runs: three ticks of each are missed
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    last = epoch + (clock() - epoch) // timedelta(milliseconds=grid) * timedelta(milliseconds=grid)
    missed = (last - timedelta(seconds=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    ran: list[tuple[str, str]] = []
    scheduler = Scheduler(clock=clock, jobs=jobs)
    for i in range(count):
        scheduler.add_interval(
            f"s{i}",
            grid,
            lambda tick: ran.append((tick.schedule, tick.run_key or "")),
            catch_up="all",
            catch_up_window_ms=5_000,
        )
    async with scheduler:
        await asyncio.sleep(0.5)
    assert {name for name, key in ran if key == missed} == {f"s{i}" for i in range(count)}
    assert set(Counter(ran).values()) == {1}
    assert reads.count(("first_seen", 1)) == 0
    assert [n for what, n in reads if what == "first_seen_many"] == [SWEEP_KEYS, count - SWEEP_KEYS]
    rows = [n for what, n in reads if what == "tick_records"]
    assert max(rows) <= SWEEP_KEYS
    assert len(rows) <= sum(rows) // (SWEEP_KEYS // 2) + 2, rows


@in_loop_time
async def test_start_up_catch_up_of_a_str_enum_named_schedule_and_the_others() -> None:
    """A schedule named by a ``StrEnum`` member catches up at start, and so do the schedules
    read with it (their codes go to the backend as plain ``str``)."""

    class Name(enum.StrEnum):
        A = "enum-a"

    clock = loop_clock()
    jobs = MemoryJobScheduler(clock=clock)
    for name in ("enum-a", "plain-1", "plain-2"):
        got = await jobs.acquire({"code": name, "run_key": "2026-07-20T02:59:00Z"})
        assert got.acquired
        assert await jobs.complete(got.lease)
    await asyncio.sleep(3.5)  # no replica runs: three ticks of each are missed
    ran: list[str] = []
    scheduler = Scheduler(clock=clock, jobs=jobs)
    for name in (Name.A, "plain-1", "plain-2"):
        scheduler.add_interval(
            name,
            1_000,
            lambda tick: ran.append(tick.schedule),
            catch_up="all",
            catch_up_window_ms=5_000,
        )
    async with scheduler:
        await asyncio.sleep(0.5)
    runs = Counter(ran)
    assert set(runs) == {"enum-a", "plain-1", "plain-2"}
    assert runs["enum-a"] == runs["plain-1"] == runs["plain-2"] >= 3  # the missed ones


@in_loop_time
async def test_a_sweep_round_whose_read_fails_is_logged_and_the_next_round_reruns_the_tick(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The read of a sweep round raises something unexpected: each of its schedules is logged
    (``sweep_failed``), the sweep goes on, and its next round reruns the abandoned tick once."""
    clock = loop_clock()
    calls = itertools.count()

    class FailsOnce(MemoryJobScheduler):
        async def tick_records(self, lock_keys: Any) -> Any:
            if next(calls) == 1:  # the first sweep round's read (0: start-up catch-up's)
                raise RuntimeError("boom")
            return await super().tick_records(lock_keys)

    jobs = FailsOnce(clock=clock)
    grid = 500
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    past = epoch + timedelta(
        milliseconds=((clock() - epoch) // timedelta(milliseconds=grid) - 2) * grid
    )
    run_key = past.strftime("%Y-%m-%dT%H:%M:%S.") + f"{past.microsecond // 1000:03d}Z"
    assert (await jobs.acquire({"code": "s", "run_key": run_key, "lease_ms": 1000})).acquired
    ran: list[str] = []
    scheduler = Scheduler(clock=clock, jobs=jobs)
    scheduler.add_interval(
        "s",
        grid,
        lambda tick: ran.append(tick.run_key or ""),
        catch_up="all",
        catch_up_window_ms=5_000,
        lease_ms=1000,
    )
    with caplog.at_level(logging.ERROR, logger="sdcore.scheduling"):
        async with scheduler:
            await asyncio.sleep(3.6)
    failed = [r for r in caplog.records if getattr(r, "action", None) == "sweep_failed"]
    assert [r.schedule for r in failed] == ["s"]  # type: ignore[attr-defined]
    assert ran.count(run_key) == 1
    assert set(Counter(ran).values()) == {1}


@in_loop_time
async def test_a_late_loop_fires_the_scheduled_key_not_now() -> None:
    """SC-04: a replica whose loop is blocked across ticks uses the schedule's keys."""
    seen: list[Tick] = []
    clock = loop_clock()
    scheduler = Scheduler(clock=clock, jobs=MemoryJobScheduler(clock=clock))
    lateness: list[timedelta] = []

    def grid(tick: Tick) -> None:
        seen.append(tick)
        lateness.append(clock() - tick.scheduled_at)

    scheduler.add_interval("grid", 300, grid)

    async def block(tick: Tick) -> None:
        block_loop(0.65)  # blocks the event loop (deliberately) across two grid points

    scheduler.add_interval("blocker", 1000, block, exclusive=False)
    async with scheduler:
        await asyncio.sleep(2.2)
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    assert seen
    for tick in seen:
        assert (tick.scheduled_at - epoch) // timedelta(milliseconds=1) % 300 == 0
        assert (
            tick.run_key
            == tick.scheduled_at.strftime("%Y-%m-%dT%H:%M:%S.")
            + f"{tick.scheduled_at.microsecond // 1000:03d}Z"
        )
    assert len({t.run_key for t in seen}) == len(seen)
    # The block was felt: a grid point passed while blocked, and the next tick fired late.
    gaps = [b.scheduled_at - a.scheduled_at for a, b in itertools.pairwise(seen)]
    assert max(gaps) > timedelta(milliseconds=300)
    assert max(lateness) > timedelta(0)


def test_stop_start_cycles_do_not_grow_the_timer_heap() -> None:
    async def run() -> int:
        scheduler = Scheduler()
        scheduler.add_cron("daily", "0 3 * * *", lambda tick: None)
        async with scheduler:
            for _ in range(5000):
                scheduler.stop("daily")
                scheduler.start("daily")
            for i in range(500):
                scheduler.add_interval(f"tmp{i}", 3_600_000, lambda tick: None)
                scheduler.remove(f"tmp{i}")
            return scheduler._timer.armed

    assert asyncio.run(run()) <= 2 * 1 + 64 + 1


@in_loop_time
async def test_a_timer_loop_that_crashes_in_the_middle_of_a_bucket_keeps_the_rest_armed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The schedules of one instant are taken off the heap together: when the loop stops half
    way through them (a crash its supervisor restarts it after), those it did not reach are
    armed again, not dropped for good."""
    from sdcore.scheduling._supervisor import TickStarter

    flush = TickStarter.flush
    calls = 0

    def crashing(self: TickStarter, *, final: bool = True) -> bool:
        nonlocal calls
        calls += 1
        if calls == 2:  # after the first slice of 100
            raise RuntimeError("flush failed")
        return flush(self, final=final)

    monkeypatch.setattr(TickStarter, "flush", crashing)
    scheduler = Scheduler(clock=loop_clock())
    fired: Counter[str] = Counter()
    for i in range(250):
        scheduler.add_interval(f"s{i}", 10_000, lambda tick: fired.update([tick.schedule]))
    async with scheduler:
        await asyncio.sleep(25.0)  # the instants at 10 s and 20 s
    assert calls > 2
    assert "flush failed" in caplog.text  # the loop crashed, and was restarted
    assert fired == Counter({f"s{i}": 2 for i in range(250)})
