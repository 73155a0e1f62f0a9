"""``sdcore.sync.OutboxAdmin`` and ``sdcore.sync.ScheduleAdmin`` on real PostgreSQL: the async
admins' validation, statements, results and errors, from blocking code."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from sdcore.job_scheduler import JobSchedulerService
from sdcore.outbox import (
    InvalidOutboxRequestError,
    OutboxDatabaseError,
    OutboxRow,
    OutboxStatus,
)
from sdcore.postgres import PoolSettings
from sdcore.runtime import RuntimeStateError
from sdcore.scheduling import (
    ActionKind,
    PostgresScheduleStore,
    ScheduleControl,
    ScheduleControlError,
    Scheduler,
    Tick,
)
from sdcore.scheduling import ScheduleAdmin as AsyncScheduleAdmin
from sdcore.sync import Outbox, OutboxAdmin, ScheduleAdmin
from sdcore.sync._portal import Portal


def _seed(dsn: str, outbox: Outbox) -> None:
    with psycopg.connect(dsn) as conn:
        outbox.ensure_schema(conn)
        with conn.transaction():
            for key in ("a", "b", "c"):
                outbox.enqueue_once(
                    conn, idempotency_key=key, queue="mail", name="send", payload={"k": key}
                )
        conn.execute(
            "UPDATE outbox SET status = 'DEAD', attempts = 10, last_error = 'boom'"
            " WHERE idempotency_key = 'b'"
        )
        conn.execute(
            "UPDATE outbox SET status = 'PUBLISHED', published_at = now()"
            " WHERE idempotency_key = 'c'"
        )
        conn.commit()


def test_outbox_admin_lists_and_retries(pg_dsn: str) -> None:
    outbox = Outbox()
    _seed(pg_dsn, outbox)
    admin = OutboxAdmin(outbox)
    assert admin.outbox is outbox.outbox
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        admin.check_table(conn)
        rows = admin.list_rows(conn)
        assert [(r.idempotency_key, r.status) for r in rows] == [
            ("b", OutboxStatus.DEAD),
            ("a", OutboxStatus.PENDING),
        ]
        assert all(isinstance(r, OutboxRow) for r in rows)
        assert (rows[0].attempts, rows[0].last_error) == (10, "boom")
        everything = admin.list_rows(conn, statuses=["published", "DEAD", "pending"], limit=2)
        assert [r.idempotency_key for r in everything] == ["c", "b"]
        dead = rows[0].id
        assert admin.retry(conn, dead)
        (after,) = [r for r in admin.list_rows(conn) if r.id == dead]
        assert (after.status, after.attempts) == (OutboxStatus.PENDING, 0)
        assert not admin.retry(conn, everything[0].id)  # published
        assert not admin.retry(conn, 2**63 - 1)  # none


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda a, c: a.list_rows(c, statuses="DEAD"), "not one str"),
        (lambda a, c: a.list_rows(c, statuses=["GONE"]), "is not one of"),
        (lambda a, c: a.list_rows(c, statuses=[]), "at least one"),
        (lambda a, c: a.list_rows(c, limit=0), "limit"),
        (lambda a, c: a.retry(c, 0), "row id"),
        (lambda a, c: a.retry(c, True), "row id"),
    ],
    ids=["str", "unknown", "empty", "limit", "zero-id", "bool-id"],
)
def test_outbox_admin_refuses_bad_input_before_any_sql(pg_dsn: str, call: Any, match: str) -> None:
    # No table in this database: a request that reached the server would fail there instead.
    with (
        psycopg.connect(pg_dsn, autocommit=True) as conn,
        pytest.raises(InvalidOutboxRequestError, match=match),
    ):
        call(OutboxAdmin(), conn)


def test_outbox_admin_wraps_database_errors_and_refuses_other_connections(pg_dsn: str) -> None:
    admin = OutboxAdmin()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        with pytest.raises(OutboxDatabaseError) as caught:
            admin.check_table(conn)
        assert caught.value.sqlstate == "42P01"
        assert isinstance(caught.value.__cause__, psycopg.errors.UndefinedTable)
        with pytest.raises(OutboxDatabaseError):
            admin.retry(conn, 1)
    with pytest.raises(TypeError, match="psycopg Connection"):
        admin.list_rows(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Outbox"):
        OutboxAdmin("outbox")


@contextlib.contextmanager
def _replica(dsn: str, calls: list[str]) -> Iterator[tuple[Portal, AsyncScheduleAdmin]]:
    """An async replica running one exclusive schedule, on a portal (a loop on its own thread),
    with an async admin over its pool."""
    portal = Portal(name="test-replica")
    portal.start()
    stack = contextlib.AsyncExitStack()

    async def start() -> AsyncScheduleAdmin:
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            dsn, min_size=1, max_size=6, kwargs={"autocommit": True}, open=False
        )
        await pool.open(wait=True)
        stack.push_async_callback(pool.close)
        jobs = JobSchedulerService(pool, max_connections=2)
        stack.push_async_callback(jobs.close)
        await jobs.ensure_schema()
        store = PostgresScheduleStore(pool)
        await store.ensure_schema()
        scheduler = Scheduler(jobs=jobs)

        def report(tick: Tick) -> None:  # a plain function, as blocking code writes them
            calls.append(tick.run_key or "")

        scheduler.add_interval("report", 3_600_000, report, exclusive=True)
        control = ScheduleControl(scheduler, store, poll_interval_ms=100)
        await stack.enter_async_context(control)
        await stack.enter_async_context(scheduler)
        return AsyncScheduleAdmin(store)

    try:
        admin = portal.call(start)
        yield portal, admin
    finally:
        portal.call(stack.aclose)
        portal.stop()


def _until(predicate: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_schedule_admin_pauses_resumes_and_triggers_a_running_replica(pg_dsn: str) -> None:
    calls: list[str] = []
    with _replica(pg_dsn, calls), ScheduleAdmin.connect(pg_dsn) as admin:
        paused = admin.pause("report", actor="ops", reason="maintenance")
        assert (paused.action, paused.actor, paused.reason) == (
            ActionKind.PAUSE,
            "ops",
            "maintenance",
        )
        with pytest.raises(ScheduleControlError, match="already paused"):
            admin.pause("report", actor="ops")
        (state,) = [s for s in admin.list_schedules() if s.name == "report"]
        assert state.paused
        resumed = admin.resume("report", actor="ops")
        assert resumed.action is ActionKind.RESUME
        with pytest.raises(ScheduleControlError, match="not paused"):
            admin.resume("report", actor="ops")
        triggered = admin.trigger("report", actor="ops", request_id="req-1")
        # The same request id again: the action the first one recorded, not a second run.
        again = admin.trigger("report", actor="ops", request_id="req-1")
        assert (again.id, again.replayed) == (triggered.id, True)
        _until(lambda: admin.action(triggered.id).outcome == "SUCCESS")
        runs = [r for r in admin.history("report") if r.source == "trigger"]
        assert [r.run_key for r in runs] == [f"trigger:{triggered.id}"]
        assert [a.action for a in admin.actions("report")][:3] == [
            ActionKind.TRIGGER,
            ActionKind.RESUME,
            ActionKind.PAUSE,
        ]
        assert admin.prune(timedelta(days=1)) == 0
    assert [c for c in calls if c.startswith("trigger:")] == [f"trigger:{triggered.id}"]


def test_schedule_admin_wraps_an_admin_on_a_portal(pg_dsn: str) -> None:
    with _replica(pg_dsn, []) as (portal, async_admin):
        admin = ScheduleAdmin(async_admin, portal)
        assert [s.name for s in admin.list_schedules()] == ["report"]
        assert admin.pause("report", actor="ops").action is ActionKind.PAUSE
        assert portal.call(async_admin.list_schedules)[0].paused
    with pytest.raises(TypeError, match="ScheduleAdmin"):
        ScheduleAdmin(object(), Portal(name="x"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Portal"):
        ScheduleAdmin(async_admin, object())  # type: ignore[arg-type]


def test_schedule_admin_refuses_bad_input_and_changes_nothing(pg_dsn: str) -> None:
    now = datetime.now(UTC)
    with _replica(pg_dsn, []), ScheduleAdmin.connect(pg_dsn) as admin:
        with pytest.raises(ScheduleControlError, match="no such schedule"):
            admin.trigger("missing", actor="ops")
        with pytest.raises(ScheduleControlError, match="actor"):
            admin.pause("report", actor="x" * 201)
        with pytest.raises(ScheduleControlError, match="concurrency"):
            admin.backfill("report", now - timedelta(hours=3), now, actor="o", concurrency=0)
        with pytest.raises(ScheduleControlError, match="future"):
            admin.backfill("report", now, now + timedelta(hours=1), actor="o")
        with pytest.raises(ScheduleControlError, match="no running replica registers"):
            admin.create("acme", handler="bill", every_ms=60_000, actor="ops")
        with pytest.raises(ScheduleControlError, match="no stored schedule"):
            admin.update("report", every_ms=1_000, actor="ops")
        with pytest.raises(ScheduleControlError, match="declared in code"):
            admin.remove("report", actor="ops")
        with pytest.raises(ScheduleControlError, match="limit"):
            admin.history("report", limit=0)
        with pytest.raises(ScheduleControlError, match="no action"):
            admin.action(10**9)
        with pytest.raises(ScheduleControlError):
            admin.prune(timedelta(0))
        assert admin.actions("report") == []


def test_schedule_admin_connect_closes_everything_and_refuses_an_event_loop(pg_dsn: str) -> None:
    def admin_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name == "sdcore-schedule-admin"]

    with _replica(pg_dsn, []):
        with ScheduleAdmin.connect(pg_dsn, pool=PoolSettings(max_size=2)) as admin:
            assert admin_threads() == ["sdcore-schedule-admin"]

            async def from_a_loop() -> None:
                admin.list_schedules()

            with pytest.raises(RuntimeStateError, match="running event loop"):
                asyncio.run(from_a_loop())
            assert [s.name for s in admin.list_schedules()] == ["report"]
        assert admin_threads() == []
        with pytest.raises(RuntimeStateError, match="not running"):
            admin.list_schedules()
    with (
        pytest.raises(ValueError, match="max_size"),
        ScheduleAdmin.connect(pg_dsn, pool=PoolSettings(max_size=1)),
    ):
        pass
    assert admin_threads() == []
