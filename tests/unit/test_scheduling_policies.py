"""Scheduling policies, driven by loop time (``looptime``, see ``_looptime.py``): ten
scenarios (``test_r1`` … ``test_r10``) and the policy matrix (overlap × catch-up × retries ×
start path).

Every scheduler and the in-memory lease read one clock derived from the event loop's (fake) time,
so hours of schedule run in milliseconds and nothing depends on the machine's load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

import pytest

from sdcore.job_scheduler import (
    AttemptAcquireResult,
    AttemptBudget,
    JobAcquireOptions,
    JobLease,
    JobSchedulerStatus,
)
from sdcore.job_scheduler._options import JS_TRIM_CHARS, js_trim
from sdcore.scheduling import InvalidScheduleError, Scheduler, Tick
from sdcore.testing import MemoryJobScheduler
from tests.unit._looptime import BASE, in_loop_time, loop_clock

Clock = Callable[[], datetime]


def key(code: str, run_key: str) -> str:
    return JobAcquireOptions(code=code, run_key=run_key).lock_key


async def seen_before(jobs: MemoryJobScheduler, code: str) -> None:
    """Give ``code`` an old row, as a schedule that ran before (catch-up applies to it)."""
    got = await jobs.acquire({"code": code, "run_key": "2000-01-01T00:00:00Z"})
    assert got.acquired
    await jobs.complete(got.lease)


# --------------------------------------------------------------------------- reproductions


@pytest.mark.parametrize(("retries", "most"), [(0, 1), (2, 3)])
@in_loop_time
async def test_r1_a_failed_tick_runs_at_most_retries_plus_one_times(
    retries: int, most: int
) -> None:
    """R1: three replicas 0/300/600 ms apart, a handler that always fails."""
    jobs = MemoryJobScheduler(clock=loop_clock())
    runs: Counter[str] = Counter()
    active: Counter[str] = Counter()
    overlapped = []
    schedulers = [Scheduler(jobs=jobs, clock=loop_clock(-skew)) for skew in (0, 300, 600)]
    for scheduler in schedulers:

        async def fail(tick: Tick) -> None:
            assert tick.run_key is not None
            runs[tick.run_key] += 1
            active[tick.run_key] += 1
            if active[tick.run_key] > 1:
                overlapped.append(tick.run_key)
            await asyncio.sleep(0.1)
            active[tick.run_key] -= 1
            raise RuntimeError("always")

        scheduler.add_cron("r1", "*/5 * * * * *", fail, retries=retries, retry_backoff_ms=200)
    async with schedulers[0], schedulers[1], schedulers[2]:
        await asyncio.sleep(60)
    assert len(runs) >= 10
    assert max(runs.values()) <= most, runs
    if retries:
        assert max(runs.values()) == most, "the retries did not happen"
    assert overlapped == []
    for row in jobs.rows():
        if row.code == "r1":
            assert row.status is JobSchedulerStatus.FAIL


@in_loop_time
async def test_r2_the_sweep_obeys_overlap_skip_and_skips_are_recorded() -> None:
    jobs = MemoryJobScheduler(clock=loop_clock())
    await seen_before(jobs, "r2")
    active = peak = 0
    scheduler = Scheduler(jobs=jobs, clock=loop_clock(), lease_ms=2000)

    async def slow(tick: Tick) -> None:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(3.5)
        active -= 1

    scheduler.add_interval("r2", 1000, slow, catch_up="all", lease_ms=2000)
    async with scheduler:
        await asyncio.sleep(20)
    assert peak == 1
    start, end = BASE + timedelta(seconds=2), BASE + timedelta(seconds=15)
    missed = await scheduler.missed_ticks("r2", start, end)
    assert missed, "a 3.5 s handler every second skips ticks"
    assert all(m.skipped == "overlap" and m.attempts == 0 for m in missed), missed


@in_loop_time
async def test_r3_latest_catches_up_at_any_frequency() -> None:
    jobs = MemoryJobScheduler(clock=loop_clock())
    await seen_before(jobs, "r3")
    await asyncio.sleep(100)  # 100 s of 100 ms ticks nobody ran: 1,000 ticks in the window
    ran: list[str] = []

    async def record(tick: Tick) -> None:
        ran.append(tick.run_key or "")

    scheduler = Scheduler(jobs=jobs, clock=loop_clock())
    scheduler.add_interval("r3", 100, record, catch_up="latest")
    started = BASE + timedelta(seconds=100)
    async with scheduler:
        await asyncio.sleep(0.05)
    assert ran == [
        (started - timedelta(milliseconds=100)).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    ]


@in_loop_time
async def test_r4_latest_never_walks_back_through_the_window() -> None:
    jobs = MemoryJobScheduler(clock=loop_clock())
    await seen_before(jobs, "r4")
    ran: list[str] = []

    async def record(tick: Tick) -> None:
        ran.append(tick.run_key or "")

    scheduler = Scheduler(jobs=jobs, clock=loop_clock(), lease_ms=60_000)
    scheduler.add_cron("r4", "*/5 * * * *", record, catch_up="latest", lease_ms=60_000)
    await asyncio.sleep(3 * 3600 + 1)  # three hours down
    async with scheduler:
        await asyncio.sleep(3600)
    before = [k for k in ran if k < "2026-07-20T06:00:01Z"]
    assert before == ["2026-07-20T06:00:00Z"], "start-up catch-up runs one tick, the latest"
    assert len(ran) == 1 + 12, Counter(ran)  # plus the hour's own ticks, each once
    assert set(Counter(ran).values()) == {1}


@in_loop_time
async def test_r5_a_schedule_removed_while_the_sweep_awaits_does_not_run() -> None:
    class Slow(MemoryJobScheduler):
        async def tick_records(self, lock_keys: Any) -> Any:
            await asyncio.sleep(0.5)
            return await super().tick_records(lock_keys)

        async def statuses(self, lock_keys: Any) -> Any:  # the plain lease's status read
            await asyncio.sleep(0.5)
            return await super().statuses(lock_keys)

    jobs = Slow(clock=loop_clock())
    await seen_before(jobs, "r5")
    await asyncio.sleep(20)
    # Ten ticks before the start are owned by a replica that just died (lease 3 s): start-up
    # catch-up finds them RUNNING, the sweep 3 s later could take them over.
    for second in range(10, 20):
        dead = await jobs.acquire(
            {"code": "r5", "run_key": f"2026-07-20T03:00:{second:02d}Z", "lease_ms": 3000}
        )
        assert dead.acquired
    ran: list[str] = []

    async def record(tick: Tick) -> None:
        ran.append(tick.run_key or "")

    scheduler = Scheduler(jobs=jobs, clock=loop_clock())
    scheduler.add_interval("r5", 1000, record, catch_up="all", lease_ms=3000)
    async with scheduler:
        await asyncio.sleep(3.2)  # the first sweep (at +3 s) awaits its query now
        scheduler.remove("r5")
        ran.clear()
        await asyncio.sleep(5)
    assert ran == []


@in_loop_time
async def test_r6_aclose_waits_for_the_run_of_a_removed_schedule() -> None:
    jobs = MemoryJobScheduler(clock=loop_clock())
    finished: list[str] = []
    scheduler = Scheduler(jobs=jobs, clock=loop_clock(), grace_period_ms=5000)

    async def long(tick: Tick) -> None:
        await asyncio.sleep(2)
        finished.append(tick.run_key or "")

    scheduler.add_interval("r6", 1000, long)
    async with scheduler:
        await asyncio.sleep(1.5)
        scheduler.remove("r6")
    assert finished, "aclose returned before the removed schedule's run ended"
    assert all(r.status is JobSchedulerStatus.SUCCESS for r in jobs.rows())


@in_loop_time
async def test_r7_a_second_start_works_and_a_double_start_raises() -> None:
    ran: list[str] = []

    async def record(tick: Tick) -> None:
        ran.append(tick.run_key or "")

    scheduler = Scheduler(clock=loop_clock())
    scheduler.add_interval("r7", 1000, record)
    async with scheduler:
        await asyncio.sleep(3.5)
        with pytest.raises(RuntimeError, match="already running"):
            await scheduler.start_all()
    first = len(ran)
    assert scheduler.get("r7").next_fire_at is not None  # computed from now, not stale
    async with scheduler:
        await asyncio.sleep(3.5)
    assert first == 3
    assert len(ran) == 6
    assert len(set(ran)) == 6


@pytest.mark.parametrize(
    "register",
    [
        lambda s, h: s.add_interval("r8", 2**50, h),
        lambda s, h: s.add_timeout("r8", 2**50, h),
        lambda s, h: s.add_interval("r8", 1000, h, catch_up_window_ms=2**50, catch_up="all"),
        lambda s, h: s.add_interval("r8", 1000, h, retry_backoff_ms=2**50),
        lambda s, h: s.add_interval("r8", 1000, h, retries=10**6),
        lambda s, h: s.add_interval("r8", 1000, h, jitter_ms=2**50),
    ],
    ids=["every", "delay", "window", "backoff", "retries", "jitter"],
)
@in_loop_time
async def test_r8_huge_numbers_fail_at_registration_even_at_run_time(register: Any) -> None:
    async def noop(tick: Tick) -> None:
        return None

    scheduler = Scheduler(jobs=MemoryJobScheduler(clock=loop_clock()), clock=loop_clock())
    with pytest.raises(InvalidScheduleError):
        register(scheduler, noop)
    async with scheduler:
        with pytest.raises(InvalidScheduleError):
            register(scheduler, noop)
        assert scheduler.schedules() == []
        scheduler.add_interval("ok", 1000, noop)
        await asyncio.sleep(1.5)


@in_loop_time
async def test_r9_the_overlap_guard_reacts_to_a_refused_heartbeat() -> None:
    guards: set[str] = set()

    class Refusing(MemoryJobScheduler):
        async def acquire(self, options: Any) -> Any:
            got = await super().acquire(options)
            if got.acquired and got.row.run_key == "overlap-guard":
                guards.add(got.id)
            return got

        async def heartbeat(self, lease: JobLease) -> bool:
            if lease.id in guards:
                return False  # as if another replica had taken the guard over
            return await super().heartbeat(lease)

    jobs = Refusing(clock=loop_clock())
    outcome: list[str] = []
    scheduler = Scheduler(jobs=jobs, clock=loop_clock())

    async def long(tick: Tick) -> None:
        try:
            await asyncio.sleep(30)
            outcome.append("finished")
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise

    scheduler.add_cron(
        "r9", "0 * * * *", long, overlap="skip_cluster", lease_ms=3000, exclusive=True
    )
    async with scheduler:
        await asyncio.sleep(3600 + 40)  # the 04:00 tick's handler would end at 04:00:30
    assert outcome == ["cancelled"]


@pytest.mark.parametrize(
    ("raw", "trimmed"),
    [
        ("\ufeffjob", "job"),
        ("job\u3000", "job"),
        ("\u2028job\u2029", "job"),
        ("\x1fjob", "\x1fjob"),
        ("job\x85", "job\x85"),
        ("\u180ejob", "\u180ejob"),
    ],
)
def test_r10_codes_are_trimmed_as_javascript_trims(raw: str, trimmed: str) -> None:
    assert js_trim(raw) == trimmed
    assert JobAcquireOptions(code=raw, run_key="k").code == trimmed
    assert "\x85" not in JS_TRIM_CHARS


@pytest.mark.parametrize("add", ["cron", "interval", "initial"])
def test_names_follow_the_lease_identity_rules(add: str) -> None:
    scheduler = Scheduler(jobs=MemoryJobScheduler())
    name = "report\ud800"
    register: dict[str, Callable[[], None]] = {
        "cron": lambda: scheduler.add_cron(name, "* * * * *", print),
        "interval": lambda: scheduler.add_interval(name, 1000, print),
        "initial": lambda: scheduler.add_initial(name, print),
    }
    with pytest.raises(InvalidScheduleError, match="surrogate"):
        register[add]()
    with pytest.raises(InvalidScheduleError, match="trimmed"):
        scheduler.add_interval("\ufeffreport", 1000, print)
    assert scheduler.schedules() == []


# --------------------------------------------------------------------------- policy matrix

# What the docs promise (docs/explanation/scheduling.md, "Policies"), per cell:
# - fire: a 2.5 s handler every second. skip / skip_cluster: never two at once, the other ticks
#   are recorded skipped; allow: every tick runs, overlapping.
# - catch_up at start (the schedule ran before; 5 ticks missed while down): off → 0, latest → 1,
#   all → 5 (one after the other under skip).
# - retries r with an always-failing handler: each tick runs r + 1 times (if the next tick leaves
#   room), never more.
OVERLAPS = ["skip", "allow", "skip_cluster"]
CATCH_UPS = {"off": 0, "latest": 1, "all": 5}


@pytest.mark.parametrize("overlap", OVERLAPS)
@pytest.mark.parametrize("catch_up", list(CATCH_UPS))
@in_loop_time
async def test_matrix_catch_up_start_path(overlap: str, catch_up: str) -> None:
    jobs = MemoryJobScheduler(clock=loop_clock())
    await asyncio.sleep(30)
    await seen_before(jobs, "m")  # the schedule first ran at 03:00:30
    await asyncio.sleep(5 * 60)  # then every replica was down: 03:01 … 03:05 missed
    ran: Counter[str] = Counter()
    active = peak = 0

    async def work(tick: Tick) -> None:
        nonlocal active, peak
        ran[tick.run_key or ""] += 1
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(2)
        active -= 1

    scheduler = Scheduler(jobs=jobs, clock=loop_clock(), lease_ms=10_000)
    scheduler.add_cron(
        "m",
        "* * * * *",
        work,
        overlap=overlap,  # type: ignore[arg-type]
        catch_up=catch_up,  # type: ignore[arg-type]
        catch_up_window_ms=10 * 60_000,
    )
    async with scheduler:
        await asyncio.sleep(20)
    assert sum(ran.values()) == CATCH_UPS[catch_up]
    assert set(ran.values()) <= {1}
    if overlap != "allow":
        assert peak <= 1
    missed = await scheduler.missed_ticks(
        "m", BASE + timedelta(seconds=1), BASE + timedelta(minutes=6)
    )
    assert len(missed) == 5 - CATCH_UPS[catch_up]
    assert all(m.status is None for m in missed)  # never started (not skipped)


@pytest.mark.parametrize("overlap", OVERLAPS)
@in_loop_time
async def test_matrix_fire_path(overlap: str) -> None:
    jobs = MemoryJobScheduler(clock=loop_clock())
    runs: Counter[str] = Counter()
    active = peak = 0
    schedulers = [Scheduler(jobs=jobs, clock=loop_clock(-skew)) for skew in (0, 300)]
    for scheduler in schedulers:

        async def work(tick: Tick) -> None:
            nonlocal active, peak
            runs[tick.run_key or ""] += 1
            active += 1
            peak = max(peak, active)
            await asyncio.sleep(2.5)
            active -= 1

        scheduler.add_interval("f", 1000, work, overlap=overlap, lease_ms=10_000)  # type: ignore[arg-type]
    async with schedulers[0], schedulers[1]:
        await asyncio.sleep(20.5)
    assert set(runs.values()) == {1}, "a tick ran twice"
    missed = await schedulers[0].missed_ticks(
        "f", BASE + timedelta(seconds=1), BASE + timedelta(seconds=17)
    )
    if overlap == "skip_cluster":
        assert peak == 1
        assert missed
        assert all(m.skipped == "overlap" for m in missed)
    elif overlap == "skip":
        assert peak == 2  # two replicas, each busy with its own tick
        assert all(m.skipped == "overlap" for m in missed)
    else:
        assert peak >= 3
        assert missed == []


@pytest.mark.parametrize("retries", [0, 1, 3])
@pytest.mark.parametrize("path", ["fire", "catch_up", "sweep"])
@in_loop_time
async def test_matrix_retries_per_path(retries: int, path: str) -> None:
    jobs = MemoryJobScheduler(clock=loop_clock())
    await seen_before(jobs, "r")
    runs: Counter[str] = Counter()

    async def fail(tick: Tick) -> None:
        runs[tick.run_key or ""] += 1
        raise RuntimeError("always")

    if path == "catch_up":
        await asyncio.sleep(60 + 1)  # one minutely tick missed while down
    scheduler = Scheduler(jobs=jobs, clock=loop_clock(), lease_ms=2000)

    async def die_with_the_tick() -> None:
        # Another replica takes the 03:01 tick a second early, then dies: the sweep re-runs it.
        await asyncio.sleep(59)
        options = {"code": "r", "run_key": "2026-07-20T03:01:00Z", "lease_ms": 2000}
        assert (await jobs.acquire(options)).acquired

    scheduler.add_cron(
        "r",
        "* * * * *",
        fail,
        retries=retries,
        retry_backoff_ms=500,
        catch_up="all" if path != "fire" else "off",
        lease_ms=2000,
    )
    async with scheduler:
        if path == "sweep":
            await die_with_the_tick()
            await asyncio.sleep(10)
        else:
            await asyncio.sleep(50 if path == "catch_up" else 61)
    target = "2026-07-20T03:01:00Z"
    # The dead replica's attempt counts (it started); re-running an abandoned attempt is always
    # allowed (the tick never finished), so that tick has max(retries + 1, 2) attempts in all.
    attempts = max(retries + 1, 2) if path == "sweep" else retries + 1
    ours = attempts - 1 if path == "sweep" else attempts
    assert runs[target] == ours, runs
    assert max(runs.values()) <= retries + 1
    missed = await scheduler.missed_ticks(
        "r", BASE + timedelta(minutes=1), BASE + timedelta(minutes=1, seconds=1)
    )
    assert [(m.status, m.attempts) for m in missed] == [(JobSchedulerStatus.FAIL, attempts)]


@pytest.mark.parametrize("catch_up", list(CATCH_UPS))
@in_loop_time
async def test_matrix_pause_path(catch_up: str) -> None:
    """Ticks that fall while a schedule is stopped are not run by any path (the sweep looks only
    at ticks since it was started again) and are recorded as skipped (``"paused"``)."""
    jobs = MemoryJobScheduler(clock=loop_clock())
    await seen_before(jobs, "p")
    ran: Counter[str] = Counter()

    async def work(tick: Tick) -> None:
        ran[tick.run_key or ""] += 1

    scheduler = Scheduler(jobs=jobs, clock=loop_clock(), lease_ms=2000)
    scheduler.add_interval("p", 1000, work, catch_up=catch_up, lease_ms=2000)  # type: ignore[arg-type]
    async with scheduler:
        await asyncio.sleep(3.5)  # 03:00:01 … 03:00:03 run
        scheduler.stop("p")
        await asyncio.sleep(5)  # 03:00:04 … 03:00:08 fall while stopped
        scheduler.start("p")
        await asyncio.sleep(10)
    paused = [f"2026-07-20T03:00:0{s}Z" for s in range(4, 9)]
    assert all(ran[key] == 0 for key in paused), ran
    assert set(ran.values()) == {1}
    missed = await scheduler.missed_ticks(
        "p", BASE + timedelta(seconds=1), BASE + timedelta(seconds=18)
    )
    assert [(m.run_key, m.skipped) for m in missed] == [(key, "paused") for key in paused]


@in_loop_time
async def test_a_fire_during_the_previous_tick_s_jitter_is_an_overlap_skip() -> None:
    """A jittered tick counts as running from its start: a fire while it waits out its jitter is
    an overlap (recorded skipped), not a tick 'waiting on the database' left without a row."""
    jobs = MemoryJobScheduler(clock=loop_clock())
    scheduler = Scheduler(jobs=jobs, clock=loop_clock())

    async def handler(tick: Tick) -> None:
        # Async: a worker thread's hand-offs move loop time with real time (see the next test),
        # and a tick whose handler has returned waits on the database until its completion.
        return None

    scheduler.add_interval("jit", 1000, handler, jitter_ms=2500, catch_up="off")
    async with scheduler:
        await asyncio.sleep(20)
    missed = await scheduler.missed_ticks(
        "jit", BASE + timedelta(seconds=2), BASE + timedelta(seconds=15)
    )
    assert missed, "a 2.5 s jitter every second overlaps"
    assert all(m.skipped == "overlap" for m in missed), missed


class _SlowCompletion(MemoryJobScheduler):
    """Completions of the ticks at ``slow`` (seconds after ``BASE``) take ``seconds`` of loop
    time: the database does not answer the commit meanwhile."""

    def __init__(self, slow: int, seconds: float) -> None:
        super().__init__(clock=loop_clock())
        self.slow_key = (BASE + timedelta(seconds=slow)).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.seconds = seconds

    async def complete(self, lease: JobLease, data: Any = None) -> bool:
        row = self.get(lease.id)
        if row is not None and row.run_key == self.slow_key:
            await asyncio.sleep(self.seconds)
        return await super().complete(lease, data)


@pytest.mark.parametrize(("stall", "lost"), [(1.5, []), (2.5, [4])])
@in_loop_time
async def test_a_fire_behind_a_run_waiting_on_the_database_starts_when_it_ends(
    stall: float, lost: list[int]
) -> None:
    """A fire that finds the previous run waiting on the database (its completion's commit) is no
    overlap: it starts once that run ends, before its successor is due; a fire whose successor
    comes first is a missed tick without a row (``catch_up="off"``: never run)."""
    jobs = _SlowCompletion(slow=3, seconds=stall)
    scheduler = Scheduler(jobs=jobs, clock=loop_clock())
    started: list[tuple[str | None, float]] = []

    async def handler(tick: Tick) -> None:
        started.append((tick.run_key, asyncio.get_running_loop().time()))

    scheduler.add_interval("slow", 1000, handler)
    async with scheduler:
        await asyncio.sleep(8.5)
    keys = [(BASE + timedelta(seconds=s)).strftime("%Y-%m-%dT%H:%M:%SZ") for s in range(1, 9)]
    ran = Counter(key for key, _ in started)
    missed = await scheduler.missed_ticks(
        "slow", BASE + timedelta(seconds=1), BASE + timedelta(seconds=8)
    )
    assert [m.run_key for m in missed] == [keys[s - 1] for s in lost]
    assert all(m.status is None and m.skipped is None for m in missed), missed
    assert {key: ran[key] for key in keys} == {
        key: int(key not in {keys[s - 1] for s in lost}) for key in keys
    }
    # The waiting fire started when the commit in its way answered, not at its successor.
    late = [at for key, at in started if key == keys[3 + len(lost)]]
    assert late == [pytest.approx(3 + stall, abs=0.05)], started


class _SlowAcquire(MemoryJobScheduler):
    """The acquire of the tick at 3 s after ``BASE`` takes 1.5 s of loop time."""

    def __init__(self) -> None:
        super().__init__(clock=loop_clock())
        self.slow_key = (BASE + timedelta(seconds=3)).strftime("%Y-%m-%dT%H:%M:%SZ")

    async def acquire_attempt(
        self, options: JobAcquireOptions, budget: AttemptBudget
    ) -> AttemptAcquireResult:
        if options.run_key == self.slow_key:
            await asyncio.sleep(1.5)
        return await super().acquire_attempt(options, budget)


@in_loop_time
async def test_a_waiting_fire_whose_successor_came_first_does_not_start_late() -> None:
    """The tick at 4 s waits for the run of 3 s, whose acquire waits on the database until 4.5 s;
    that run then holds its handler until 5.5 s, so the fire at 5 s is an overlap skip, and the
    waiting tick, whose successor came before the run ended, is a missed tick: it does not start
    at 5.5 s behind its successor's skip."""
    jobs = _SlowAcquire()
    scheduler = Scheduler(jobs=jobs, clock=loop_clock())
    started: list[tuple[str | None, float]] = []

    async def handler(tick: Tick) -> None:
        started.append((tick.run_key, asyncio.get_running_loop().time()))
        if tick.run_key == jobs.slow_key:
            await asyncio.sleep(1.0)

    scheduler.add_interval("slow", 1000, handler)
    async with scheduler:
        await asyncio.sleep(7.5)
    missed = await scheduler.missed_ticks(
        "slow", BASE + timedelta(seconds=1), BASE + timedelta(seconds=7)
    )
    at = {s: (BASE + timedelta(seconds=s)).strftime("%Y-%m-%dT%H:%M:%SZ") for s in range(1, 8)}
    assert [(m.run_key, m.status, m.skipped) for m in missed] == [
        (at[4], None, None),
        (at[5], JobSchedulerStatus.FAIL, "overlap"),
    ]
    assert [key for key, _ in started] == [at[1], at[2], at[3], at[6], at[7]], started


@in_loop_time
async def test_a_waiting_fire_survives_its_schedule_replaced_during_the_acquire_in_its_way() -> (
    None
):
    """The tick at 4 s waits for the run of 3 s, whose batch acquire waits on the database until
    4.5 s; at 4.2 s the schedule is replaced (a stored schedule updated): the waiting tick runs,
    with the new handler, once that acquire has answered."""
    jobs = _SlowAcquire()
    scheduler = Scheduler(jobs=jobs, clock=loop_clock())
    started: list[tuple[str, str | None, float]] = []

    def handler(version: str) -> Callable[[Tick], Any]:
        async def handle(tick: Tick) -> None:
            started.append((version, tick.run_key, asyncio.get_running_loop().time()))

        return handle

    scheduler.add_interval("slow", 1000, handler("v1"))
    async with scheduler:
        await asyncio.sleep(4.2)
        entry = scheduler._entries["slow"]
        scheduler._add("slow", entry.trigger, handler("v2"), entry.zone, {}, replace=True)
        await asyncio.sleep(2.5)
    at = {s: (BASE + timedelta(seconds=s)).strftime("%Y-%m-%dT%H:%M:%SZ") for s in range(1, 7)}
    assert [(v, key) for v, key, _ in started] == [
        ("v1", at[1]),
        ("v1", at[2]),
        ("v2", at[3]),
        ("v2", at[4]),
        ("v2", at[5]),
        ("v2", at[6]),
    ], started
    assert started[3][2] == pytest.approx(4.5, abs=0.05), started


@in_loop_time
async def test_a_waiting_fire_dropped_by_a_stop_is_logged_as_missed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The tick at 4 s waits for the run of 3 s (its acquire waits on the database); the
    schedule is stopped at 4.2 s: the waiting tick does not start, and is logged missed."""
    jobs = _SlowAcquire()
    scheduler = Scheduler(jobs=jobs, clock=loop_clock())
    started: list[str | None] = []

    async def handler(tick: Tick) -> None:
        started.append(tick.run_key)

    scheduler.add_interval("slow", 1000, handler)
    with caplog.at_level(logging.INFO, logger="sdcore"):
        async with scheduler:
            await asyncio.sleep(4.2)
            scheduler.stop("slow")
            await asyncio.sleep(1.0)
    key = (BASE + timedelta(seconds=4)).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert key not in started
    missed = [r for r in caplog.records if getattr(r, "action", None) == "tick_deferred_missed"]
    assert [getattr(r, "run_key", None) for r in missed] == [key], caplog.text


class _SlowStart(ThreadPoolExecutor):
    """An executor whose workers are all busy for ``delay`` seconds (real time) before a call."""

    def __init__(self, delay: float) -> None:
        super().__init__(max_workers=2)
        self.delay = delay

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        def late() -> Any:
            time.sleep(self.delay)
            return fn(*args, **kwargs)

        return super().submit(late)


@in_loop_time
async def test_a_fire_while_a_plain_handler_waits_for_a_thread_is_an_overlap_skip() -> None:
    """A plain handler whose lease is won counts as running while its worker thread has not
    started yet: a fire meanwhile is an overlap (recorded skipped), not a missed tick without a
    reason. The loop's time moves in step with real time while a thread is pending."""
    executor = _SlowStart(0.7)
    asyncio.get_running_loop().set_default_executor(executor)
    jobs = MemoryJobScheduler(clock=loop_clock())
    scheduler = Scheduler(jobs=jobs, clock=loop_clock())
    ran: list[str | None] = []
    scheduler.add_interval("slow", 500, lambda tick: ran.append(tick.run_key), catch_up="off")
    async with scheduler:
        await asyncio.sleep(2.2)
    missed = await scheduler.missed_ticks(
        "slow", BASE + timedelta(seconds=0.5), BASE + timedelta(seconds=2)
    )
    assert ran, "the handler ran"
    assert missed, "a handler that starts 0.7 s late overlaps a tick every 0.5 s"
    assert [m.skipped for m in missed] == ["overlap"] * len(missed), missed
