"""``OutboxAdmin``: list, retry and the table check on real PostgreSQL; validation before SQL."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import errors as pg_errors

from sdcore.job_scheduler import JobSchedulerService
from sdcore.outbox import (
    InvalidOutboxRequestError,
    Outbox,
    OutboxAdmin,
    OutboxDatabaseError,
    OutboxRow,
    OutboxStatus,
)


async def _seeded(dsn: str, outbox: Outbox) -> psycopg.AsyncConnection[Any]:
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    await outbox.ensure_schema(conn)
    async with conn.transaction():
        for key in ("a", "b", "c"):
            await outbox.enqueue_once(
                conn, idempotency_key=key, queue="mail", name="send", payload={"k": key}
            )
    await conn.execute(
        "UPDATE outbox SET status = 'DEAD', attempts = 10, last_error = 'boom'"
        " WHERE idempotency_key = 'b'"
    )
    await conn.execute(
        "UPDATE outbox SET status = 'PUBLISHED', published_at = now() WHERE idempotency_key = 'c'"
    )
    return conn


async def test_list_rows_filters_orders_and_types(pg_dsn: str) -> None:
    admin = OutboxAdmin()
    async with await _seeded(pg_dsn, admin.outbox) as conn:
        rows = await admin.list_rows(conn)
        assert [(r.idempotency_key, r.status) for r in rows] == [
            ("b", OutboxStatus.DEAD),
            ("a", OutboxStatus.PENDING),
        ]
        assert all(isinstance(r, OutboxRow) for r in rows)
        dead = rows[0]
        assert (dead.attempts, dead.last_error, dead.published_at) == (10, "boom", None)
        assert dead.job_id
        assert dead.job_id != rows[1].job_id
        everything = await admin.list_rows(conn, statuses=["published", "DEAD", "pending"])
        assert [r.idempotency_key for r in everything] == ["c", "b", "a"]
        assert everything[0].published_at is not None
        assert len(await admin.list_rows(conn, statuses=["PENDING", "DEAD"], limit=1)) == 1


async def test_retry_makes_a_dead_row_due_and_refuses_published_or_unknown(pg_dsn: str) -> None:
    admin = OutboxAdmin()
    async with await _seeded(pg_dsn, admin.outbox) as conn:
        rows = {r.idempotency_key: r for r in await admin.list_rows(conn, statuses=["DEAD"])}
        assert await admin.retry(conn, rows["b"].id) is True
        again = await admin.list_rows(conn, statuses=["DEAD", "PENDING"])
        assert {(r.idempotency_key, r.status, r.attempts) for r in again} == {
            ("a", OutboxStatus.PENDING, 0),
            ("b", OutboxStatus.PENDING, 0),
        }
        (published,) = await admin.list_rows(conn, statuses=["PUBLISHED"])
        assert await admin.retry(conn, published.id) is False
        assert await admin.retry(conn, 999_999) is False


async def test_check_table_names_a_missing_table_and_a_lease_table(pg_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        with pytest.raises(OutboxDatabaseError) as missing:
            await OutboxAdmin(Outbox(table="events_out")).check_table(conn)
        assert missing.value.sqlstate == pg_errors.UndefinedTable.sqlstate
        assert isinstance(missing.value.__cause__, pg_errors.UndefinedTable)
        async with JobSchedulerService.connect(pg_dsn, table="not_outbox") as jobs:
            await jobs.ensure_schema()
        with pytest.raises(OutboxDatabaseError) as other:
            await OutboxAdmin(Outbox(table="not_outbox")).check_table(conn)
        assert other.value.sqlstate == pg_errors.UndefinedColumn.sqlstate
        admin = OutboxAdmin(Outbox(table="events_out"))
        await admin.outbox.ensure_schema(conn)
        await admin.check_table(conn)
        assert await admin.list_rows(conn) == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": 10_001}, "limit"),
        ({"limit": True}, "limit"),
        ({"limit": "5"}, "limit"),
        ({"statuses": []}, "statuses"),
        ({"statuses": "DEAD"}, "statuses"),
        ({"statuses": ["DEAD", "GONE"]}, "status"),
        ({"statuses": [None]}, "status"),
        ({"statuses": 5}, "statuses"),
    ],
)
async def test_bad_list_requests_fail_before_sql(kwargs: dict[str, Any], field: str) -> None:
    class NoSql:
        def cursor(self, *args: object, **kw: object) -> None:
            raise AssertionError("SQL ran before validation")

    with pytest.raises(InvalidOutboxRequestError) as caught:
        await OutboxAdmin().list_rows(NoSql(), **kwargs)  # type: ignore[arg-type]
    assert caught.value.field == field
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("row_id", [0, -1, 2**63, True, "7", 1.5])
async def test_bad_retry_ids_fail_before_sql(row_id: Any) -> None:
    class NoSql:
        async def execute(self, *args: object, **kw: object) -> None:
            raise AssertionError("SQL ran before validation")

    with pytest.raises(InvalidOutboxRequestError, match="row id"):
        await OutboxAdmin().retry(NoSql(), row_id)  # type: ignore[arg-type]


def test_outbox_admin_needs_an_outbox() -> None:
    with pytest.raises(TypeError, match="must be an Outbox"):
        OutboxAdmin("outbox")  # type: ignore[arg-type]
