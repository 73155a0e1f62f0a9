"""``transaction_pooling=True`` without a pooler: every statement pins its own settings.

The pool's ``configure`` callback leaves each session the way another client of a transaction
pooler could: ``synchronous_commit=off``, a short ``statement_timeout``, ``lock_timeout``,
SERIALIZABLE and a ``search_path`` without the lease table. An ``AFTER`` row trigger records what
each lease write ran with; the session itself must be left exactly as it was.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from sdcore.job_scheduler import JobSchedulerService
from sdcore.postgres import schema_sql

AUDIT = """\
CREATE TABLE public.audit (op text, sc text, st text, lt text, iso text, sp text);
CREATE FUNCTION public.audit_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.audit VALUES (TG_OP, current_setting('synchronous_commit'),
        current_setting('statement_timeout'), current_setting('lock_timeout'),
        current_setting('transaction_isolation'), current_setting('search_path'));
    RETURN NULL;
END $$;
CREATE TRIGGER audit AFTER INSERT OR UPDATE ON public.job_scheduler
    FOR EACH ROW EXECUTE FUNCTION public.audit_fn();
"""
POLLUTED = (
    ("synchronous_commit", "off"),
    ("statement_timeout", "987ms"),
    ("lock_timeout", "7ms"),
    ("default_transaction_isolation", "serializable"),
    ("search_path", "pg_catalog"),
)


async def _pollute(conn: psycopg.AsyncConnection[Any]) -> None:
    for name, value in POLLUTED:
        await conn.execute("SELECT set_config(%s, %s, false)", (name, value))


async def test_each_statement_carries_its_settings_and_leaves_the_session_alone(
    pg_dsn: str,
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(schema_sql().encode())
        conn.execute(AUDIT.encode())
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        pg_dsn,
        min_size=1,
        max_size=1,
        kwargs={"autocommit": True, "prepare_threshold": 0},  # prepare at once, unless told not to
        configure=_pollute,
        open=False,
    )
    async with pool:
        # One connection: the held one is then the one inspected afterwards.
        jobs = JobSchedulerService(
            pool, max_connections=1, transaction_pooling=True, statement_timeout_ms=4_321
        )
        async with jobs:
            for index in range(4):
                outcome = await jobs.run_exclusive(
                    {"code": "pinned", "run_key": f"r{index}"}, lambda lease: None
                )
                assert outcome.acquired
            assert set((await jobs.statuses(["pinned-none"])).values()) == set()
            await jobs.ensure_schema()  # migrations: an explicit transaction on a held connection
        async with pool.connection() as conn:
            cur = await conn.execute(
                "SELECT current_setting('synchronous_commit'),"
                " current_setting('statement_timeout'), current_setting('lock_timeout'),"
                " current_setting('default_transaction_isolation'),"
                " current_setting('search_path'),"
                " (SELECT count(*) FROM pg_prepared_statements"  # all but _pollute's own
                "  WHERE statement <> 'SELECT set_config($1, $2, false)')",
                prepare=False,
            )
            session = await cur.fetchone()
            assert conn.prepare_threshold == 0
    assert session == ("off", "987ms", "7ms", "serializable", "pg_catalog", 0)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT op, sc, st, lt, iso, sp, count(*) FROM public.audit GROUP BY 1, 2, 3, 4, 5, 6"
            " ORDER BY 1"
        ).fetchall()
    default_path = '"$user", public'
    assert rows == [
        ("INSERT", "on", "4321ms", "0", "read committed", default_path, 4),
        ("UPDATE", "on", "4321ms", "0", "read committed", default_path, 4),
    ]
