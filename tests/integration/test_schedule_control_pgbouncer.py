"""The control plane's poll-only mode through a real PgBouncer in transaction pooling: pause,
resume and trigger reach two replicas whose store pools go through PgBouncer (psycopg prepares
statements after five runs; writes take a transaction-scoped advisory lock)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

from sdcore.job_scheduler import JobSchedulerService
from sdcore.scheduling import (
    PostgresScheduleStore,
    ScheduleAdmin,
    ScheduleControl,
    Scheduler,
    Tick,
)
from tests.integration.test_outbox_pgbouncer import _pgbouncer, _via

pytestmark = pytest.mark.slow


async def _pool(dsn: str) -> AsyncConnectionPool[Any]:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn, min_size=1, max_size=3, kwargs={"autocommit": True}, open=False
    )
    await pool.open(wait=True, timeout=20)
    return pool


async def _until(predicate: Any, timeout: float = 10.0) -> float:
    loop = asyncio.get_running_loop()
    began = loop.time()
    while not predicate():
        assert loop.time() - began < timeout, "timed out"
        await asyncio.sleep(0.01)
    return loop.time() - began


async def test_poll_only_through_transaction_pooling(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sdcore.scheduling.control")
    direct = await _pool(pg_dsn)
    jobs = JobSchedulerService(direct, max_connections=1)
    await jobs.ensure_schema()
    await PostgresScheduleStore(direct).ensure_schema()
    runs: list[str] = []
    with _pgbouncer(pg_dsn, "transaction", 2) as port:
        bounced = [await _pool(_via(port, pg_dsn)) for _ in range(3)]
        controls, schedulers = [], []
        try:
            for pool in bounced[:2]:
                scheduler = Scheduler(jobs=jobs)

                async def work(tick: Tick) -> None:
                    assert tick.run_key is not None
                    runs.append(tick.run_key)

                scheduler.add_interval("nightly", 3_600_000, work)
                control = ScheduleControl(
                    scheduler,
                    PostgresScheduleStore(pool, transaction_pooling=True),
                    listen=False,
                    poll_interval_ms=200,
                )
                await control.start()
                await scheduler.start_all()
                controls.append(control)
                schedulers.append(scheduler)
            admin = ScheduleAdmin(PostgresScheduleStore(bounced[2], transaction_pooling=True))
            delays = []
            for _ in range(4):  # past psycopg's prepare threshold on every connection
                await admin.pause("nightly", actor="ops")
                delays.append(await _until(lambda: all(c.paused("nightly") for c in controls)))
                await admin.resume("nightly", actor="ops")
                delays.append(await _until(lambda: not any(c.paused("nightly") for c in controls)))
            action = await admin.trigger("nightly", actor="ops")
            # The hourly tick itself may fire mid-test: count triggered runs only.

            def triggered() -> list[str]:
                return [k for k in runs if k.startswith("trigger:")]

            await _until(lambda: triggered() == [f"trigger:{action.id}"])
            await asyncio.sleep(0.6)
            assert triggered() == [f"trigger:{action.id}"]
            assert max(delays) < 2.0
            assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
        finally:
            for control, scheduler in zip(controls, schedulers, strict=False):
                await control.aclose()
                await scheduler.aclose()
            for pool in bounced:
                await pool.close()
    await jobs.close()
    await direct.close()
