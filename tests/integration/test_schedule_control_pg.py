"""The control plane on PostgreSQL in one process: mixed code versions, sync-handler history with
errors, refusals that change nothing, the migration through ``sdcore db upgrade --schedules``."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

from sdcore.job_scheduler import JobSchedulerService
from sdcore.scheduling import (
    PostgresScheduleStore,
    ScheduleAdmin,
    ScheduleControl,
    ScheduleControlError,
    Scheduler,
    Tick,
)
from tests.integration._schedule_pg import schedule_pool

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    async with schedule_pool(pg_dsn, max_size=6) as pool:
        yield pool


async def _until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_mixed_versions_are_reported(pool: AsyncConnectionPool[Any]) -> None:
    jobs = JobSchedulerService(pool, max_connections=1)
    controls = []
    for every in (60_000, 120_000):
        scheduler = Scheduler(jobs=jobs)
        scheduler.add_interval("report", every, lambda tick: None)
        control = ScheduleControl(scheduler, PostgresScheduleStore(pool), listen=False)
        await control.start()
        controls.append(control)
    admin = ScheduleAdmin(PostgresScheduleStore(pool))
    state = {s.name: s for s in await admin.list_schedules()}["report"]
    assert state.versions == 2
    assert len(state.replicas) == 2
    for control in controls:
        await control.aclose()
    assert {s.name: s for s in await admin.list_schedules()}["report"].replicas == ()
    with pytest.raises(ScheduleControlError, match="no running replica declares"):
        await admin.pause("report", actor="ops")
    row = await admin.store.row("report")
    assert row is not None
    assert not row.paused


async def test_history_of_a_plain_function_with_its_error(pool: AsyncConnectionPool[Any]) -> None:
    jobs = JobSchedulerService(pool, max_connections=2)
    scheduler = Scheduler(jobs=jobs)
    calls: list[str | None] = []

    def flaky(tick: Tick) -> None:  # a plain function: runs in a worker thread
        calls.append(tick.run_key)
        raise RuntimeError("boom in a thread")

    scheduler.add_interval("flaky", 3_600_000, flaky)
    store = PostgresScheduleStore(pool)
    admin = ScheduleAdmin(store)
    async with ScheduleControl(scheduler, store, poll_interval_ms=100), scheduler:
        action = await admin.trigger("flaky", actor="ops")

        async def failed() -> bool:
            return (await admin.action(action.id)).outcome == "FAIL"

        await _until(failed)
    # The hourly tick itself may fire mid-test: look at triggered runs only.
    runs = [r for r in await admin.history("flaky") if r.source == "trigger"]
    assert [r.run_key for r in runs] == [f"trigger:{action.id}"]
    assert runs[0].status == "FAIL"
    assert "boom in a thread" in (runs[0].error or "")
    assert runs[0].source == "trigger"
    assert runs[0].pid == os.getpid()
    assert runs[0].fencing_token == 1
    assert [c for c in calls if c and c.startswith("trigger:")] == [f"trigger:{action.id}"]


async def test_refusals_are_validated_before_sql(pool: AsyncConnectionPool[Any]) -> None:
    admin = ScheduleAdmin(PostgresScheduleStore(pool))
    with pytest.raises(ScheduleControlError, match="no such schedule"):
        await admin.trigger("missing", actor="ops")
    with pytest.raises(ScheduleControlError, match="actor"):
        await admin.pause("missing", actor="x" * 201)
    now = datetime.now(UTC)
    with pytest.raises(ScheduleControlError, match="concurrency"):
        await admin.backfill("missing", now - timedelta(hours=1), now, actor="o", concurrency=0)
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) FROM sdcore_schedules_actions")
        assert await cur.fetchone() == (0,)


def test_db_upgrade_schedules(pg_dsn: str) -> None:
    def sdcore(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sdcore.cli", *args],
            cwd=ROOT,
            env={**os.environ, "DATABASE_URL": pg_dsn},
            capture_output=True,
            text=True,
            check=False,
        )

    missing = sdcore("schedules", "list")
    assert missing.returncode == 1
    assert "sdcore db upgrade --schedules" in missing.stderr
    done = sdcore("db", "upgrade", "--schedules")
    assert done.returncode == 0, done.stderr
    assert "applied schedules migration 0001_initial" in done.stdout
    assert "applied schedules migration 0002_action_requests" in done.stdout
    again = sdcore("db", "upgrade", "--schedules")
    assert "applied schedules" not in again.stdout
    listed = sdcore("schedules", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout == ""


async def test_runtime_without_the_tables_runs_without_the_control_plane(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from sdcore import Runtime

    async with JobSchedulerService.connect(pg_dsn) as jobs:
        await jobs.ensure_schema()  # what `sdcore db upgrade` without --schedules creates
    runtime = Runtime(database_url=pg_dsn, ensure_schema=False)
    with caplog.at_level(logging.WARNING, logger="sdcore.runtime"):
        async with runtime:
            assert runtime.started
            assert runtime.scheduler.running
            assert not runtime.control.running
    assert any("control plane is off" in r.getMessage() for r in caplog.records)


async def test_replicas_count_each_other_as_declarers_of_code_and_stored_schedules(
    pool: AsyncConnectionPool[Any],
) -> None:
    # Each replica reads another's declarations once per digest and keeps them only if they
    # hash to that digest: on PostgreSQL, a replica's declarations (code and stored schedules)
    # must hash to the digest it records, or the others would never count it among the owners.
    # It counts the other for the schedules both run in the same version only.
    jobs = JobSchedulerService(pool, max_connections=1)
    controls = []
    try:
        for version in (1, 2):
            scheduler = Scheduler(jobs=jobs)
            scheduler.add_interval("report", 60_000, lambda tick: None)
            scheduler.add_interval("changed", 60_000 * version, lambda tick: None)
            scheduler.add_cron(f"only-v{version}", "0 * * * *", lambda tick: None)
            scheduler.handler("bill")(lambda tick, args: None)
            control = ScheduleControl(
                scheduler, PostgresScheduleStore(pool), listen=False, poll_interval_ms=50
            )
            await control.start()
            controls.append(control)
        await ScheduleAdmin(PostgresScheduleStore(pool)).create(
            "bill-acme", handler="bill", every_ms=60_000, actor="ops"
        )
        await _until(lambda: _true(all("bill-acme" in c._stored for c in controls)))
        await asyncio.sleep(0.2)  # the declarations of the stored schedule are written
        for control in [*controls, *controls]:  # each records its new digest, then reads
            await control._read_members()
        one, two = controls
        (seen_by_one,) = one._owners.members or ()
        (seen_by_two,) = two._owners.members or ()
        assert seen_by_one.names == seen_by_two.names == frozenset({"report", "bill-acme"})
    finally:
        for control in controls:
            await control.aclose()


async def _true(value: bool) -> bool:
    return value


async def test_without_the_digest_column_every_replica_asks(
    pool: AsyncConnectionPool[Any], caplog: pytest.LogCaptureFixture
) -> None:
    # Code deployed before `sdcore db upgrade --schedules` applied schedules/0005: the control
    # plane starts, warns once, and this replica asks for every tick (no view of the owners).
    async with pool.connection() as conn:
        await conn.execute("ALTER TABLE sdcore_schedules_replicas DROP COLUMN schedules_digest")
    jobs = JobSchedulerService(pool, max_connections=1)
    scheduler = Scheduler(jobs=jobs)
    scheduler.add_interval("report", 60_000, lambda tick: None)
    control = ScheduleControl(scheduler, PostgresScheduleStore(pool), listen=False)
    await control.start()
    try:
        await control._read_members()
        assert control._owners.members is None
        warned = [r for r in caplog.records if getattr(r, "action", None) == "owners_off"]
        assert len(warned) == 1
    finally:
        await control.aclose()
