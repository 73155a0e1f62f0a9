"""Pause holds on every path a tick can start by: a stopping replica, retries, the resume gap;
and the control plane's own work (backfill, resume catch-up) neither stalls nor starves the live
schedule. Real PostgreSQL, real ``Runtime``/``ScheduleControl`` replicas in this process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from sdcore import Runtime
from sdcore.job_scheduler import JobSchedulerService
from sdcore.postgres import PoolSettings
from sdcore.scheduling import (
    MissedTick,
    PostgresScheduleStore,
    ScheduleAdmin,
    ScheduleControl,
    Scheduler,
    Tick,
)
from tests.integration._schedule_pg import schedule_pool
from tests.integration._schedule_pg import until as _until


async def _settled(predicate: Callable[[], Awaitable[bool]], *, within: float) -> None:
    """Wait until ``predicate()`` is true or ``within`` seconds have passed; the caller judges."""
    deadline = asyncio.get_running_loop().time() + within
    while asyncio.get_running_loop().time() < deadline and not await predicate():
        await asyncio.sleep(0.05)


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    async with schedule_pool(pg_dsn) as pool:
        yield pool


async def test_a_stopping_replica_keeps_a_paused_schedule_paused(pg_dsn: str) -> None:
    """The stop's ``leave`` waits on a locked replicas row while the timer still fires: the
    paused schedule must start nothing in that window."""
    runs: list[str | None] = []
    runtime = Runtime(database_url=pg_dsn)

    async def beat(tick: Tick) -> None:
        runs.append(tick.run_key)

    runtime.scheduler.add_interval("beat", 100, beat)
    admin = ScheduleAdmin(runtime.schedule_store)
    async with await psycopg.AsyncConnection.connect(pg_dsn) as locker:
        await runtime.start()
        try:
            await admin.pause("beat", actor="ops", reason="stop test")

            async def held() -> bool:
                return runtime.control.paused("beat")

            await _until(held)
            await asyncio.sleep(0.3)  # a run that began before the pause has ended by now
            before = len(runs)
            # The stop's leave() waits on this lock (a slow database does the same).
            await locker.execute("SELECT * FROM sdcore_schedules_replicas FOR UPDATE")
            release = asyncio.get_running_loop().call_later(
                1.5, lambda: asyncio.ensure_future(locker.rollback())
            )
        except BaseException:
            await runtime.stop()
            raise
        try:
            await runtime.stop()
        finally:
            release.cancel()
    assert runs[before:] == [], f"{len(runs) - before} run(s) of the paused schedule in the stop"


async def _ticks_run(pool: AsyncConnectionPool[Any], name: str) -> set[str]:
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT run_key FROM sdcore_schedules_runs WHERE schedule = %s AND status = 'SUCCESS'",
            (name,),
        )
        return {row[0] for row in await cur.fetchall()}


@pytest.mark.parametrize("change", ["update", "remove"])
async def test_a_backfill_follows_its_stored_schedule_being_changed(
    pool: AsyncConnectionPool[Any], change: str
) -> None:
    """Updating the args keeps the backfill going to the end; removing the schedule ends it as
    ``CANCELLED``. Neither leaves the coordinator looping with the action open."""
    jobs = JobSchedulerService(pool, max_connections=2)
    scheduler = Scheduler(jobs=jobs)
    seen: list[tuple[str | None, str]] = []

    @scheduler.handler("digest")
    async def digest(tick: Tick, args: dict[str, Any]) -> None:
        seen.append((tick.run_key, args["customer"]))
        await asyncio.sleep(0.3)

    store = PostgresScheduleStore(pool)
    admin = ScheduleAdmin(store)
    async with ScheduleControl(scheduler, store, poll_interval_ms=100), scheduler:
        await admin.create(
            "digest", handler="digest", every_ms=1_000, args={"customer": "acme"}, actor="ops"
        )
        now = datetime.now(UTC).replace(microsecond=0)
        action = await admin.backfill(
            "digest", now - timedelta(seconds=60), now - timedelta(seconds=45), actor="ops"
        )
        assert action.params["ticks"] == 16

        async def three_ran() -> bool:
            return len([k for k, _ in seen if k is not None and k < now.isoformat()]) >= 3

        await _until(three_ran)
        if change == "update":
            await admin.update(
                "digest",
                handler="digest",
                every_ms=1_000,
                args={"customer": "acme-2"},
                actor="ops",
            )
        else:
            await admin.remove("digest", actor="ops")

        async def finished() -> bool:
            return (await admin.action(action.id)).finished_at is not None

        await _until(finished, timeout=30.0)
        if change == "remove":
            # The remove closed the action (CANCELLED) before the coordinator noticed: the
            # coordinator still writes how far it got.

            async def final_progress() -> bool:
                progress = (await admin.action(action.id)).progress
                return progress is not None and progress["succeeded"] >= 3

            await _until(final_progress, timeout=30.0)
        final = await admin.action(action.id)
    window = {(now - timedelta(seconds=s)).strftime("%Y-%m-%dT%H:%M:%SZ") for s in range(45, 61)}
    if change == "update":
        assert final.outcome == "SUCCESS", final
        assert window <= await _ticks_run(pool, "digest")
        assert {c for k, c in seen if k in window} == {"acme", "acme-2"}
    else:
        assert final.outcome == "CANCELLED", final
        assert final.progress is not None
        assert 3 <= final.progress["succeeded"] < 16


class _PollClock(PostgresScheduleStore):
    """The PostgreSQL store, noting when the replica's poll read the changes (a poll's first
    statement; the rows are read after it only when there are new ones)."""

    polled: asyncio.Event

    async def changes(self) -> Any:
        changes = await super().changes()
        self.polled.set()
        return changes


async def test_ticks_between_the_resume_and_its_poll_are_caught_up(
    pool: AsyncConnectionPool[Any],
) -> None:
    """Poll-only replica (PgBouncer set-up): ticks that fall after the resume's commit but
    before the replica's next poll are caught up under ``catch_up="all"``."""
    jobs = JobSchedulerService(pool, max_connections=2)
    scheduler = Scheduler(jobs=jobs)
    scheduler.add_interval("beat", 200, lambda tick: None, catch_up="all")
    store = _PollClock(pool)
    store.polled = asyncio.Event()
    admin = ScheduleAdmin(PostgresScheduleStore(pool))
    control = ScheduleControl(scheduler, store, poll_interval_ms=1_500, listen=False)
    async with control, scheduler:
        await asyncio.sleep(0.5)
        await admin.pause("beat", actor="ops")

        async def held() -> bool:
            return control.paused("beat")

        await _until(held)
        await asyncio.sleep(1.0)
        store.polled.clear()
        await store.polled.wait()  # resume just after a poll: the next one is 1.5 s away
        resumed = await admin.resume("beat", actor="ops")

        async def applied() -> bool:
            return not control.paused("beat")

        await _until(applied)
        applied_at = datetime.now(UTC)
        gap = (applied_at - resumed.created_at).total_seconds()
        assert gap > 0.6, f"the replica applied the resume after only {gap:.2f} s"
        await asyncio.sleep(2.0)  # the catch-up runs
        missed = await scheduler.missed_ticks("beat", resumed.created_at, applied_at)
    assert missed == [], f"{len(missed)} tick(s) of the resume gap never ran: {missed[:3]}"


async def test_a_pause_holds_back_the_retries_of_a_failed_tick(
    pool: AsyncConnectionPool[Any],
) -> None:
    """Attempt 1 fails, the operator pauses: no attempt starts once the replica holds the pause.
    On resume, ``catch_up="all"`` gives the tick the attempts it has left."""
    jobs = JobSchedulerService(pool, max_connections=2)
    scheduler = Scheduler(jobs=jobs)
    attempts: list[tuple[str | None, int, bool]] = []
    control: ScheduleControl | None = None
    first_failed = asyncio.Event()

    async def invoices(tick: Tick) -> None:
        assert control is not None
        attempts.append((tick.run_key, tick.attempt, control.paused("invoices")))
        if not first_failed.is_set():
            first_failed.set()
            raise RuntimeError("wrong amounts")

    scheduler.add_interval(
        "invoices", 4_000, invoices, retries=2, retry_backoff_ms=1_500, catch_up="all"
    )
    store = PostgresScheduleStore(pool)
    admin = ScheduleAdmin(store)
    control = ScheduleControl(scheduler, store, poll_interval_ms=100)
    async with control, scheduler:
        await asyncio.wait_for(first_failed.wait(), 10)
        failed_key = attempts[0][0]
        await admin.pause("invoices", actor="ops", reason="wrong amounts")

        async def held() -> bool:
            return control.paused("invoices")

        await _until(held)
        await asyncio.sleep(3.0)  # the retry's backoff ends meanwhile
        during = [a for a in attempts if a[2]]
        assert during == [], f"attempts started while the pause was held: {during}"
        await admin.resume("invoices", actor="ops")

        async def retried() -> bool:
            return any(k == failed_key and n == 2 for k, n, _ in attempts)

        await _until(retried)
    assert [n for k, n, _ in attempts if k == failed_key] == [1, 2]


@pytest.mark.parametrize("catch_up", ["off", "all"])
async def test_a_backfill_does_not_make_the_live_schedule_skip_its_ticks(
    pool: AsyncConnectionPool[Any], catch_up: Literal["off", "all"]
) -> None:
    """One replica, overlap ``skip``: while it coordinates a backfill, the schedule's own ticks
    wait for the backfill's run in the way instead of being recorded as overlap skips."""
    jobs = JobSchedulerService(pool, max_connections=2)
    scheduler = Scheduler(jobs=jobs)
    running = 0
    overlapped = 0

    async def sync(tick: Tick) -> None:
        nonlocal running, overlapped
        running += 1
        overlapped += running > 1
        try:
            await asyncio.sleep(0.3)
        finally:
            running -= 1

    scheduler.add_interval("sync", 1_000, sync, catch_up=catch_up, lease_ms=2_000)
    store = PostgresScheduleStore(pool)
    admin = ScheduleAdmin(store)
    async with ScheduleControl(scheduler, store, poll_interval_ms=100), scheduler:
        await asyncio.sleep(1.5)
        now = datetime.now(UTC).replace(microsecond=0)
        action = await admin.backfill(
            "sync", now - timedelta(seconds=40), now - timedelta(seconds=29), actor="ops"
        )
        started = datetime.now(UTC)

        async def finished() -> bool:
            return (await admin.action(action.id)).finished_at is not None

        await _until(finished, timeout=30.0)
        ended = datetime.now(UTC)

        async def caught_up() -> bool:
            return await scheduler.missed_ticks("sync", started, ended) == []

        await _settled(caught_up, within=2.0)  # a live tick that waited for the last run starts
        final = await admin.action(action.id)
        missed = await scheduler.missed_ticks("sync", started, ended)
    assert final.outcome == "SUCCESS", final
    assert missed == [], f"live ticks during the backfill never ran: {missed}"
    assert overlapped == 0, "a live tick ran beside a backfill run (overlap is skip)"


async def test_history_closes_the_attempt_a_takeover_superseded(
    pool: AsyncConnectionPool[Any],
) -> None:
    """A replica died mid-tick (its lease and its RUNNING history row stay); a live replica's
    catch-up takes the tick over under a new fencing token. History then shows the dead attempt
    closed as abandoned, not RUNNING forever."""
    from sdcore.job_scheduler import JobAcquireOptions
    from sdcore.scheduling._control import Replica, RunStart

    jobs = JobSchedulerService(pool, max_connections=2)
    store = PostgresScheduleStore(pool)
    now = datetime.now(UTC)
    if now.second >= 45:
        # The taken-over tick must stay the latest one until catch-up runs: start clear of the
        # minute boundary, after which catch-up="latest" would pick the next minute instead.
        await asyncio.sleep(61 - now.second - now.microsecond / 1e6)
        now = datetime.now(UTC)
    instant = now.replace(second=0, microsecond=0)
    run_key = instant.strftime("%Y-%m-%dT%H:%M:%SZ")
    dead = await jobs.acquire(JobAcquireOptions(code="report", run_key=run_key, lease_ms=500))
    assert dead.acquired
    dead_replica = Replica(replica_id="00000000-0000-0000-0000-000000000001", host="gone", pid=1)
    await store.run_started(
        RunStart(
            schedule="report",
            run_key=run_key,
            source="tick",
            scheduled_at=instant,
            attempt=1,
            fencing_token=dead.fencing_token,
            replica=dead_replica,
        )
    )
    await asyncio.sleep(0.8)  # the dead replica's lease expires
    scheduler = Scheduler(jobs=jobs)
    ran: list[int | None] = []

    async def report(tick: Tick) -> None:
        ran.append(None if tick.lease is None else tick.lease.fencing_token)

    scheduler.add_interval("report", 60_000, report, catch_up="latest", lease_ms=2_000)
    admin = ScheduleAdmin(store)
    async with ScheduleControl(scheduler, store, poll_interval_ms=100), scheduler:

        async def taken_over() -> bool:
            runs = await admin.history("report")
            return any(r.status == "SUCCESS" and r.run_key == run_key for r in runs)

        await _until(taken_over)
        runs = {r.fencing_token: r for r in await admin.history("report") if r.run_key == run_key}
    assert ran
    assert ran[0] is not None
    assert ran[0] > dead.fencing_token
    old = runs[dead.fencing_token]
    assert old.status == "FAIL", old
    assert old.finished_at is not None
    assert old.error == f"abandoned: the tick was taken over (fencing token {ran[0]})"
    assert runs[ran[0]].status == "SUCCESS"


async def test_a_pause_reaches_a_replica_whose_application_pool_is_exhausted(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    """The application holds every connection of ``runtime.pool`` (the load an operator pauses):
    the replica's control plane still reads the pause, on connections of its own."""
    from psycopg_pool import PoolTimeout

    runtime = Runtime(database_url=pg_dsn, pool=PoolSettings(max_size=4))
    runtime.scheduler.add_interval("export", 250, lambda tick: None, overlap="allow")
    admin = ScheduleAdmin(PostgresScheduleStore(pool))  # the operator's own connections
    async with runtime:
        held = []
        try:
            while True:
                try:
                    held.append(await runtime.pool.getconn(timeout=0.5))
                except PoolTimeout:
                    break
            assert held, "the application pool had no connection to take"
            await admin.pause("export", actor="ops", reason="pool saturated")

            async def applied() -> bool:
                return runtime.control.paused("export")

            await _until(applied, timeout=8.0)
        finally:
            for conn in held:
                await runtime.pool.putconn(conn)


async def test_a_tick_due_on_a_stale_view_waits_for_the_reread_and_then_runs(
    pool: AsyncConnectionPool[Any],
) -> None:
    """A replica whose paused state is older than the propagation bound starts the due tick
    only after re-reading it (here: not paused, so it runs; nothing is skipped or lost)."""
    import time

    jobs = JobSchedulerService(pool, max_connections=2)
    scheduler = Scheduler(jobs=jobs)
    ran: list[str | None] = []
    scheduler.add_interval("beat", 200, lambda tick: ran.append(tick.run_key))
    store = _PollClock(pool)
    store.polled = asyncio.Event()
    control = ScheduleControl(scheduler, store, poll_interval_ms=60_000, listen=False)
    async with control, scheduler:
        await asyncio.sleep(0.5)
        store.polled.clear()
        control._fresh_at = time.monotonic() - 120.0  # as after a long SIGSTOP
        began = datetime.now(UTC)
        await asyncio.wait_for(store.polled.wait(), 10)  # the gate asked for a poll
        await asyncio.sleep(1.0)
        missed = await scheduler.missed_ticks("beat", began, began + timedelta(seconds=0.8))
    assert missed == [], missed


async def test_ticks_behind_a_completion_stuck_on_the_database_follow_catch_up(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    """Overlap ``skip`` (the default), ``catch_up="all"``: a run whose completion waits on the
    database (here a row lock; in production an outage or a stalled synchronous standby) is not
    an overlap. The ticks that fall meanwhile are not recorded as overlap skips, and catch-up
    runs them once the database answers."""
    jobs = JobSchedulerService(pool, max_connections=2)
    scheduler = Scheduler(jobs=jobs)
    locker = await psycopg.AsyncConnection.connect(pg_dsn)
    stuck: list[str] = []

    async def beat(tick: Tick) -> None:
        if not stuck:
            assert tick.run_key is not None
            stuck.append(tick.run_key)
            # The completion of this tick (an UPDATE of its row) now waits for this lock.
            await locker.execute(
                "SELECT 1 FROM job_scheduler WHERE code = 'beat' AND run_key = %s FOR UPDATE",
                (tick.run_key,),
            )

    scheduler.add_interval("beat", 1_000, beat, catch_up="all", lease_ms=3_000)
    try:
        async with scheduler:

            async def locked() -> bool:
                return bool(stuck)

            await _until(locked)
            began = datetime.now(UTC)
            await asyncio.sleep(2.2)  # one or two ticks fall while the completion waits
            ended = datetime.now(UTC)
            await locker.rollback()

            async def caught_up() -> bool:
                return await scheduler.missed_ticks("beat", began, ended) == []

            await _settled(caught_up, within=7.0)  # the sweep (every 3 s) runs what was missed
            missed = await scheduler.missed_ticks("beat", began, ended)
    finally:
        await locker.close()
    assert missed == [], f"ticks lost behind a stuck completion: {missed}"


_SLEEPER = """
import asyncio, json, sys
from psycopg_pool import AsyncConnectionPool
from sdcore.job_scheduler import JobSchedulerService
from sdcore.scheduling import PostgresScheduleStore, ScheduleControl, Scheduler

async def main():
    pool = AsyncConnectionPool(
        sys.argv[1], min_size=1, max_size=6, kwargs={"autocommit": True}, open=False
    )
    await pool.open(wait=True)
    scheduler = Scheduler(jobs=JobSchedulerService(pool, max_connections=2))

    def invoices(tick):
        with open(sys.argv[2], "a") as out:
            out.write(json.dumps([tick.run_key, tick.attempt]) + "\\n")
        if tick.attempt == 1:
            raise RuntimeError("wrong amounts")

    scheduler.add_interval(
        "invoices", 10_000, invoices, retries=2, retry_backoff_ms=2_000, catch_up="all"
    )
    control = ScheduleControl(scheduler, PostgresScheduleStore(pool), poll_interval_ms=500)
    async with control, scheduler:
        await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_a_replica_suspended_during_a_backoff_rereads_the_pause_before_the_retry(
    pool: AsyncConnectionPool[Any], pg_dsn: str, tmp_path: Any
) -> None:
    """A real replica process is SIGSTOPped during a failed tick's retry backoff and the
    operator pauses meanwhile: woken after the backoff, it must read the pause again before the
    retry, not start it on the view it held before it slept. Resume then runs the retry."""
    import json
    import os
    import signal
    import sys

    script = tmp_path / "sleeper.py"
    script.write_text(_SLEEPER)
    out = tmp_path / "attempts.jsonl"

    def attempts() -> list[tuple[str, int]]:
        if not out.exists():
            return []
        return [tuple(json.loads(line)) for line in out.read_text().splitlines()]

    child = await asyncio.create_subprocess_exec(sys.executable, str(script), pg_dsn, str(out))
    admin = ScheduleAdmin(PostgresScheduleStore(pool))
    try:

        async def failed_once() -> bool:
            return bool(attempts())

        await _until(failed_once, timeout=60.0)
        await asyncio.sleep(1.0)  # inside the 2 s backoff
        os.kill(child.pid, signal.SIGSTOP)
        try:
            await admin.pause("invoices", actor="ops", reason="wrong amounts")
            await asyncio.sleep(5.0)  # the backoff ends while the replica sleeps
        finally:
            os.kill(child.pid, signal.SIGCONT)
        await asyncio.sleep(3.0)
        key = attempts()[0][0]
        assert [n for k, n in attempts() if k == key] == [1], "a retry started while paused"
        await admin.resume("invoices", actor="ops")

        async def retried() -> bool:
            return any(k == key and n == 2 for k, n in attempts())

        await _until(retried, timeout=30.0)
    finally:
        child.kill()
        await child.wait()


async def test_a_backfill_reports_its_progress_while_its_ticks_run(
    pool: AsyncConnectionPool[Any],
) -> None:
    """``backfill --wait`` follows the action's progress: it moves while the ticks run, not
    only once all of them have ended."""
    scheduler = Scheduler(jobs=JobSchedulerService(pool, max_connections=2))

    @scheduler.handler("digest")
    async def digest(tick: Tick, args: dict[str, Any]) -> None:
        await asyncio.sleep(0.6)

    store = PostgresScheduleStore(pool)
    admin = ScheduleAdmin(store)
    seen: set[int] = set()
    async with ScheduleControl(scheduler, store, poll_interval_ms=100), scheduler:
        await admin.create("digest", handler="digest", every_ms=60_000, actor="ops")
        now = datetime.now(UTC).replace(second=0, microsecond=0)
        action = await admin.backfill(
            "digest", now - timedelta(minutes=10), now - timedelta(minutes=1), actor="ops"
        )
        assert action.params["ticks"] == 10

        async def finished() -> bool:
            current = await admin.action(action.id)
            if current.progress is not None and current.finished_at is None:
                seen.add(int(current.progress["succeeded"]))
            return current.finished_at is not None

        await _until(finished, timeout=60.0)
        final = await admin.action(action.id)
    assert final.outcome == "SUCCESS", final
    assert final.progress is not None
    assert final.progress["succeeded"] == 10
    assert any(0 < n < 10 for n in seen), f"progress seen while running: {sorted(seen)}"


_SUSPENDED_REPLICA = """
import asyncio, json, os, sys, time
from psycopg_pool import AsyncConnectionPool
from sdcore.job_scheduler import JobSchedulerService
from sdcore.scheduling import PostgresScheduleStore, ScheduleControl, Scheduler
from sdcore.postgres import PoolSettings

async def main():
    pool = AsyncConnectionPool(
        sys.argv[1], min_size=1, max_size=6, kwargs={"autocommit": True}, open=False
    )
    await pool.open(wait=True)
    scheduler = Scheduler(jobs=JobSchedulerService(pool, max_connections=2))

    def report(tick):  # a thread: nothing cancels it when the lease is lost
        with open(sys.argv[2], "a") as out:
            out.write(json.dumps([os.getpid(), tick.run_key, tick.lease.fencing_token]) + "\\n")
        time.sleep(3.0)  # long enough for the test to stop this process mid-run, even when busy

    scheduler.add_interval("report", 20_000, report, catch_up="latest", lease_ms=2_000)
    async with ScheduleControl(scheduler, PostgresScheduleStore(pool), poll_interval_ms=200):
        async with scheduler:
            await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_a_suspended_replica_s_late_return_keeps_its_run_abandoned(
    pool: AsyncConnectionPool[Any], pg_dsn: str, tmp_path: Any
) -> None:
    """Two replica processes; the one running a tick is SIGSTOPped past its lease, the other
    takes the tick over, then the first wakes and its handler returns. The history shows one
    SUCCESS for the tick, and the superseded run as abandoned."""
    import json
    import os
    import signal
    import sys

    script = tmp_path / "replica.py"
    script.write_text(_SUSPENDED_REPLICA)
    out = tmp_path / "runs.jsonl"

    def runs() -> list[list[Any]]:
        if not out.exists():
            return []
        return [json.loads(line) for line in out.read_text().splitlines()]

    children = [
        await asyncio.create_subprocess_exec(sys.executable, str(script), pg_dsn, str(out))
        for _ in range(2)
    ]
    admin = ScheduleAdmin(PostgresScheduleStore(pool))
    try:

        async def started() -> bool:
            return bool(runs())

        await _until(started, timeout=60.0)
        sleeper, run_key, _ = runs()[0]
        os.kill(sleeper, signal.SIGSTOP)
        try:

            async def taken_over() -> bool:
                return any(pid != sleeper and key == run_key for pid, key, _ in runs())

            await _until(taken_over, timeout=30.0)
            await asyncio.sleep(1.5)  # the takeover's run ends
        finally:
            os.kill(sleeper, signal.SIGCONT)
        await asyncio.sleep(4.5)  # the woken handler returns; its completion is refused
        history = [r for r in await admin.history("report") if r.run_key == run_key]
    finally:
        for child in children:
            child.kill()
            await child.wait()
    statuses = sorted((r.pid, r.status) for r in history)
    assert [s for _, s in statuses].count("SUCCESS") == 1, statuses
    superseded = [r for r in history if r.pid == sleeper]
    assert [r.status for r in superseded] == ["FAIL"]
    assert (superseded[0].error or "").startswith("abandoned"), superseded[0].error


async def test_a_tick_whose_acquire_waited_through_the_pause_is_given_back(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    """A tick admitted before the pause whose acquire waits on the database (a table lock here;
    a slow or failing-over database, a batch's lead-key deferral in production) while this
    replica applies the pause: it must not start once the lease is won. It is given back,
    reported by ``missed_ticks``, and run by the resume's catch-up."""
    jobs = JobSchedulerService(pool, max_connections=2)
    scheduler = Scheduler(jobs=jobs)
    runs: list[tuple[str | None, bool]] = []
    control: ScheduleControl | None = None

    async def beat(tick: Tick) -> None:
        assert control is not None
        runs.append((tick.run_key, control.paused("beat")))

    scheduler.add_interval("beat", 1_000, beat, catch_up="all")
    store = PostgresScheduleStore(pool)
    admin = ScheduleAdmin(store)
    control = ScheduleControl(scheduler, store, poll_interval_ms=100)
    locker = await psycopg.AsyncConnection.connect(pg_dsn)
    try:
        # Every tick since the start: the one whose acquire waits may have been admitted
        # before the lock was granted (under load its instant is then before the lock).
        began = datetime.now(UTC)
        async with control, scheduler:
            await asyncio.sleep(1.5)
            await locker.execute("LOCK TABLE job_scheduler IN SHARE ROW EXCLUSIVE MODE")

            async def acquire_waits() -> bool:
                # A tick was admitted and its acquire waits on the lock (under load the next
                # fire may come a while later: pausing before it would skip it, not test this).
                async with pool.connection() as conn:
                    # This test's database: only the tick's statements touch job_scheduler.
                    cur = await conn.execute(
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                    )
                    row = await cur.fetchone()
                return row is not None and row[0] > 0

            await _until(acquire_waits)
            await admin.pause("beat", actor="ops")

            async def held() -> bool:
                return control.paused("beat")

            await _until(held)
            await asyncio.sleep(0.3)
            await locker.rollback()
            given: list[MissedTick] = []

            async def given_back() -> bool:
                # The acquire answers once the lock is gone; the give-back follows it (under
                # load, a second or more later).
                # Ticks the pause skipped are listed too, never given back.
                missed = await scheduler.missed_ticks("beat", began, datetime.now(UTC))
                given[:] = [m for m in missed if m.given_back == "paused"]
                return bool(given)

            await _until(given_back)
            during = [r for r in runs if r[1]]
            assert during == [], f"started on a replica that held the pause: {during}"
            await admin.resume("beat", actor="ops")

            async def caught_up() -> bool:
                return any(k == given[0].run_key for k, _ in runs)

            await _until(caught_up)
    finally:
        await locker.close()


async def test_a_live_tick_deferred_behind_a_backfill_and_then_paused_is_caught_up(
    pool: AsyncConnectionPool[Any],
) -> None:
    """A live tick waits for a long backfill run; the operator pauses before that run ends, so
    the live tick is skipped by the pause although its instant is before it. With
    ``catch_up="all"`` the resume's catch-up runs it, as any tick the pause skipped."""
    jobs = JobSchedulerService(pool, max_connections=2)
    scheduler = Scheduler(jobs=jobs)
    ran: list[str | None] = []
    now = datetime.now(UTC).replace(microsecond=0)
    backfilled = (now - timedelta(seconds=60)).strftime("%Y-%m-%dT%H:%M:%SZ")

    async def sync(tick: Tick) -> None:
        ran.append(tick.run_key)
        if tick.run_key == backfilled:
            await asyncio.sleep(3.0)

    scheduler.add_interval("sync", 1_000, sync, catch_up="all", lease_ms=10_000)
    store = PostgresScheduleStore(pool)
    admin = ScheduleAdmin(store)
    control = ScheduleControl(scheduler, store, poll_interval_ms=100)
    async with control, scheduler:
        await admin.backfill(
            "sync", now - timedelta(seconds=60), now - timedelta(seconds=60), actor="ops"
        )

        async def deferred() -> bool:
            return bool(scheduler._sup._deferred)

        await _until(deferred)
        waiting = [_run_key(due) for due in scheduler._sup._deferred.values()]
        await admin.pause("sync", actor="ops")

        async def held() -> bool:
            return control.paused("sync")

        await _until(held)

        async def backfill_ended() -> bool:
            return not scheduler._sup._background

        await _until(backfill_ended)
        await asyncio.sleep(0.5)
        await admin.resume("sync", actor="ops")

        async def caught_up() -> bool:
            return set(waiting) <= set(ran)

        await _until(caught_up)


def _run_key(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")
