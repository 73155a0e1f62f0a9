"""``LeaseAdmin``: list, release and keyset prune on real PostgreSQL; validation before SQL."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest

from sdcore.job_scheduler import (
    InvalidAdminRequestError,
    JobNotFoundError,
    JobNotRunningError,
    JobSchedulerDatabaseError,
    JobSchedulerService,
    LeaseAdmin,
)

DAY = timedelta(days=1)


async def _seed(dsn: str, rows: int) -> None:
    """``rows`` SUCCESS + ``rows`` FAIL rows 10 days old, 5 INITIAL and 3 RUNNING old rows."""
    async with JobSchedulerService.connect(dsn) as jobs:
        await jobs.ensure_schema()
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            """
            INSERT INTO job_scheduler (lock_key, idempotency_key, code, type, run_key, status,
                                       owner_token, created_at, modified_at)
            SELECT 'k' || s || st, 'i' || s || st, 'bulk', 'SCHEDULE', 'r' || s || st, st,
                   gen_random_uuid(), now() - interval '10 days',
                   now() - interval '10 days' + s * interval '1 ms'
            FROM generate_series(1, %s) AS s, unnest(ARRAY['SUCCESS', 'FAIL']) AS st
            """,
            (rows,),
        )
        await conn.execute(
            """
            INSERT INTO job_scheduler (lock_key, idempotency_key, code, type, run_key, status,
                                       owner_token, created_at, modified_at)
            SELECT 'init' || s, 'ii' || s, 'init-' || s, 'INITIAL', NULL, 'SUCCESS',
                   gen_random_uuid(), now() - interval '10 days', now() - interval '10 days'
            FROM generate_series(1, 5) AS s
            UNION ALL
            SELECT 'run' || s, 'ir' || s, 'running', 'SCHEDULE', 'rr' || s, 'RUNNING',
                   gen_random_uuid(), now() - interval '10 days', now() - interval '10 days'
            FROM generate_series(1, 3) AS s
            """
        )


async def _count(conn: psycopg.AsyncConnection[Any], where: str = "TRUE") -> int:
    cur = await conn.execute(f"SELECT count(*) FROM job_scheduler WHERE {where}")
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def test_prune_in_keyset_batches_keeps_running_and_initial_rows(pg_dsn: str) -> None:
    await _seed(pg_dsn, 2_345)
    admin = LeaseAdmin()
    seen: list[int] = []
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        dry = await admin.prune(conn, older_than=DAY, batch_size=500, dry_run=True)
        assert (dry.matching, dry.deleted, dry.kept_initial, dry.batches) == (4_690, 0, 5, 0)
        assert await _count(conn) == 4_698
        report = await admin.prune(conn, older_than=DAY, batch_size=500, progress=seen.append)
        assert report.deleted == 4_690
        assert report.statuses == ("SUCCESS", "FAIL")
        # One keyset pass over both statuses: 4,690 rows in 9 full batches and one of 190.
        assert report.batches == 10
        assert seen == sorted(seen)
        steps = [b - a for a, b in zip([0, *seen], seen, strict=False)]
        assert max(steps) <= 500, steps
        assert seen[-1] == 4_690
        assert await _count(conn, "status = 'RUNNING'") == 3
        assert await _count(conn, "type = 'INITIAL'") == 5
        again = await admin.prune(conn, older_than=DAY, include_initial=True, statuses=["success"])
        assert (again.deleted, again.kept_initial) == (5, 0)
        assert await _count(conn) == 3


async def test_prune_spares_young_rows_and_a_row_taken_over_mid_prune(pg_dsn: str) -> None:
    await _seed(pg_dsn, 10)
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await conn.execute("UPDATE job_scheduler SET modified_at = now() WHERE lock_key = 'k1FAIL'")
        report = await LeaseAdmin().prune(conn, older_than=DAY, statuses=["FAIL"])
        assert report.deleted == 9
        assert await _count(conn, "lock_key = 'k1FAIL'") == 1


async def test_list_and_release(pg_dsn: str) -> None:
    await _seed(pg_dsn, 3)
    admin = LeaseAdmin()
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        running = await admin.list_runs(conn, status="running", limit=10)
        assert [r.code for r in running] == ["running"] * 3
        assert all(r.age >= timedelta(days=9) for r in running)
        assert not hasattr(running[0], "owner_token")
        released = await admin.release(conn, running[0].id.upper(), reason="stuck")
        assert (released.id, released.code) == (running[0].id, "running")
        with pytest.raises(JobNotRunningError, match="status FAIL"):
            await admin.release(conn, running[0].id)
        with pytest.raises(JobNotFoundError, match="no such job"):
            await admin.release(conn, "00000000-0000-0000-0000-000000000000")
        by_code = await admin.list_runs(conn, code="bulk", limit=2)
        assert len(by_code) == 2


async def test_a_missing_table_is_a_library_error_with_its_sqlstate(pg_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        with pytest.raises(JobSchedulerDatabaseError, match="does not exist") as caught:
            await LeaseAdmin(table="nope").list_runs(conn)
        assert caught.value.sqlstate == "42P01"
        # The caller's connection is still usable.
        assert await (await conn.execute("SELECT 1")).fetchone() == (1,)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda a: a.list_runs(None, limit=0), "limit"),
        (lambda a: a.list_runs(None, limit=True), "limit"),
        (lambda a: a.list_runs(None, status="DONE"), "status"),
        (lambda a: a.list_runs(None, code="a\x00b"), "code"),
        (lambda a: a.release(None, "not-a-uuid"), "job id"),
        (
            lambda a: a.release(None, "00000000-0000-0000-0000-000000000000", reason="x" * 1001),
            "reason",
        ),
        (lambda a: a.prune(None, older_than=timedelta(0)), "older_than"),
        (lambda a: a.prune(None, older_than=DAY, statuses=["RUNNING"]), "statuses"),
        (lambda a: a.prune(None, older_than=DAY, statuses="SUCCESS"), "statuses"),
        (lambda a: a.prune(None, older_than=DAY, statuses=[]), "statuses"),
        (lambda a: a.prune(None, older_than=DAY, batch_size=0), "batch_size"),
    ],
    ids=[
        "limit-0",
        "limit-bool",
        "status",
        "code-nul",
        "uuid",
        "reason",
        "age",
        "running",
        "str-statuses",
        "no-statuses",
        "batch",
    ],
)
async def test_bad_requests_fail_before_any_sql(call: Any, field: str) -> None:
    # ``None`` as the connection: any SQL would raise AttributeError, not the validation error.
    with pytest.raises(InvalidAdminRequestError) as caught:
        await call(LeaseAdmin())
    assert caught.value.field == field


def test_table_names_are_checked() -> None:
    with pytest.raises(ValueError, match="'%'"):
        LeaseAdmin(table="jobs%s")
