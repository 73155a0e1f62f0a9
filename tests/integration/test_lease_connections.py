"""DB-01 and DB-10: lease connections killed mid-run, and no transaction held across the work."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from sdcore.job_scheduler import JobExecutionLease, JobSchedulerService
from sdcore.postgres import PoolSettings


async def _kill_lease_backends(dsn: str, application_name: str) -> int:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
        cur = await admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name = %s AND pid <> pg_backend_pid()"
            " AND datname = current_database()",  # never another test run's sessions
            (application_name,),
        )
        row = await cur.fetchone()
    return int(row[0]) if row else 0


async def test_heartbeat_connections_killed_mid_run_cause_no_false_loss(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    kills = 0
    caplog.set_level("WARNING", logger="sdcore.job_scheduler")
    async with JobSchedulerService.connect(
        pg_dsn, pool=PoolSettings(max_size=4, application_name="lease-hb-test")
    ) as jobs:
        await jobs.ensure_schema()

        async def work(lease: JobExecutionLease) -> str:
            nonlocal kills
            for _ in range(6):
                await asyncio.sleep(0.3)
                kills += await _kill_lease_backends(pg_dsn, "lease-hb-test")
                assert lease.is_held
            return "finished"

        outcome = await jobs.run_exclusive(
            {"code": "db01", "run_key": "r", "lease_ms": 3000, "heartbeat_ms": 200}, work
        )
        assert (outcome.acquired, outcome.result) == (True, "finished")
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            cur = await conn.execute("SELECT status, fencing_token FROM job_scheduler")
            assert await cur.fetchall() == [("SUCCESS", 1)]
    assert kills >= 3
    # Each broken connection was replaced and the beat retried at once. Only a beat that was on
    # the wire at the instant of a kill fails (a retry warning, never a loss): fewer than the
    # kills.
    errors = [r for r in caplog.records if getattr(r, "action", None) == "heartbeat_error"]
    assert len(errors) < kills, [r.getMessage() for r in errors]


async def test_no_transaction_is_held_across_the_work(pg_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as admin:
        dbname = admin.info.dbname
        await admin.execute(
            f'ALTER DATABASE "{dbname}" SET idle_in_transaction_session_timeout = 1000'
        )
    async with JobSchedulerService.connect(pg_dsn) as jobs:
        await jobs.ensure_schema()

        async def work(lease: JobExecutionLease) -> str:
            await asyncio.sleep(2.5)
            return "done"

        outcome = await jobs.run_exclusive(
            {"code": "db10", "run_key": "r", "lease_ms": 10_000, "heartbeat_ms": 1000}, work
        )
    assert outcome.result == "done"
