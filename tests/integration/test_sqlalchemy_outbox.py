"""``sdcore.sqlalchemy.enqueue_once``: the outbox written in a SQLAlchemy session's transaction,
with the statements psycopg sends; and the deprecated ``Outbox.enqueue_once(session, …)``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, ClassVar

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool
from sqlalchemy import event
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from sdcore.outbox import (
    InvalidOutboxMessageError,
    Outbox,
    OutboxKeyConflictError,
    OutboxTransactionRequiredError,
)
from sdcore.outbox._model import job_id_v2
from sdcore.sqlalchemy import enqueue_once


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=4, open=False) as pool:
        await pool.open()
        await Outbox().ensure_schema(pool)
        yield pool


async def _rows(pool: AsyncConnectionPool[Any]) -> list[Any]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT idempotency_key FROM outbox ORDER BY id")
        return [r[0] for r in await cur.fetchall()]


def _sa_url(pg_dsn: str) -> URL:
    """A SQLAlchemy URL (psycopg driver) for the test database."""
    params = conninfo_to_dict(pg_dsn)
    return URL.create(
        "postgresql+psycopg",
        username=str(params.get("user", "")) or None,
        host=str(params.get("host", "")) or None,
        port=int(str(params["port"])) if "port" in params else None,
        database=str(params["dbname"]),
    )


def _message(key: str, **payload: Any) -> dict[str, Any]:
    return {"idempotency_key": key, "queue": "q", "name": "n", "payload": payload}


async def test_a_session_write_joins_the_session_transaction(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    outbox = Outbox()
    engine = create_async_engine(_sa_url(pg_dsn))
    try:
        async with AsyncSession(engine) as session:
            # The very first statement of the session: the trap is a raw connection taken now,
            # which would not be inside the session's transaction.
            assert await enqueue_once(outbox, session, **_message("rolled"))
            await session.rollback()
        async with AsyncSession(engine) as session:
            assert await enqueue_once(outbox, session, **_message("kept"))
            assert not await enqueue_once(outbox, session, **_message("kept"))
            with pytest.raises(OutboxKeyConflictError):
                await enqueue_once(outbox, session, **_message("kept", other=1))
            await session.commit()
        async with engine.connect() as connection:
            assert await enqueue_once(outbox, connection, **_message("conn"))
            await connection.commit()
    finally:
        await engine.dispose()
    assert await _rows(pool) == ["kept", "conn"]


async def test_sessions_get_the_same_conflict_rules_and_job_id(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    engine = create_async_engine(_sa_url(pg_dsn))
    outbox = Outbox()
    try:
        async with AsyncSession(engine) as session, session.begin():
            assert await enqueue_once(outbox, session, **_message("k", a=1, b=2))
        async with AsyncSession(engine) as session, session.begin():
            assert not await enqueue_once(outbox, session, **_message("k", b=2, a=1))
            with pytest.raises(OutboxKeyConflictError):
                await enqueue_once(outbox, session, **_message("k", a=2))
    finally:
        await engine.dispose()
    assert await _rows(pool) == ["k"]
    # The id an outbox without a namespace derives from the database, schema and table.
    identity = f"{conninfo_to_dict(pg_dsn)['dbname']}.public.outbox"
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT job_id FROM outbox")
        assert await cur.fetchone() == (job_id_v2(identity, "k"),)


class _RecordingCursor(psycopg.AsyncCursor[Any]):
    """Notes the text of every statement a psycopg connection sends."""

    sent: ClassVar[list[str]] = []

    async def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        text = query.decode() if isinstance(query, bytes) else str(query)
        _RecordingCursor.sent.append(text)
        return await super().execute(query, params, **kwargs)


async def test_psycopg_and_sqlalchemy_send_the_same_statements(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    _RecordingCursor.sent = []
    async with await psycopg.AsyncConnection.connect(
        pg_dsn, cursor_factory=_RecordingCursor
    ) as conn:
        for _ in range(2):  # the second one is a no-op: the "existing" statement runs too
            async with conn.transaction():
                await Outbox(notify_interval_ms=0).enqueue_once(conn, **_message("pg", a=1))
    by_psycopg = [q for q in _RecordingCursor.sent if "outbox" in q]

    engine = create_async_engine(_sa_url(pg_dsn))
    by_sqlalchemy: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        by_sqlalchemy.append(statement)

    event.listen(engine.sync_engine, "before_cursor_execute", record)
    try:
        for _ in range(2):
            async with AsyncSession(engine) as session, session.begin():
                await enqueue_once(Outbox(notify_interval_ms=0), session, **_message("sa", a=1))
    finally:
        await engine.dispose()
    outbox = Outbox()
    assert by_psycopg == [
        outbox.sql.enqueue.decode(),
        outbox.sql.enqueue.decode(),
        outbox.sql.existing.decode(),
    ]
    assert [q for q in by_sqlalchemy if "outbox" in q] == by_psycopg
    assert await _rows(pool) == ["pg", "sa"]


async def test_an_autocommit_session_raises_unless_allowed(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    engine = create_async_engine(_sa_url(pg_dsn), isolation_level="AUTOCOMMIT")
    outbox = Outbox()
    try:
        async with AsyncSession(engine) as session:
            with pytest.raises(OutboxTransactionRequiredError, match="AsyncSession"):
                await enqueue_once(outbox, session, **_message("k"))
        async with engine.connect() as connection:
            with pytest.raises(OutboxTransactionRequiredError, match="AsyncConnection"):
                await enqueue_once(outbox, connection, **_message("k"))
            assert await enqueue_once(
                outbox, connection, **_message("opted-out"), allow_autocommit=True
            )
    finally:
        await engine.dispose()
    assert await _rows(pool) == ["opted-out"]


async def test_a_bad_message_or_argument_is_refused_before_any_sql(pg_dsn: str) -> None:
    engine = create_async_engine(_sa_url(pg_dsn))
    statements: list[str] = []
    event.listen(engine.sync_engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    try:
        async with AsyncSession(engine) as session:
            with pytest.raises(InvalidOutboxMessageError, match="idempotency_key"):
                await enqueue_once(Outbox(), session, **_message(""))
            with pytest.raises(TypeError, match=r"outbox must be an sdcore\.outbox\.Outbox"):
                await enqueue_once(object(), session, **_message("k"))  # type: ignore[arg-type]
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            with pytest.raises(TypeError, match="session must be a SQLAlchemy AsyncSession"):
                await enqueue_once(Outbox(), conn, **_message("k"))  # type: ignore[arg-type]
    finally:
        await engine.dispose()
    assert statements == []


async def test_outbox_enqueue_once_with_a_session_still_works_and_warns(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    engine = create_async_engine(_sa_url(pg_dsn))
    outbox = Outbox()
    try:
        async with AsyncSession(engine) as session:
            with pytest.warns(DeprecationWarning, match=r"use sdcore\.sqlalchemy\.enqueue_once"):
                assert await outbox.enqueue_once(session, **_message("old"))
            await session.commit()
    finally:
        await engine.dispose()
    assert await _rows(pool) == ["old"]
