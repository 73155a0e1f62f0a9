"""The transactional outbox and its relay, on real PostgreSQL, with an in-memory publisher."""

from __future__ import annotations

import asyncio
import math
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from sdcore.job_scheduler import (
    JobExecutionLease,
    JobSchedulerService,
    JobSchedulerStatus,
    JsonTypeError,
    JsonValueError,
)
from sdcore.outbox import (
    InvalidOutboxMessageError,
    Outbox,
    OutboxEntry,
    OutboxRelay,
    PostgresOutboxStore,
)
from sdcore.outbox._model import job_id_v2
from sdcore.testing import MemoryOutboxStore, RecordingPublisher


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=8, open=False) as pool:
        await pool.open()
        await Outbox().ensure_schema(pool)
        yield pool


async def _rows(pool: AsyncConnectionPool[Any]) -> list[tuple[Any, ...]]:
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT idempotency_key, status, attempts, job_id FROM outbox ORDER BY id"
        )
        rows: list[tuple[Any, ...]] = await cur.fetchall()
        return rows


def _job_id(pg_dsn: str, key: str, *, schema: str = "public", table: str = "outbox") -> str:
    """The v2 job id of ``key`` in an outbox without a namespace: the outbox's identity."""
    dbname = psycopg.conninfo.conninfo_to_dict(pg_dsn)["dbname"]
    return job_id_v2(f"{dbname}.{schema}.{table}", key)


async def _enqueue(conn: psycopg.AsyncConnection[Any], key: str, **kwargs: Any) -> bool:
    kwargs.setdefault("queue", "notifications")
    kwargs.setdefault("name", "task-status-changed")
    kwargs.setdefault("payload", {"task": key})
    return await Outbox().enqueue_once(conn, idempotency_key=key, **kwargs)


async def test_enqueue_commits_with_the_caller_and_deduplicates(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    options = {"attempts": 5, "backoff": {"type": "exponential", "delay": 1000}}
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        async with conn.transaction():
            assert await _enqueue(conn, "k1", options=options)
            assert not await _enqueue(conn, "k1", options=options)
        async with conn.transaction():
            assert not await _enqueue(conn, "k1", options=options)
    rows = await _rows(pool)
    assert [(r[0], r[1], r[3]) for r in rows] == [("k1", "PENDING", _job_id(pg_dsn, "k1"))]
    async with pool.connection() as c:
        cur = await c.execute("SELECT options FROM outbox")
        (options,) = await cur.fetchone()
    assert options["attempts"] == 5
    assert options["backoff"] == {"type": "exponential", "delay": 1000}
    assert options["removeOnComplete"] == {"age": 604800}


async def test_a_rolled_back_transaction_publishes_nothing(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:

        async def fail_after_enqueue() -> None:
            async with conn.transaction():
                assert await _enqueue(conn, "gone")
                raise RuntimeError("business rule failed")

        with pytest.raises(RuntimeError):
            await fail_after_enqueue()
    publisher = RecordingPublisher()
    assert await OutboxRelay(PostgresOutboxStore(pool), publisher).run_once() == 0
    assert await _rows(pool) == []
    assert publisher.publishes == []


BAD: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"payload": {"x": math.nan}}, JsonValueError, "payload"),
    ({"payload": {"x": "\u0000"}}, JsonValueError, "NUL"),
    ({"payload": {"x": {1, 2}}}, JsonTypeError, "set"),
    ({"payload": [1, 2]}, JsonTypeError, "JSON object"),
    ({"payload": None}, InvalidOutboxMessageError, "payload"),
    ({"queue": "a:b"}, InvalidOutboxMessageError, "queue"),
    ({"queue": ""}, InvalidOutboxMessageError, "queue"),
    ({"name": 5}, InvalidOutboxMessageError, "name"),
    ({"options": {"jobId": "x"}}, InvalidOutboxMessageError, "jobId"),
    ({"options": {"removeOnComplete": True}}, InvalidOutboxMessageError, "deduplication"),
    ({"options": {"removeOnComplete": 0}}, InvalidOutboxMessageError, "run again"),
    ({"options": {"removeOnComplete": {"age": 0}}}, InvalidOutboxMessageError, "deduplication"),
    ({"options": {"removeOnFail": {"count": 0, "age": 5}}}, InvalidOutboxMessageError, "dedup"),
    ({"options": {"attempts": 0}}, InvalidOutboxMessageError, "attempts"),
    ({"options": {"attempts": True}}, InvalidOutboxMessageError, "attempts"),
    ({"options": {"backoff": {"type": "linear"}}}, InvalidOutboxMessageError, "backoff"),
    ({"options": {"repeat": {"every": 1}}}, InvalidOutboxMessageError, "unsupported"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD, ids=[str(i) for i in range(len(BAD))])
async def test_bad_messages_are_refused_and_the_callers_transaction_stays_usable(
    pool: AsyncConnectionPool[Any],
    pg_dsn: str,
    kwargs: dict[str, Any],
    error: type[Exception],
    message: str,
) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        async with conn.transaction():
            await conn.execute("CREATE TABLE business (id int)")
            with pytest.raises(error, match=message):
                await _enqueue(conn, "bad", **kwargs)
            await conn.execute("INSERT INTO business VALUES (1)")
            assert await _enqueue(conn, "good")
        cur = await conn.execute("SELECT count(*) FROM business")
        assert await cur.fetchone() == (1,)
    assert [r[0] for r in await _rows(pool)] == ["good"]


@pytest.mark.parametrize(
    "key", [None, "", "x" * 1025, "a\x00b", 12], ids=["none", "empty", "long", "nul", "int"]
)
async def test_bad_keys(pool: AsyncConnectionPool[Any], pg_dsn: str, key: Any) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        with pytest.raises(InvalidOutboxMessageError, match="idempotency_key"):
            await Outbox().enqueue_once(conn, idempotency_key=key, queue="q", name="n", payload={})


async def test_unsupported_connection_type(pool: AsyncConnectionPool[Any]) -> None:
    with pytest.raises(TypeError, match="AsyncConnection"):
        await Outbox().enqueue_once(object(), idempotency_key="k", queue="q", name="n", payload={})


async def test_complete_and_enqueue_is_guarded_by_the_owner_token(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    outbox = Outbox()
    async with (
        JobSchedulerService.connect(pg_dsn) as jobs,
        await psycopg.AsyncConnection.connect(pg_dsn) as conn,
    ):
        await jobs.ensure_schema()
        first = await jobs.acquire({"code": "sync", "run_key": "r"})
        assert first.acquired
        assert await jobs.release(first.lease)
        second = await jobs.acquire({"code": "sync", "run_key": "r"})
        assert second.acquired
        message = OutboxEntry(
            idempotency_key=first.idempotency_key, queue="q", name="n", payload={"a": 1}
        )
        # The fenced-out owner can neither complete nor publish.
        assert not await outbox.complete_and_enqueue(conn, jobs, first.lease, [message])
        assert await _rows(pool) == []
        assert await jobs.status_of(second.lease) is JobSchedulerStatus.RUNNING
        # The current owner does both, atomically.
        assert await outbox.complete_and_enqueue(
            conn, jobs, second.lease, [message], data={"sent": 1}
        )
        assert await jobs.status_of(second.lease) is JobSchedulerStatus.SUCCESS
    assert [r[0] for r in await _rows(pool)] == [first.idempotency_key]


async def test_run_exclusive_accepts_a_run_completed_with_its_messages(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    outbox = Outbox()
    async with (
        JobSchedulerService.connect(pg_dsn) as jobs,
        await psycopg.AsyncConnection.connect(pg_dsn) as conn,
    ):
        await jobs.ensure_schema()

        async def work(lease: JobExecutionLease) -> str:
            entry = OutboxEntry(
                idempotency_key=lease.idempotency_key, queue="erp", name="sync", payload={}
            )
            assert await outbox.complete_and_enqueue(conn, jobs, lease, [entry])
            return "sent"

        outcome = await jobs.run_exclusive({"code": "erp", "run_key": "t1"}, work)
        assert (outcome.acquired, outcome.result) == (True, "sent")
    assert len(await _rows(pool)) == 1


async def test_relay_publishes_and_marks(pool: AsyncConnectionPool[Any], pg_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn, conn.transaction():
        for i in range(5):
            await _enqueue(conn, f"k{i}")
    publisher = RecordingPublisher()
    relay = OutboxRelay(PostgresOutboxStore(pool), publisher, batch_size=2)
    assert await relay.run_once() == 2
    assert await relay.run_once() == 2
    assert await relay.run_once() == 1
    assert await relay.run_once() == 0
    assert {r[1] for r in await _rows(pool)} == {"PUBLISHED"}
    assert sorted(m.idempotency_key for m in publisher.publishes) == [f"k{i}" for i in range(5)]
    stats = await relay.stats()
    assert (stats.pending, stats.published, stats.dead) == (0, 5, 0)


async def test_notify_wakes_the_relay_long_before_the_poll(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    publisher = RecordingPublisher()
    async with OutboxRelay(PostgresOutboxStore(pool), publisher, poll_interval_ms=60_000) as relay:
        for _ in range(50):
            if relay.state.listening:
                break
            await asyncio.sleep(0.05)
        assert relay.state.listening
        await asyncio.sleep(0.2)  # the first, catch-up round has run and found nothing
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn, conn.transaction():
            await _enqueue(conn, "wake")
        for _ in range(100):
            if publisher.jobs:
                break
            await asyncio.sleep(0.02)
    assert [m.idempotency_key for m in publisher.publishes] == ["wake"]


async def test_a_row_committed_late_is_still_published(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    publisher = RecordingPublisher()
    relay = OutboxRelay(PostgresOutboxStore(pool), publisher)
    async with (
        await psycopg.AsyncConnection.connect(pg_dsn) as slow,
        await psycopg.AsyncConnection.connect(pg_dsn) as fast,
    ):
        async with slow.transaction():
            await _enqueue(slow, "first-id-late-commit")
            async with fast.transaction():
                await _enqueue(fast, "second-id-early-commit")
            assert await relay.run_once() == 1
        assert await relay.run_once() == 1
    assert {m.idempotency_key for m in publisher.publishes} == {
        "first-id-late-commit",
        "second-id-early-commit",
    }


async def test_broker_outage_does_not_count_attempts_or_spin(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn, conn.transaction():
        await _enqueue(conn, "waiting")
    publisher = RecordingPublisher()
    publisher.unavailable = True
    calls = 0
    original = publisher.publish

    async def counting(messages: Any) -> Any:
        nonlocal calls
        calls += 1
        return await original(messages)

    publisher.publish = counting  # type: ignore[method-assign]
    async with OutboxRelay(
        PostgresOutboxStore(pool), publisher, poll_interval_ms=20, unavailable_max_ms=400
    ) as relay:
        await asyncio.sleep(1.5)
        assert not relay.state.broker_available
        assert (await _rows(pool))[0][1:3] == ("PENDING", 0)
        assert calls <= 6  # 0.5 s, then 0.4 s cap: a handful, not a busy loop
        publisher.unavailable = False
        for _ in range(100):
            if publisher.jobs:
                break
            await asyncio.sleep(0.05)
    assert (await _rows(pool))[0][1] == "PUBLISHED"


async def test_a_poison_message_dies_without_blocking_the_rest(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    outbox = Outbox(max_attempts=3)
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn, conn.transaction():
        await outbox.enqueue_once(
            conn, idempotency_key="poison", queue="q", name="poison", payload={}
        )
        for i in range(3):
            await outbox.enqueue_once(
                conn, idempotency_key=f"ok{i}", queue="q", name="fine", payload={}
            )
    publisher = RecordingPublisher()
    publisher.fail.add("poison")
    relay = OutboxRelay(
        PostgresOutboxStore(pool, outbox=outbox), publisher, retry_base_ms=1, retry_max_ms=1
    )
    for _ in range(10):
        await relay.run_once()
        await asyncio.sleep(0.01)
    rows = {r[0]: r[1:3] for r in await _rows(pool)}
    assert rows["poison"] == ("DEAD", 3)
    assert all(rows[f"ok{i}"][0] == "PUBLISHED" for i in range(3))
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT last_error FROM outbox WHERE idempotency_key = 'poison'")
        (error,) = await cur.fetchone()
    assert "poison" in error


async def test_an_abandoned_claim_is_republished_with_the_same_job_id(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        async with conn.transaction():
            await _enqueue(conn, "crash")
        # A relay claimed the row, published, and died before marking it.
        await conn.execute(Outbox().sql.claim, (10, 2**40, 200, uuid.uuid4()))
    publisher = RecordingPublisher()
    relay = OutboxRelay(PostgresOutboxStore(pool), publisher, claim_ms=200)
    assert await relay.run_once() == 0  # still claimed
    await asyncio.sleep(0.3)
    assert await relay.run_once() == 1
    assert publisher.publishes[0].job_id == _job_id(pg_dsn, "crash")
    assert publisher.publishes[0].attempts == 2


async def test_four_relays_publish_each_row_once(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn, conn.transaction():
        for i in range(200):
            await _enqueue(conn, f"row{i}")
    publisher = RecordingPublisher()
    relays = [OutboxRelay(PostgresOutboxStore(pool), publisher, batch_size=7) for _ in range(4)]

    async def drain(relay: OutboxRelay) -> None:
        while await relay.run_once():
            await asyncio.sleep(0)

    await asyncio.gather(*(drain(r) for r in relays))
    counts = Counter(m.idempotency_key for m in publisher.publishes)
    assert len(counts) == 200
    assert set(counts.values()) == {1}


async def test_prune_removes_old_published_rows_only(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn, conn.transaction():
        for key in ("ancient", "old", "new", "pending"):
            await _enqueue(conn, key)
    outbox = Outbox(dedup_window_ms=24 * 3600 * 1000)
    relay = OutboxRelay(
        PostgresOutboxStore(pool, outbox=outbox), RecordingPublisher(), retention_ms=60_000
    )
    async with pool.connection() as conn:
        for key, age in (("ancient", "2 days"), ("old", "1 hour"), ("new", "0 s")):
            await conn.execute(
                "UPDATE outbox SET status = 'PUBLISHED',"
                " published_at = clock_timestamp() - %s::interval WHERE idempotency_key = %s",
                (age, key),
            )
    # "ancient" and "old" become tombstones; "ancient" is past the window and deleted.
    assert await relay.prune() == 2
    assert sorted(r[0] for r in await _rows(pool)) == ["new", "old", "pending"]
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT idempotency_key, payload, pruned_at IS NOT NULL FROM outbox ORDER BY id"
        )
        assert await cur.fetchall() == [
            ("old", {}, True),
            ("new", {"task": "new"}, False),
            ("pending", {"task": "pending"}, False),
        ]
    stats = await relay.stats()
    assert (stats.published, stats.tombstones, stats.pending) == (1, 1, 1)


async def test_outbox_options_are_validated() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        Outbox(max_attempts=0)
    with pytest.raises(ValueError, match="channel"):
        Outbox(channel="")
    with pytest.raises(ValueError, match="batch_size"):
        OutboxRelay(MemoryOutboxStore(), RecordingPublisher(), batch_size=0)
    with pytest.raises(ValueError, match="dedup_window_ms"):
        Outbox(dedup_window_ms=999)
    with pytest.raises(ValueError, match="must not exceed the outbox's dedup_window_ms"):
        OutboxRelay(
            MemoryOutboxStore(outbox=Outbox(dedup_window_ms=60_000)),
            RecordingPublisher(),
            retention_ms=60_001,
        )
    with pytest.raises(InvalidOutboxMessageError, match="namespace"):
        Outbox(namespace="")
    with pytest.raises(ValueError, match="listen_dsn"):
        PostgresOutboxStore(None, listen_dsn="")  # type: ignore[arg-type]


async def test_quiet_outbox_sends_no_notify_and_is_found_by_polling(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    quiet = Outbox(notify=False)
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as listener:
        await listener.execute("LISTEN sdcore_outbox")
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn, conn.transaction():
            assert await quiet.enqueue_once(
                conn, idempotency_key="q1", queue="q", name="n", payload={}
            )
            assert not await quiet.enqueue_once(
                conn, idempotency_key="q1", queue="q", name="n", payload={}
            )
        heard = [n async for n in listener.notifies(timeout=0.3)]
        assert heard == []
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn, conn.transaction():
            assert await Outbox().enqueue_once(
                conn, idempotency_key="loud", queue="q", name="n", payload={}
            )
        heard = [n async for n in listener.notifies(timeout=1, stop_after=1)]
        assert [n.channel for n in heard] == ["sdcore_outbox"]
    publisher = RecordingPublisher()
    assert await OutboxRelay(PostgresOutboxStore(pool, outbox=quiet), publisher).run_once() == 2
