"""Schema creation: race-safe, idempotent, quoted names, no silent index loss for long names."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from sdcore.job_scheduler import JobSchedulerDatabaseError, JobSchedulerService
from sdcore.postgres import InvalidIdentifierError, PoolSettings, derived_name, schema_sql


def _indexes(dsn: str, table: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename = %s", (table,)
        ).fetchall()
    return {row[0] for row in rows}


async def test_ensure_schema_is_idempotent_and_concurrent_safe(pg_dsn: str) -> None:
    async with JobSchedulerService.connect(pg_dsn, pool=PoolSettings(max_size=8)) as jobs:
        await asyncio.gather(*(jobs.ensure_schema() for _ in range(8)))
        await jobs.ensure_schema()
    assert len(_indexes(pg_dsn, "job_scheduler")) == 5


async def test_two_long_table_names_with_a_common_prefix_both_get_their_indexes(
    pg_dsn: str,
) -> None:
    names = ["p" * 45 + "a", "p" * 45 + "b"]
    for name in names:
        async with JobSchedulerService.connect(pg_dsn, table=name) as jobs:
            await jobs.ensure_schema()
            assert (await jobs.acquire({"code": "c", "run_key": "r"})).acquired
    first, second = (_indexes(pg_dsn, name) for name in names)
    assert len(first) == len(second) == 5
    assert not first & second


def test_derived_names_fit_and_differ() -> None:
    long_a, long_b = "é" * 31 + "a", "é" * 31 + "b"
    for suffix in ("pkey", "lock_key_key", "status_modified_at_idx"):
        a, b = derived_name(long_a, suffix), derived_name(long_b, suffix)
        assert len(a.encode()) <= 63
        assert a != b
        assert a.endswith(suffix)
    assert derived_name("job_scheduler", "pkey") == "job_scheduler_pkey"


async def test_quoted_schema_and_table(pg_dsn: str) -> None:
    async with JobSchedulerService.connect(
        pg_dsn, table='we"ird; DROP TABLE x;--', schema="Tenant A"
    ) as jobs:
        await jobs.ensure_schema()
        got = await jobs.acquire({"code": "c", "run_key": "r"})
        assert got.acquired
        assert await jobs.complete(got.lease)


@pytest.mark.parametrize(
    ("table", "schema"),
    [("", None), ("t" * 64, None), ("a\x00b", None), ("ok", ""), (5, None)],
    ids=["empty", "too-long", "nul", "empty-schema", "int"],
)
def test_bad_identifiers_are_refused(table: object, schema: str | None) -> None:
    with pytest.raises(InvalidIdentifierError):
        schema_sql(table=table, schema=schema)  # type: ignore[arg-type]


async def test_missing_table_gives_a_hint(pg_dsn: str) -> None:
    async with JobSchedulerService.connect(pg_dsn, table="jobs_x") as jobs:
        with pytest.raises(JobSchedulerDatabaseError, match="sdcore db upgrade --table jobs_x"):
            await jobs.acquire({"code": "c", "run_key": "r"})


async def test_held_connections_are_returned_unchanged_to_an_application_pool(pg_dsn: str) -> None:
    from psycopg import AsyncConnection
    from psycopg.rows import dict_row
    from psycopg_pool import AsyncConnectionPool

    async def configure(conn: AsyncConnection[Any]) -> None:
        await conn.execute("SET default_transaction_isolation = 'serializable'")
        await conn.execute("SET TimeZone = 'Asia/Kolkata'")
        await conn.commit()

    pool: AsyncConnectionPool[AsyncConnection[Any]] = AsyncConnectionPool(
        pg_dsn,
        min_size=1,
        max_size=1,
        configure=configure,
        kwargs={"row_factory": dict_row},
        open=False,
    )
    async with pool:
        async with JobSchedulerService(pool, max_connections=1) as jobs:
            await jobs.ensure_schema()
            got = await jobs.acquire({"code": "c", "run_key": "r"})
            assert got.acquired
            assert got.row.created_at.utcoffset() == timedelta(0)
        async with pool.connection() as conn:
            cur = await conn.execute(
                "SELECT current_setting('default_transaction_isolation') AS iso,"
                " current_setting('TimeZone') AS tz, current_setting('synchronous_commit') AS sync"
            )
            row = await cur.fetchone()
            assert conn.autocommit is False
    assert row == {"iso": "serializable", "tz": "Asia/Kolkata", "sync": "on"}
