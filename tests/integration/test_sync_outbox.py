"""``sdcore.sync.Outbox`` on real PostgreSQL: the async outbox's rules on a blocking psycopg
connection and on a SQLAlchemy sync ``Session`` / ``Connection``; its ``NOTIFY`` debounce shared
with async enqueues; threads; the blocking migration runner; ``complete_and_enqueue``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from sdcore.job_scheduler import JobLease, JobSchedulerService, JobSchedulerStatus, JsonValueError
from sdcore.outbox import (
    DuplicateOutboxKeyError,
    InvalidOutboxMessageError,
    OutboxEntry,
    OutboxKeyConflictError,
    OutboxTransactionRequiredError,
    _debounce,
)
from sdcore.outbox import Outbox as AsyncOutbox
from sdcore.postgres import migration_status
from sdcore.sync import Outbox

CHANNEL = "sdcore_outbox"


def _message(key: str, **payload: Any) -> dict[str, Any]:
    return {"idempotency_key": key, "queue": "mail", "name": "welcome", "payload": payload}


def _keys(dsn: str, table: str = "outbox") -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute(f"SELECT idempotency_key FROM {table} ORDER BY id")]


@pytest.fixture
def dsn(pg_dsn: str) -> str:
    """A fresh database with the outbox table, made by the blocking migration runner."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        Outbox().ensure_schema(conn)
    return pg_dsn


def test_commit_publishes_rollback_removes(dsn: str) -> None:
    outbox = Outbox()
    with psycopg.connect(dsn) as conn:
        # A non-autocommit connection's implicit transaction is a transaction too.
        assert outbox.enqueue_once(conn, **_message("rolled"))
        conn.rollback()
        with conn.transaction():
            assert outbox.enqueue_once(conn, **_message("kept"))
        # The rolled-back key is free again: the retry inserts.
        with conn.transaction():
            assert outbox.enqueue_once(conn, **_message("rolled"))
    assert _keys(dsn) == ["kept", "rolled"]


def test_outside_a_transaction_is_refused_unless_allowed(dsn: str) -> None:
    outbox = Outbox()
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(OutboxTransactionRequiredError, match="psycopg Connection"):
            outbox.enqueue_once(conn, **_message("refused"))
        assert outbox.enqueue_once(conn, **_message("alone"), allow_autocommit=True)
        with conn.transaction():
            assert outbox.enqueue_once(conn, **_message("inside"))
    assert _keys(dsn) == ["alone", "inside"]


def test_the_same_message_is_a_no_op_another_one_conflicts(dsn: str) -> None:
    outbox = Outbox()
    with psycopg.connect(dsn) as conn, conn.transaction():
        assert outbox.enqueue_once(conn, **_message("k", n=10))
        # jsonb equality: key order ignored, numbers by value.
        assert not outbox.enqueue_once(conn, **_message("k", n=10.0))
        with pytest.raises(OutboxKeyConflictError) as caught:
            outbox.enqueue_once(conn, **_message("k", n=11))
        assert caught.value.existing_queue == "mail"
        # The conflict raised after SQL that did not fail: the transaction goes on.
        assert outbox.enqueue_once(conn, **_message("after"))
    assert _keys(dsn) == ["k", "after"]


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"queue": "bad queue"}, InvalidOutboxMessageError),
        ({"idempotency_key": ""}, InvalidOutboxMessageError),
        ({"payload": {"x": float("nan")}}, JsonValueError),
        ({"payload": None}, InvalidOutboxMessageError),
        ({"options": {"delay": -1}}, InvalidOutboxMessageError),
    ],
    ids=["queue", "key", "nan", "no-payload", "option"],
)
def test_bad_input_is_refused_before_any_sql(
    dsn: str, change: dict[str, Any], error: type[Exception]
) -> None:
    outbox = Outbox()
    with psycopg.connect(dsn) as conn:
        with pytest.raises(error):
            outbox.enqueue_once(conn, **{**_message("k"), **change})
        # No statement was sent: the connection did not even begin its implicit transaction.
        assert conn.info.transaction_status == TransactionStatus.IDLE
        with conn.transaction():
            with pytest.raises(error):
                outbox.enqueue_once(conn, **{**_message("k"), **change})
            assert outbox.enqueue_once(conn, **_message("still-usable"))
    assert _keys(dsn) == ["still-usable"]


def test_what_is_not_a_blocking_connection_is_refused(dsn: str) -> None:
    outbox = Outbox()
    with pytest.raises(TypeError, match="psycopg Connection or a SQLAlchemy"):
        outbox.enqueue_once(object(), **_message("k"))

    async def with_async() -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            with pytest.raises(TypeError, match=r"await sdcore\.outbox"):
                outbox.enqueue_once(conn, **_message("k"))

    asyncio.run(with_async())


def _sa_url(dsn: str, driver: str = "postgresql+psycopg") -> URL:
    params = conninfo_to_dict(dsn)
    return URL.create(
        driver,
        username=str(params.get("user", "")) or None,
        host=str(params.get("host", "")) or None,
        port=int(str(params["port"])) if "port" in params else None,
        database=str(params["dbname"]),
    )


def test_a_sqlalchemy_session_write_joins_its_transaction(dsn: str) -> None:
    outbox = Outbox()
    engine = create_engine(_sa_url(dsn))
    try:
        with Session(engine) as session:
            # The session's first statement: the write must autobegin its transaction.
            assert outbox.enqueue_once(session, **_message("rolled"))
            session.rollback()
        with Session(engine) as session:
            assert outbox.enqueue_once(session, **_message("kept"))
            assert not outbox.enqueue_once(session, **_message("kept"))
            with pytest.raises(OutboxKeyConflictError):
                outbox.enqueue_once(session, **_message("kept", other=1))
            with pytest.raises(InvalidOutboxMessageError):
                outbox.enqueue_once(session, **{**_message("bad"), "queue": "bad queue"})
            session.execute(text("SELECT 1"))  # the transaction is still usable
            session.commit()
        with engine.connect() as connection:
            assert outbox.enqueue_once(connection, **_message("conn"))
            connection.commit()
        with engine.connect() as connection:
            assert outbox.enqueue_once(connection, **_message("conn-rolled"))
            connection.rollback()
    finally:
        engine.dispose()
    assert _keys(dsn) == ["kept", "conn"]


def test_a_sqlalchemy_autocommit_connection_is_refused_unless_allowed(dsn: str) -> None:
    outbox = Outbox()
    engine = create_engine(_sa_url(dsn), isolation_level="AUTOCOMMIT")
    try:
        with Session(engine) as session:
            with pytest.raises(OutboxTransactionRequiredError, match="SQLAlchemy Session"):
                outbox.enqueue_once(session, **_message("refused"))
            assert outbox.enqueue_once(session, **_message("alone"), allow_autocommit=True)
        with (
            engine.connect() as connection,
            pytest.raises(OutboxTransactionRequiredError, match="SQLAlchemy Connection"),
        ):
            outbox.enqueue_once(connection, **_message("refused"))
    finally:
        engine.dispose()
    assert _keys(dsn) == ["alone"]


def test_a_sqlalchemy_async_session_is_sent_to_the_async_adapter(dsn: str) -> None:
    outbox = Outbox()

    async def go() -> None:
        engine = create_async_engine(_sa_url(dsn))
        try:
            async with AsyncSession(engine) as session:
                with pytest.raises(TypeError, match=r"sdcore\.sqlalchemy\.enqueue_once"):
                    outbox.enqueue_once(session, **_message("k"))
        finally:
            await engine.dispose()

    asyncio.run(go())
    assert _keys(dsn) == []


def _notifications(listener: psycopg.Connection[Any]) -> list[str]:
    """The payloads ``listener`` received up to a sentinel it sends itself (in commit order)."""
    listener.execute(f"NOTIFY {CHANNEL}, 'end'")
    found = []
    for notify in listener.notifies():
        if notify.payload == "end":
            break
        found.append(notify.payload)
    return found


@pytest.fixture
def listener(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"LISTEN {CHANNEL}")
        yield conn


def test_the_notify_debounce_is_shared_with_async_enqueues(
    dsn: str, listener: psycopg.Connection[Any]
) -> None:
    # One long interval: the enqueue that opens it notifies; the next one, sync or async, sees
    # that a notifier of the interval committed and stays quiet.
    sync_outbox = Outbox(notify_interval_ms=10_000)
    async_outbox = AsyncOutbox(notify_interval_ms=10_000)
    with psycopg.connect(dsn) as conn, conn.transaction():
        assert sync_outbox.enqueue_once(conn, **_message("sync-1"))

    async def write(key: str) -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.transaction():
            assert await async_outbox.enqueue_once(conn, **_message(key))

    asyncio.run(write("async-1"))
    with psycopg.connect(dsn) as conn, conn.transaction():
        assert sync_outbox.enqueue_once(conn, **_message("sync-2"))
    assert len(_notifications(listener)) == 1


def test_a_rolled_back_notifier_does_not_silence_the_retry(
    dsn: str, listener: psycopg.Connection[Any]
) -> None:
    outbox = Outbox(notify_interval_ms=10_000)
    with psycopg.connect(dsn) as conn:
        assert outbox.enqueue_once(conn, **_message("k"))
        conn.rollback()
        with conn.transaction():
            assert outbox.enqueue_once(conn, **_message("k"))
    assert len(_notifications(listener)) == 1
    assert _keys(dsn) == ["k"]


def test_a_failed_statement_gives_the_notify_slot_back(pg_dsn: str) -> None:
    # The enqueue takes the interval's NOTIFY slot, then its statement fails (no table): the
    # slot is given back before the error reaches the caller, so no later enqueue counts on a
    # notifier that never was.
    outbox = Outbox(table="missing_outbox", notify_interval_ms=10_000)
    with psycopg.connect(pg_dsn) as conn:
        with pytest.raises(psycopg.errors.UndefinedTable) as caught, conn.transaction():
            outbox.enqueue_once(conn, **_message("k"))
        info = conn.info
        key = ((info.host, info.port, info.dbname), outbox.outbox._target, CHANNEL)
        # Settled while the error (whose traceback holds the write loop's frames) is alive.
        assert caught.value.__traceback__ is not None
        assert key not in _debounce._intervals


def test_threads_on_their_own_connections_write_each_key_once(dsn: str) -> None:
    outbox = Outbox()
    keys = [f"key-{n}" for n in range(40)]
    inserted: list[str] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def writer(offset: int) -> None:
        try:
            with psycopg.connect(dsn) as conn:
                start.wait()
                for key in keys[offset:] + keys[:offset]:
                    with conn.transaction():
                        if outbox.enqueue_once(conn, **_message(key, k=key)):
                            with lock:
                                inserted.append(key)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n * 7,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(inserted) == sorted(keys)
    assert sorted(_keys(dsn)) == sorted(keys)


def test_ensure_schema_on_a_blocking_connection_and_pool(empty_dsn: str) -> None:
    outbox = Outbox(table="sync_outbox", schema="app")
    with psycopg.connect(empty_dsn) as conn:  # not autocommit: each migration commits itself
        outbox.ensure_schema(conn)
        outbox.ensure_schema(conn)
        assert conn.info.transaction_status == TransactionStatus.IDLE
    with ConnectionPool(empty_dsn, min_size=1, max_size=1) as pool:
        outbox.ensure_schema(pool)

    async def status() -> tuple[int, int]:
        async with await psycopg.AsyncConnection.connect(empty_dsn) as conn:
            found = await migration_status(conn, "outbox", table="sync_outbox", schema="app")
            return len(found.applied), len(found.pending)

    applied, pending = asyncio.run(status())
    assert applied > 0
    assert pending == 0
    with psycopg.connect(empty_dsn) as conn, conn.transaction():
        assert outbox.enqueue_once(conn, **_message("k"))
    with pytest.raises(TypeError, match="ConnectionPool"):
        outbox.ensure_schema(object())  # type: ignore[arg-type]


def test_of_wraps_an_async_outbox_and_keeps_its_settings() -> None:
    table = AsyncOutbox(table="events", namespace="svc")
    wrapped = Outbox.of(table)
    assert wrapped.outbox is table
    assert wrapped.job_id("k") == table.job_id("k")
    assert wrapped.schema_sql() == table.schema_sql()
    assert Outbox(namespace="svc", table="events").job_id("k") == table.job_id("k")
    with pytest.raises(TypeError, match=r"sdcore\.outbox\.Outbox"):
        Outbox.of(Outbox())  # type: ignore[arg-type]


class _SyncJobs:
    """``complete_in`` on a blocking connection: the async service's finalize statement."""

    def __init__(self, service: JobSchedulerService) -> None:
        self.service = service

    def complete_in(
        self, conn: psycopg.Connection[Any], lease: JobLease, data: Mapping[str, Any] | None
    ) -> bool:
        from sdcore._json import dump_json_object

        params = (
            JobSchedulerStatus.SUCCESS.value,
            dump_json_object(data),
            lease.id,
            lease.owner_token,
        )
        return conn.execute(self.service._engine.sql.finalize, params).rowcount == 1


def test_complete_and_enqueue_is_one_transaction(schema_dsn: str) -> None:
    outbox = Outbox()
    messages = [OutboxEntry(**_message(f"m-{n}")) for n in range(2)]

    async def acquire(service: JobSchedulerService, run_key: str) -> JobLease:
        acquired = await service.acquire(
            {"code": "sync-report", "run_key": run_key, "lease_ms": 60_000}
        )
        assert acquired.acquired
        return acquired.lease

    async def go() -> None:
        async with JobSchedulerService.connect(schema_dsn) as service:
            jobs = _SyncJobs(service)
            done = await acquire(service, "done")
            lost = await acquire(service, "lost")
            conflicting = await acquire(service, "conflicting")

            def blocking() -> None:
                with psycopg.connect(schema_dsn) as conn:
                    with pytest.raises(DuplicateOutboxKeyError):
                        outbox.complete_and_enqueue(conn, jobs, done, [*messages, messages[0]])
                    assert outbox.complete_and_enqueue(conn, jobs, done, messages, data={"n": 2})
                    conn.execute(
                        "UPDATE job_scheduler SET owner_token = gen_random_uuid() WHERE id = %s",
                        (lost.id,),
                    )
                    conn.commit()
                    assert not outbox.complete_and_enqueue(
                        conn, jobs, lost, [OutboxEntry(**_message("lost"))]
                    )
                    with pytest.raises(OutboxKeyConflictError):
                        outbox.complete_and_enqueue(
                            conn, jobs, conflicting, [OutboxEntry(**_message("m-0", other=1))]
                        )

            await asyncio.to_thread(blocking)
            assert await service.status_of(done) is JobSchedulerStatus.SUCCESS
            assert await service.status_of(conflicting) is JobSchedulerStatus.RUNNING

    asyncio.run(go())
    assert _keys(schema_dsn) == ["m-0", "m-1"]


def test_a_sqlalchemy_session_shares_the_psycopg_paths_debounce(
    dsn: str, listener: psycopg.Connection[Any]
) -> None:
    # An engine built with a creator has a URL that names no server: the debounce key comes
    # from the driver connection, so both paths count as one database.
    outbox = Outbox(notify_interval_ms=10_000)
    engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dsn))
    try:
        with psycopg.connect(dsn) as conn, conn.transaction():
            assert outbox.enqueue_once(conn, **_message("psycopg"))
        with Session(engine) as session, session.begin():
            assert outbox.enqueue_once(session, **_message("session"))
    finally:
        engine.dispose()
    assert len(_notifications(listener)) == 1


class _Driver:
    """A blocking ``OutboxDriver`` over a psycopg connection, recording what it is sent."""

    def __init__(self, conn: psycopg.Connection[Any], *, refuse: bool = False) -> None:
        self.conn = conn
        self.refuse = refuse
        self.sent: list[str] = []

    def begin(self) -> tuple[Any, ...]:
        if self.refuse:
            raise OutboxTransactionRequiredError("test driver")
        return ("driver", self.conn.info.dbname)

    def first(self, statement: str, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        self.sent.append(statement)
        return self.conn.execute(statement, params).fetchone()


def test_enqueue_via_runs_the_outboxs_statements_through_a_driver(dsn: str) -> None:
    outbox = Outbox()
    with psycopg.connect(dsn) as conn:
        driver = _Driver(conn)
        assert outbox.enqueue_via(driver, **_message("via", n=1)) is True
        assert outbox.enqueue_via(driver, **_message("via", n=1)) is False
        with pytest.raises(OutboxKeyConflictError):
            outbox.enqueue_via(driver, **_message("via", n=2))
        assert all(isinstance(statement, str) for statement in driver.sent)
        conn.commit()
        refusing = _Driver(conn, refuse=True)
        with pytest.raises(OutboxTransactionRequiredError):
            outbox.enqueue_via(refusing, **_message("refused"))
        with pytest.raises(InvalidOutboxMessageError):
            outbox.enqueue_via(driver, idempotency_key="", queue="q", name="n", payload={})
        assert refusing.sent == []
    assert _keys(dsn) == ["via"]
