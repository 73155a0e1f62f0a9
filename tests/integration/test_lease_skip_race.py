"""A busy replica's skip record that commits while a free replica's acquire of the tick is in
flight never makes that acquire lose: the free replica takes the skip row over and runs the
tick. The interleaving is forced with a real second connection whose insert commits late."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from sdcore.job_scheduler import AttemptBudget, JobAcquireOptions, JobSchedulerService
from sdcore.job_scheduler._sql import identity_params
from sdcore.scheduling import Scheduler, format_run_key
from sdcore.scheduling._triggers import IntervalTrigger

BUDGET = AttemptBudget(max_attempts=1, backoff_ms=60_000)  # retries=0: one offer only


def _tick(run_key: str = "2026-12-04T18:58:35Z") -> JobAcquireOptions:
    return JobAcquireOptions(code="sync", run_key=run_key, lease_ms=60_000)


async def _blocked(conn: psycopg.AsyncConnection[Any], skipper: int) -> None:
    """Wait until some backend waits for the skipper's transaction (our acquire in flight)."""
    for _ in range(200):
        cur = await conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND %s = ANY(pg_blocking_pids(pid))",
            (skipper,),
        )
        row = await cur.fetchone()
        if row is not None and row[0]:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the acquire never waited for the skip record")


@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
async def test_a_skip_record_committing_during_an_acquire_loses_to_it(
    jobs: JobSchedulerService, pg_dsn: str, batch: bool
) -> None:
    tick = _tick()
    other = _tick("2026-12-04T18:58:36Z")  # a key nobody races for, in the same batch
    async with (
        await psycopg.AsyncConnection.connect(pg_dsn) as busy,
        await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as watch,
    ):
        # Replica B, busy with the previous tick, records this one as skipped; its commit is
        # slow (a synchronous standby, an fsync stall): the transaction stays open.
        skipped = await busy.execute(
            jobs._engine.tick_sql.record_skipped,
            (
                *identity_params(tick, "00000000-0000-4000-8000-000000000001"),
                json.dumps({"skipped": "overlap"}),
            ),
        )
        assert skipped.rowcount == 1
        skipper = busy.info.backend_pid
        # Replica A, free, fires the same tick: its snapshot has no row, so it inserts.
        acquiring: asyncio.Future[Any] = asyncio.ensure_future(
            jobs.acquire_attempts([(tick, BUDGET), (other, BUDGET)])
            if batch
            else jobs.acquire_attempt(tick, BUDGET)
        )
        await _blocked(watch, skipper)
        await busy.commit()
        answer = await asyncio.wait_for(acquiring, 30)
    results = answer if isinstance(answer, list) else [answer]
    got, attempt = results[0]
    assert (got.acquired, attempt) == (True, 1)  # A runs the tick, as its first attempt
    assert got.acquired
    if batch:
        assert results[1][0].acquired
    record = (await jobs.tick_records([tick.lock_key]))[tick.lock_key]
    assert (record.status.value, record.attempts, record.skipped) == ("RUNNING", 1, None)
    assert await jobs.complete(got.lease)


async def test_an_acquire_committing_first_keeps_the_tick_from_the_skip_record(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    # The other order: the free replica's acquire wins; the skip record writes nothing.
    tick = _tick()
    got, attempt = await jobs.acquire_attempt(tick, BUDGET)
    assert (got.acquired, attempt) == (True, 1)
    assert not await jobs.record_skipped(tick, "overlap")
    again, _ = await jobs.acquire_attempt(tick, BUDGET)
    assert not again.acquired
    record = (await jobs.tick_records([tick.lock_key]))[tick.lock_key]
    assert (record.status.value, record.attempts, record.skipped) == ("RUNNING", 1, None)


async def test_a_free_scheduler_runs_the_tick_a_busy_replica_is_recording_as_skipped(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    # Replica A is a real Scheduler with retries=0 and no catch-up: one offer per tick. Replica
    # B, busy with the previous tick, records the next one as skipped just before its instant,
    # and its commit is slow: A's acquire of that tick is in flight when the skip commits.
    every_ms = 2000
    ran: list[str] = []
    scheduler = Scheduler(jobs=jobs)
    scheduler.add_interval("sync", every_ms, lambda tick: ran.append(str(tick.run_key)))
    async with scheduler:
        now = datetime.now(UTC)
        instant = IntervalTrigger(every_ms).next_after(now + timedelta(seconds=1))
        assert instant is not None
        run_key = format_run_key(instant)
        tick = JobAcquireOptions(code="sync", run_key=run_key)
        await asyncio.sleep((instant - datetime.now(UTC)).total_seconds() - 0.4)
        async with (
            await psycopg.AsyncConnection.connect(pg_dsn) as busy,
            await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as watch,
        ):
            skip = (*identity_params(tick, str(uuid.uuid4())), json.dumps({"skipped": "overlap"}))
            assert (await busy.execute(jobs._engine.tick_sql.record_skipped, skip)).rowcount == 1
            await _blocked(watch, busy.info.backend_pid)  # A fired and waits on B's insert
            await busy.commit()
        for _ in range(100):
            if run_key in ran:
                break
            await asyncio.sleep(0.05)
    assert ran.count(run_key) == 1, ran
    record = (await jobs.tick_records([tick.lock_key]))[tick.lock_key]
    assert (record.status.value, record.attempts, record.skipped) == ("SUCCESS", 1, None)
