"""The outbox delivers every message exactly as written, once.

Real PostgreSQL, and real Redis/BullMQ where a job's fate matters:

- job ids cannot collide between outboxes (schemas, namespaces); 0.1.0 rows keep their ids;
- a reused key with another message raises; ``complete_and_enqueue`` refuses duplicate keys;
- an autocommit enqueue raises and writes nothing;
- pruning keeps tombstones: a re-enqueue inside the window is a no-op;
- outcomes are fenced by the claim token: a taken-over relay's failure never lands;
- a notification that arrives during a batch is not lost;
- what jsonb does to numbers, and the ``exact_numbers`` switch; REPEATABLE READ behaviour.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any

import psycopg
import pytest
import redis.asyncio as aioredis
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool

from sdcore.job_scheduler import JobSchedulerService, JobSchedulerStatus, bullmq_job_id
from sdcore.outbox import (
    DuplicateOutboxKeyError,
    InvalidOutboxMessageError,
    Outbox,
    OutboxDatabaseError,
    OutboxEntry,
    OutboxKeyConflictError,
    OutboxMessage,
    OutboxRelay,
    OutboxTransactionRequiredError,
    PostgresOutboxStore,
    check_options,
)
from sdcore.outbox._model import job_id_v2
from sdcore.outbox._relay import KEEP_CLAIMS
from sdcore.postgres import migrations
from sdcore.queues import BullMQPublisher, Job, Processor, Workers
from sdcore.testing import RecordingPublisher

REDIS_URL = os.environ.get("SDCORE_TEST_REDIS_URL", "redis://127.0.0.1:6379")


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=8, open=False) as pool:
        await pool.open()
        await Outbox().ensure_schema(pool)
        yield pool


async def _until(check: Any, *, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _rows(pool: AsyncConnectionPool[Any], table: str = "outbox") -> list[tuple[Any, ...]]:
    async with pool.connection() as conn:
        cur = await conn.execute(
            f"SELECT idempotency_key, status, attempts, job_id FROM {table} ORDER BY id"
        )
        return list(await cur.fetchall())


class Runs(Processor):
    """Counts how often each (job id, data) runs."""

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.runs: Counter[tuple[str, str]] = Counter()

    async def process(self, job: Job) -> Any:
        self.runs[(job.id, job.data["who"])] += 1
        return None


def _dbname(dsn: str) -> str:
    return str(conninfo_to_dict(dsn)["dbname"])


# --------------------------------------------------------------------------- 1. job ids


async def test_two_tenant_schemas_on_one_redis_each_message_runs_once(
    pg_dsn: str, prefix: str
) -> None:
    """The documented pattern (one key per run) in two tenant schemas, one Redis, one queue."""
    keys = [f"nightly-report:2026-12-0{i}" for i in range(1, 4)]
    tenants = {"tenant_a": Outbox(schema="tenant_a"), "tenant_b": Outbox(schema="tenant_b")}
    runs = Runs("reports")
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=4, open=False) as pool:
        for outbox in tenants.values():
            await outbox.ensure_schema(pool)
        for who, outbox in tenants.items():
            async with pool.connection() as conn, conn.transaction():
                for key in keys:
                    assert await outbox.enqueue_once(
                        conn,
                        idempotency_key=key,
                        queue="reports",
                        name="send",
                        payload={"who": who},
                    )
        async with (
            BullMQPublisher.from_url(REDIS_URL, prefix=prefix) as publisher,
            Workers([runs], redis_url=REDIS_URL, prefix=prefix),
        ):
            for outbox in tenants.values():
                assert (
                    await OutboxRelay(
                        PostgresOutboxStore(pool, outbox=outbox), publisher
                    ).run_once()
                    == 3
                )

            async def all_ran() -> bool:
                return sum(runs.runs.values()) >= 6

            await _until(all_ran, what="6 jobs")
            await asyncio.sleep(0.3)
        ids: dict[str, set[str]] = {}
        for who in tenants:
            rows = await _rows(pool, f'"{who}".outbox')
            assert {r[1] for r in rows} == {"PUBLISHED"}
            ids[who] = {r[3] for r in rows}
    assert ids["tenant_a"].isdisjoint(ids["tenant_b"])
    db = _dbname(pg_dsn)
    assert ids["tenant_a"] == {job_id_v2(f"{db}.tenant_a.outbox", k) for k in keys}
    assert sorted(runs.runs.values()) == [1] * 6
    assert {who for _, who in runs.runs} == {"tenant_a", "tenant_b"}
    for job_id in ids["tenant_a"] | ids["tenant_b"]:
        assert job_id.startswith("sd2-")
        assert len(job_id) == 68
        assert set(job_id[4:]) <= set("0123456789abcdef")


async def test_explicit_namespaces_separate_services_sharing_a_table_name(
    template_db: str, prefix: str
) -> None:
    """Two services, two databases with the same table, one Redis: namespaces keep them apart."""
    from tests.conftest import ADMIN_DSN, dsn_for

    names = [f"sdcore_ns_{os.getpid()}_{uuid.uuid4().hex[:6]}_{i}" for i in range(2)]
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        for name in names:
            admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    runs = Runs("emails")
    try:
        async with contextlib.AsyncExitStack() as stack:
            publisher = await stack.enter_async_context(
                BullMQPublisher.from_url(REDIS_URL, prefix=prefix)
            )
            for service, name in zip(("billing", "shipping"), names, strict=True):
                outbox = Outbox(namespace=service)
                pool = await stack.enter_async_context(
                    AsyncConnectionPool(dsn_for(name), min_size=1, max_size=2, open=False)
                )
                await outbox.ensure_schema(pool)
                async with pool.connection() as conn, conn.transaction():
                    await outbox.enqueue_once(
                        conn,
                        idempotency_key="order:1",
                        queue="emails",
                        name="n",
                        payload={"who": service},
                    )
                assert (
                    await OutboxRelay(
                        PostgresOutboxStore(pool, outbox=outbox), publisher
                    ).run_once()
                    == 1
                )
                assert (await _rows(pool))[0][3] == outbox.job_id("order:1")
            async with Workers([runs], redis_url=REDIS_URL, prefix=prefix):

                async def both() -> bool:
                    return len(runs.runs) >= 2

                await _until(both, what="two jobs")
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
            for name in names:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    assert runs.runs == Counter(
        {
            (job_id_v2("billing", "order:1"), "billing"): 1,
            (job_id_v2("shipping", "order:1"), "shipping"): 1,
        }
    )
    with pytest.raises(ValueError, match="no namespace"):
        Outbox().job_id("order:1")


async def test_rows_written_by_0_1_0_keep_their_job_ids(
    pg_dsn: str, redis: aioredis.Redis, prefix: str
) -> None:
    """A 0.1.0 table with a pending row takes the migration; the row is published as ``sd-…``."""
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=2, open=False) as pool:
        async with pool.connection() as conn:
            await conn.execute(migrations("outbox")[0].render(table="outbox").encode())
            await conn.execute(
                "INSERT INTO outbox (idempotency_key, queue, name, job_id, payload, options,"
                " max_attempts) VALUES ('legacy', 'q', 'n', %s, '{\"a\": 1}', %s, 10)",
                (bullmq_job_id("legacy"), json.dumps(check_options(None))),
            )
            await conn.commit()
        outbox = Outbox()
        await outbox.ensure_schema(pool)
        async with pool.connection() as conn, conn.transaction():
            # The digest was backfilled: the same message is a no-op, another one a conflict.
            assert not await outbox.enqueue_once(
                conn, idempotency_key="legacy", queue="q", name="n", payload={"a": 1}
            )
            with pytest.raises(OutboxKeyConflictError):
                await outbox.enqueue_once(
                    conn, idempotency_key="legacy", queue="q", name="n", payload={"a": 2}
                )
        async with BullMQPublisher.from_url(REDIS_URL, prefix=prefix) as publisher:
            assert await OutboxRelay(PostgresOutboxStore(pool), publisher).run_once() == 1
        assert (await _rows(pool))[0][1:] == ("PUBLISHED", 1, bullmq_job_id("legacy"))
    assert await redis.exists(f"{prefix}:q:{bullmq_job_id('legacy')}") == 1


# --------------------------------------------------------------------------- 2. key reuse


@pytest.mark.parametrize(
    "change",
    [
        {"payload": {"task": 2}},
        {"queue": "other"},
        {"name": "other"},
        {"options": {"attempts": 3}},
    ],
    ids=["payload", "queue", "name", "options"],
)
async def test_a_reused_key_with_another_message_raises(
    pool: AsyncConnectionPool[Any], change: dict[str, Any]
) -> None:
    outbox = Outbox()
    message: dict[str, Any] = {
        "queue": "q",
        "name": "n",
        "payload": {"task": 1, "list": [1, 2]},
        "options": None,
    }
    async with pool.connection() as conn, conn.transaction():
        assert await outbox.enqueue_once(conn, idempotency_key="k", **message)
    async with pool.connection() as conn, conn.transaction():
        # The same message (keys in another order) is an idempotent no-op.
        same = {**message, "payload": {"list": [1, 2], "task": 1}}
        assert not await outbox.enqueue_once(conn, idempotency_key="k", **same)
        with pytest.raises(OutboxKeyConflictError) as caught:
            await outbox.enqueue_once(conn, idempotency_key="k", **{**message, **change})
        # Raised before any failing SQL: the caller's transaction is still usable.
        assert await outbox.enqueue_once(conn, idempotency_key="k2", **message)
    error = caught.value
    assert (error.idempotency_key, error.existing_queue, error.existing_status) == (
        "k",
        "q",
        "PENDING",
    )
    assert not error.pruned
    assert isinstance(error, ValueError)
    assert [r[0] for r in await _rows(pool)] == ["k", "k2"]


async def test_a_conflicting_key_committed_concurrently_is_seen(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    """READ COMMITTED: the insert waits for the other transaction, then reads its row."""
    outbox = Outbox()
    async with (
        await psycopg.AsyncConnection.connect(pg_dsn) as first,
        await psycopg.AsyncConnection.connect(pg_dsn) as second,
    ):
        await outbox.enqueue_once(first, idempotency_key="k", queue="q", name="n", payload={})
        blocked = asyncio.create_task(
            outbox.enqueue_once(second, idempotency_key="k", queue="q", name="n", payload={"x": 1})
        )
        await asyncio.sleep(0.3)
        assert not blocked.done()
        await first.commit()
        with pytest.raises(OutboxKeyConflictError):
            await asyncio.wait_for(blocked, 10)
        await second.rollback()


async def test_complete_and_enqueue_refuses_duplicate_keys_before_any_sql(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    outbox = Outbox()
    async with (
        JobSchedulerService.connect(pg_dsn) as jobs,
        await psycopg.AsyncConnection.connect(pg_dsn) as conn,
    ):
        await jobs.ensure_schema()
        run = await jobs.acquire({"code": "sync", "run_key": "r"})
        assert run.acquired
        entries = [
            OutboxEntry(idempotency_key="a", queue="q", name="n", payload={"i": 1}),
            OutboxEntry(idempotency_key="b", queue="q", name="n", payload={"i": 2}),
            OutboxEntry(idempotency_key="a", queue="q", name="n", payload={"i": 3}),
        ]
        with pytest.raises(DuplicateOutboxKeyError) as caught:
            await outbox.complete_and_enqueue(conn, jobs, run.lease, entries)
        assert caught.value.indexes == (0, 2)
        assert await jobs.status_of(run.lease) is JobSchedulerStatus.RUNNING
        assert await _rows(pool) == []
        # A key already holding another message rolls back the completion too.
        async with conn.transaction():
            await outbox.enqueue_once(conn, idempotency_key="b", queue="q", name="n", payload={})
        with pytest.raises(OutboxKeyConflictError):
            await outbox.complete_and_enqueue(conn, jobs, run.lease, entries[:2])
        assert await jobs.status_of(run.lease) is JobSchedulerStatus.RUNNING
        assert [r[0] for r in await _rows(pool)] == ["b"]


# --------------------------------------------------------------------------- 3. transactions


async def test_an_autocommit_enqueue_raises_and_writes_nothing(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    outbox = Outbox()
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        with pytest.raises(OutboxTransactionRequiredError, match="autocommit") as caught:
            await outbox.enqueue_once(conn, idempotency_key="k", queue="q", name="n", payload={})
        assert caught.value.connection_type == "psycopg AsyncConnection"
        assert isinstance(caught.value, RuntimeError)
        assert await _rows(pool) == []
        async with conn.transaction():
            assert await outbox.enqueue_once(
                conn, idempotency_key="in-tx", queue="q", name="n", payload={}
            )
        assert await outbox.enqueue_once(
            conn, idempotency_key="alone", queue="q", name="n", payload={}, allow_autocommit=True
        )
    assert [r[0] for r in await _rows(pool)] == ["in-tx", "alone"]


# --------------------------------------------------------------------------- 4. dedup window


async def test_prune_keeps_the_key_for_the_window(pool: AsyncConnectionPool[Any]) -> None:
    outbox = Outbox(dedup_window_ms=24 * 3600 * 1000)
    publisher = RecordingPublisher()
    relay = OutboxRelay(PostgresOutboxStore(pool, outbox=outbox), publisher, retention_ms=60_000)
    message: dict[str, Any] = {"queue": "q", "name": "n", "payload": {"v": 1}}
    async with pool.connection() as conn, conn.transaction():
        assert await outbox.enqueue_once(conn, idempotency_key="k", **message)
    assert await relay.run_once() == 1
    async with pool.connection() as conn:
        await conn.execute("UPDATE outbox SET published_at = clock_timestamp() - interval '1 hour'")
    assert await relay.prune() == 1
    async with pool.connection() as conn:
        async with conn.transaction():
            # Inside the window: the same message is a no-op, another one a conflict.
            assert not await outbox.enqueue_once(conn, idempotency_key="k", **message)
        with pytest.raises(OutboxKeyConflictError) as caught:
            async with conn.transaction():
                await outbox.enqueue_once(
                    conn, idempotency_key="k", queue="q", name="n", payload={"v": 2}
                )
    assert caught.value.pruned
    assert await relay.run_once() == 0
    assert len(publisher.publishes) == 1
    # Past the window the tombstone is deleted: the key is free for a new message.
    async with pool.connection() as conn:
        await conn.execute("UPDATE outbox SET published_at = clock_timestamp() - interval '2 days'")
    assert await relay.prune() == 0
    assert await _rows(pool) == []
    async with pool.connection() as conn, conn.transaction():
        assert await outbox.enqueue_once(
            conn, idempotency_key="k", queue="q", name="n", payload={"v": 2}
        )


# --------------------------------------------------------------------------- 5. claim fencing


class Gated:
    """A publisher that waits for ``release`` before publishing through ``inner``."""

    def __init__(self, inner: BullMQPublisher) -> None:
        self.inner = inner
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def publish(self, messages: Sequence[OutboxMessage]) -> Sequence[BaseException | None]:
        self.entered.set()
        await asyncio.wait_for(self.release.wait(), 20)
        return await self.inner.publish(messages)


class Keeping(PostgresOutboxStore):
    """A store that counts the claim extensions its relay has made (each once it returned or
    failed: the relay goes on after a failed one)."""

    extended = 0

    async def extend_claim(self, ids: Sequence[int], *, token: uuid.UUID, claim_ms: int) -> None:
        try:
            await super().extend_claim(ids, token=token, claim_ms=claim_ms)
        finally:
            self.extended += 1


async def _until_claim_expired(pool: AsyncConnectionPool[Any], keeping: Keeping) -> None:
    """Wait until the slow relay stopped keeping its claim (``KEEP_CLAIMS`` claims, one extension
    every third of one) and the claim expired: only a publish that hangs longer loses it. Not
    the expiry alone: a keeper late under load extends a claim the test saw lapse."""
    deadline = time.monotonic() + 30
    while keeping.extended < KEEP_CLAIMS * 3:
        if time.monotonic() > deadline:
            pytest.fail(f"the slow relay extended its claim {keeping.extended} times in 30 s")
        await asyncio.sleep(0.05)
    while True:
        async with pool.connection() as conn:
            cur = await conn.execute(
                "SELECT bool_and(claimed_until < clock_timestamp()) FROM outbox"
            )
            row = await cur.fetchone()
        if row is not None and row[0]:
            return
        if time.monotonic() > deadline:
            pytest.fail("the slow relay's claim did not expire within 30 s")
        await asyncio.sleep(0.05)


async def test_a_taken_over_relay_cannot_mark_a_delivered_row_dead(
    pool: AsyncConnectionPool[Any],
    redis: aioredis.Redis,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A's claim expires mid-publish, B delivers, then A hits a message error (smaller limit)."""
    outbox = Outbox(max_attempts=2)
    async with pool.connection() as conn, conn.transaction():
        await outbox.enqueue_once(
            conn, idempotency_key="k", queue="q", name="n", payload={"blob": "x" * 500}
        )
    caplog.set_level(logging.INFO, logger="sdcore.outbox")
    async with (
        BullMQPublisher.from_url(REDIS_URL, prefix=prefix, max_job_bytes=100) as small,
        BullMQPublisher.from_url(REDIS_URL, prefix=prefix) as big,
    ):
        gated = Gated(small)
        keeping = Keeping(pool, outbox=outbox)
        relay_a = OutboxRelay(keeping, gated, claim_ms=200, retry_base_ms=1)
        relay_b = OutboxRelay(PostgresOutboxStore(pool, outbox=outbox), big, claim_ms=200)
        a_round = asyncio.create_task(relay_a.run_once())
        await asyncio.wait_for(gated.entered.wait(), 10)
        await _until_claim_expired(pool, keeping)  # A's publish outlasted its kept claim
        assert await relay_b.run_once() == 1
        gated.release.set()
        assert await asyncio.wait_for(a_round, 10) == 1
    assert (await _rows(pool))[0][:3] == ("k", "PUBLISHED", 2)
    outbox_logs = [r for r in caplog.records if r.name == "sdcore.outbox"]
    assert not [r for r in outbox_logs if r.levelno >= logging.WARNING]
    assert "outbox_claim_lost" in [getattr(r, "action", None) for r in caplog.records]
    assert relay_a.state.failed == 0
    assert await redis.exists(f"{prefix}:q:{(await _rows(pool))[0][3]}") == 1


async def test_a_row_delivered_by_a_taken_over_relay_ends_published(
    pool: AsyncConnectionPool[Any], prefix: str
) -> None:
    """A delivers slowly; B (smaller limit) marks the row DEAD meanwhile; A's delivery wins."""
    outbox = Outbox(max_attempts=2)
    async with pool.connection() as conn, conn.transaction():
        await outbox.enqueue_once(
            conn, idempotency_key="k", queue="q", name="n", payload={"blob": "x" * 500}
        )
    async with (
        BullMQPublisher.from_url(REDIS_URL, prefix=prefix) as big,
        BullMQPublisher.from_url(REDIS_URL, prefix=prefix, max_job_bytes=100) as small,
    ):
        gated = Gated(big)
        keeping = Keeping(pool, outbox=outbox)
        relay_a = OutboxRelay(keeping, gated, claim_ms=200)
        relay_b = OutboxRelay(PostgresOutboxStore(pool, outbox=outbox), small, claim_ms=200)
        a_round = asyncio.create_task(relay_a.run_once())
        await asyncio.wait_for(gated.entered.wait(), 10)
        await _until_claim_expired(pool, keeping)  # A's publish outlasted its kept claim
        assert await relay_b.run_once() == 1
        assert (await _rows(pool))[0][1] == "DEAD"
        gated.release.set()
        assert await asyncio.wait_for(a_round, 10) == 1
    assert (await _rows(pool))[0][1] == "PUBLISHED"


async def test_a_broker_outage_does_not_release_another_relays_claim(
    pool: AsyncConnectionPool[Any],
) -> None:
    outbox = Outbox()
    async with pool.connection() as conn, conn.transaction():
        await outbox.enqueue_once(conn, idempotency_key="k", queue="q", name="n", payload={})
    down = RecordingPublisher()
    down.unavailable = True
    gated_inner = RecordingPublisher()

    class Slow:
        entered = asyncio.Event()
        release = asyncio.Event()

        async def publish(
            self, messages: Sequence[OutboxMessage]
        ) -> Sequence[BaseException | None]:
            self.entered.set()
            await asyncio.wait_for(self.release.wait(), 20)
            return await down.publish(messages)

    slow = Slow()
    keeping = Keeping(pool, outbox=outbox)
    relay_a = OutboxRelay(keeping, slow, claim_ms=200)
    relay_b = OutboxRelay(PostgresOutboxStore(pool, outbox=outbox), gated_inner, claim_ms=60_000)
    a_round = asyncio.create_task(relay_a.run_once())
    await asyncio.wait_for(slow.entered.wait(), 10)
    await _until_claim_expired(pool, keeping)  # A's publish outlasted its kept claim
    # B claims (a long claim) but is still publishing when A's unclaim arrives.
    async with pool.connection() as conn:
        cur = await conn.execute(outbox.sql.claim, (10, 2**40, 60_000, uuid.uuid4()))
        assert len(await cur.fetchall()) == 1
    slow.release.set()
    with pytest.raises(Exception, match="unavailable"):
        await asyncio.wait_for(a_round, 10)
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT claimed_until > clock_timestamp(), attempts FROM outbox")
        assert await cur.fetchone() == (True, 2)
    assert await relay_b.run_once() == 0


# --------------------------------------------------------------------------- 6. wake-ups


async def test_a_row_committed_during_a_batch_is_published_without_the_poll(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    inner = RecordingPublisher()

    class HoldsFirstBatch:
        entered = asyncio.Event()
        release = asyncio.Event()

        async def publish(
            self, messages: Sequence[OutboxMessage]
        ) -> Sequence[BaseException | None]:
            self.entered.set()
            await asyncio.wait_for(self.release.wait(), 20)
            return await inner.publish(messages)

    publisher = HoldsFirstBatch()
    outbox = Outbox()
    async with OutboxRelay(PostgresOutboxStore(pool), publisher, poll_interval_ms=60_000) as relay:

        async def listening() -> bool:
            return relay.state.listening

        await _until(listening, what="LISTEN")
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            async with conn.transaction():
                await outbox.enqueue_once(
                    conn, idempotency_key="a", queue="q", name="n", payload={}
                )
            await asyncio.wait_for(publisher.entered.wait(), 10)
            async with conn.transaction():  # committed while the batch is being published
                await outbox.enqueue_once(
                    conn, idempotency_key="b", queue="q", name="n", payload={}
                )
        await asyncio.sleep(0.2)  # the NOTIFY has arrived during the batch
        started = time.monotonic()
        publisher.release.set()

        async def both() -> bool:
            return len(inner.publishes) == 2

        await _until(both, timeout=10, what="the second row")
        waited = time.monotonic() - started
    assert [m.idempotency_key for m in inner.publishes] == ["a", "b"]
    assert waited < 5  # the poll is 60 s: only the kept wake-up explains it


async def test_transaction_pooling_polls_and_does_not_claim_to_listen(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    publisher = RecordingPublisher()
    outbox = Outbox()
    async with OutboxRelay(
        PostgresOutboxStore(pool, transaction_pooling=True), publisher, poll_interval_ms=200
    ) as relay:
        await asyncio.sleep(0.5)
        assert not relay.state.listening
        async with pool.connection() as conn:
            cur = await conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE query ILIKE 'LISTEN%%'"
                " AND datname = current_database()"
            )
            assert await cur.fetchone() == (0,)
        async with pool.connection() as conn, conn.transaction():
            await outbox.enqueue_once(conn, idempotency_key="k", queue="q", name="n", payload={})

        async def published() -> bool:
            return len(publisher.publishes) == 1

        await _until(published, timeout=5, what="the polled row")
    assert relay.state.published == 1


async def test_listen_dsn_listens_on_its_own_connection(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    publisher = RecordingPublisher()
    outbox = Outbox()
    listen_dsn = f"{pg_dsn} application_name=sdcore-relay-listen"
    async with OutboxRelay(
        PostgresOutboxStore(pool, transaction_pooling=True, listen_dsn=listen_dsn),
        publisher,
        poll_interval_ms=60_000,
    ) as relay:

        async def listening() -> bool:
            return relay.state.listening

        await _until(listening, what="LISTEN")
        async with pool.connection() as conn:
            cur = await conn.execute(
                "SELECT query FROM pg_stat_activity WHERE application_name = %s"
                " AND datname = current_database()",
                ("sdcore-relay-listen",),
            )
            assert [r[0] for r in await cur.fetchall()] == ['LISTEN "sdcore_outbox"']
        await asyncio.sleep(0.2)
        started = time.monotonic()
        async with pool.connection() as conn, conn.transaction():
            await outbox.enqueue_once(conn, idempotency_key="k", queue="q", name="n", payload={})

        async def published() -> bool:
            return len(publisher.publishes) == 1

        await _until(published, timeout=5, what="the notified row")
        assert time.monotonic() - started < 3


# --------------------------------------------------------------------------- 7. fidelity


# (value sent, value the relay reads back from jsonb): what the outbox reference tabulates.
ROUND_TRIPS: list[tuple[str, Any, Any]] = [
    ("int", 42, 42),
    ("big-int", 2**64 + 1, 2**64 + 1),
    ("float", 0.1, 0.1),
    ("small-float", 1e-5, 1e-5),
    ("denormal", 5e-324, 5e-324),
    ("float-1e15", 1e15, 1e15),
    ("float-1e16", 1e16, 10**16),
    ("float-1e300", 1e300, 10**300),
    ("neg-zero", -0.0, 0.0),
    ("unicode", "ünï 🎉", "ünï 🎉"),
    ("bool-null", [True, None], [True, None]),
]


async def test_what_jsonb_does_to_payloads(pool: AsyncConnectionPool[Any]) -> None:
    outbox = Outbox()
    payload = {name: sent for name, sent, _ in ROUND_TRIPS}
    payload["order"] = {"zz": 1, "a": 2, "mm": 3}
    async with pool.connection() as conn, conn.transaction():
        await outbox.enqueue_once(conn, idempotency_key="k", queue="q", name="n", payload=payload)
    publisher = RecordingPublisher()
    await OutboxRelay(PostgresOutboxStore(pool), publisher).run_once()
    back = publisher.publishes[0].payload
    for name, _, expected in ROUND_TRIPS:
        assert back[name] == expected, name
        assert type(back[name]) is type(expected), name
    assert str(back["neg-zero"]) == "0.0"
    assert type(back["float-1e16"]) is int
    assert back["float-1e300"] != int(1e300)  # the decimal text, not the binary float
    assert list(back["order"]) == ["a", "mm", "zz"]  # jsonb orders keys: shorter first


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (-0.0, "-0.0"),
        (1e16, "as an int"),
        (-1e300, "as an int"),
        (2**53, "2\\^53"),
        (-(2**53), "2\\^53"),
    ],
    ids=["neg-zero", "1e16", "neg-1e300", "2^53", "neg-2^53"],
)
async def test_exact_numbers_refuses_lossy_numbers_before_any_sql(
    pool: AsyncConnectionPool[Any], value: Any, problem: str
) -> None:
    outbox = Outbox(exact_numbers=True)
    async with pool.connection() as conn, conn.transaction():
        with pytest.raises(InvalidOutboxMessageError, match=problem) as caught:
            await outbox.enqueue_once(
                conn, idempotency_key="k", queue="q", name="n", payload={"a": [{"b": value}]}
            )
        assert "$.a[0].b" in str(caught.value)
        assert await outbox.enqueue_once(
            conn,
            idempotency_key="ok",
            queue="q",
            name="n",
            payload={"a": [2**53 - 1, 1e15, 0.0, 1e-300, "1e300"]},
        )
    assert [r[0] for r in await _rows(pool)] == ["ok"]


async def test_repeatable_read_raises_serialization_failure_on_a_concurrent_key(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    outbox = Outbox()
    async with await psycopg.AsyncConnection.connect(pg_dsn) as late:
        await late.set_isolation_level(psycopg.IsolationLevel.REPEATABLE_READ)
        await late.execute("SELECT 1")  # the snapshot is taken
        async with pool.connection() as conn, conn.transaction():
            await outbox.enqueue_once(conn, idempotency_key="k", queue="q", name="n", payload={})
        with pytest.raises(psycopg.errors.SerializationFailure):
            await outbox.enqueue_once(late, idempotency_key="k", queue="q", name="n", payload={})
        await late.rollback()
        # Retried in a new transaction: the idempotent answer.
        assert not await outbox.enqueue_once(
            late, idempotency_key="k", queue="q", name="n", payload={}
        )


@pytest.mark.parametrize(
    ("namespace", "key"),
    [("billing", "order:1"), ("ünï-📦", "ключ:1"), ("a", "bc"), ("ab", "c"), ("12345", "678")],
    ids=["ascii", "unicode", "split-1", "split-2", "digits"],
)
async def test_the_database_and_python_derive_the_same_job_id(
    pool: AsyncConnectionPool[Any], namespace: str, key: str
) -> None:
    outbox = Outbox(namespace=namespace)
    async with pool.connection() as conn, conn.transaction():
        await outbox.enqueue_once(conn, idempotency_key=key, queue="q", name="n", payload={})
    stored = (await _rows(pool))[0][3]
    assert stored == outbox.job_id(key) == job_id_v2(namespace, key)
    assert stored.startswith("sd2-")
    assert not stored.isdigit()
    assert ":" not in stored


async def test_a_row_written_by_hand_with_a_bad_queue_or_job_id_is_never_published(
    pg_dsn: str,
) -> None:
    """The relay re-validates rows it did not write (queue name, job id)."""
    from sdcore.outbox import OutboxRelay, OutboxStatus
    from sdcore.testing import RecordingPublisher

    outbox = Outbox(max_attempts=1)
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await outbox.ensure_schema(conn)
        async with conn.transaction():
            await outbox.enqueue_once(
                conn, idempotency_key="good", queue="mail", name="send", payload={"n": 1}
            )
        for key, queue, job_id in (
            ("bad-queue", "mail:evil", "sd2-" + "a" * 64),
            ("bad-id", "mail", "1:2:3"),
        ):
            await conn.execute(
                "INSERT INTO outbox (idempotency_key, queue, name, job_id, payload, max_attempts,"
                " message_digest) VALUES (%s, %s, 'send', %s, '{}', 1, '\\x00')",
                (key, queue, job_id),
            )
        publisher = RecordingPublisher()
        pool = AsyncConnectionPool(pg_dsn, kwargs={"autocommit": True}, open=False)
        async with pool:
            relay = OutboxRelay(PostgresOutboxStore(pool, outbox=outbox), publisher)
            assert await relay.run_once() == 3
        assert [m.idempotency_key for m in publisher.publishes] == ["good"]
        cur = await conn.execute(
            "SELECT idempotency_key, status, last_error FROM outbox ORDER BY id"
        )
        rows = {key: (status, error) for key, status, error in await cur.fetchall()}
    assert rows["good"][0] == OutboxStatus.PUBLISHED.value
    assert rows["bad-queue"][0] == OutboxStatus.DEAD.value
    assert "queue" in rows["bad-queue"][1]
    assert rows["bad-id"][0] == OutboxStatus.DEAD.value
    assert "job_id" in rows["bad-id"][1]


async def _notifications(pg_dsn: str, enqueue: Any) -> int:
    """How many NOTIFYs on the outbox channel the ``enqueue`` coroutine function caused."""
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as listener:
        await listener.execute('LISTEN "sdcore_outbox"')
        await enqueue()
        count = 0
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):
                async for _ in listener.notifies():
                    count += 1
        return count


@pytest.mark.parametrize(("interval_ms", "expected"), [(0, 3), (10_000, 1)])
async def test_notify_interval_debounces_the_notify_across_instances(
    pool: AsyncConnectionPool[Any], pg_dsn: str, interval_ms: int, expected: int
) -> None:
    async def three_transactions() -> None:
        for key in ("a", "b", "c"):  # a fresh Outbox each time: the debounce is per process
            async with pool.connection() as conn, conn.transaction():
                outbox = Outbox(notify_interval_ms=interval_ms)
                assert await outbox.enqueue_once(
                    conn, idempotency_key=f"{interval_ms}-{key}", queue="q", name="n", payload={}
                )

    assert await _notifications(pg_dsn, three_transactions) == expected


async def test_rows_committed_without_a_notify_are_found_by_the_relay_that_is_busy(
    pool: AsyncConnectionPool[Any],
) -> None:
    """The relay that just found rows looks again every interval: an unannounced row waits ~that."""
    outbox = Outbox(notify_interval_ms=300)
    publisher = RecordingPublisher()
    async with OutboxRelay(
        PostgresOutboxStore(pool, outbox=outbox), publisher, poll_interval_ms=60_000
    ) as relay:

        async def listening() -> bool:
            return relay.state.listening

        await _until(listening, what="LISTEN")
        await asyncio.sleep(0.2)
        committed: dict[str, float] = {}
        for key in ("announced", "quiet-1", "quiet-2"):  # 50 ms apart: only the first notifies
            async with pool.connection() as conn, conn.transaction():
                await outbox.enqueue_once(
                    conn, idempotency_key=key, queue="q", name="n", payload={}
                )
            committed[key] = time.monotonic()
            await asyncio.sleep(0.05)

        async def all_published() -> bool:
            return relay.state.published == 3

        await _until(all_published, timeout=10, what="the rows committed without a NOTIFY")
    waited = time.monotonic() - committed["quiet-2"]
    assert waited < 5  # found by the relay's 300 ms look-again, not by the 60 s poll
    assert [m.idempotency_key for m in publisher.publishes] == ["announced", "quiet-1", "quiet-2"]


async def test_database_errors_reach_relay_callers_as_outbox_errors(pg_dsn: str) -> None:
    """No psycopg error escapes: a missing table, then a closed pool, are OutboxDatabaseError."""
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=2, open=False) as pool:
        await pool.open()
        relay = OutboxRelay(
            PostgresOutboxStore(pool, outbox=Outbox(table="no_such_outbox")), RecordingPublisher()
        )
        for call in (relay.run_once, relay.drain, relay.stats, relay.prune):
            with pytest.raises(OutboxDatabaseError) as caught:
                await call()
            assert caught.value.sqlstate == "42P01"  # undefined_table
            assert isinstance(caught.value.__cause__, psycopg.errors.UndefinedTable)
            assert isinstance(caught.value, ConnectionError)
        store = PostgresOutboxStore(pool)
    with pytest.raises(OutboxDatabaseError, match="claim failed") as closed:
        await store.claim(limit=1, claim_ms=1000, token=uuid.uuid4())
    assert closed.value.sqlstate is None
    assert isinstance(closed.value.__cause__, psycopg.Error)


async def test_claimed_json_is_decoded_from_text_and_equal_options_are_shared(
    pg_dsn: str,
) -> None:
    """Each distinct options value is decoded once per store and read-only."""
    from sdcore.outbox import PostgresOutboxStore, ReadOnlyDict, ReadOnlyList

    outbox = Outbox()
    long_options = {"removeOnComplete": {"age": 60}, "note": "x" * 5000}
    rows: list[tuple[str, str, str, str | None]] = [
        ("same-1", '{"n": 1}', '{"attempts": 2, "backoff": {"type": "fixed", "delay": 5}}', None),
        ("same-2", '{"n": 2}', '{"attempts": 2, "backoff": {"type": "fixed", "delay": 5}}', None),
        ("listed", '[1, {"deep": [true, null]}]', '{"x": [1, {"y": [2]}]}', '{"traceparent": "t"}'),
        ("long", '"just a string"', json.dumps(long_options), None),
        ("unicode", '{"s": "é\\u2028😀"}', "{}", None),
    ]
    rows += [(f"distinct-{i}", "{}", json.dumps({"priority": i}), None) for i in range(300)]
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await outbox.ensure_schema(conn)
        async with conn.transaction():
            for key, payload, options, trace in rows:
                await conn.execute(
                    "INSERT INTO outbox (idempotency_key, queue, name, job_id, payload, options,"
                    " max_attempts, message_digest, trace_context)"
                    " VALUES (%s, 'q', 'n', %s, %s::jsonb, %s::jsonb, 3, '\\x00', %s::jsonb)",
                    (key, "sd2-" + "a" * 64, payload, options, trace),
                )
    async with AsyncConnectionPool(pg_dsn, kwargs={"autocommit": True}, open=False) as pool:
        store = PostgresOutboxStore(pool, outbox=outbox)
        claimed = await store.claim(limit=1000, claim_ms=60_000, token=uuid.uuid4())
        by_key = {m.idempotency_key: m for m in claimed}
        assert len(by_key) == len(rows)
        for key, payload, options, trace in rows:
            message = by_key[key]
            assert message.payload == json.loads(payload)
            assert message.options == json.loads(options)
            assert message.trace_context == (None if trace is None else json.loads(trace))
            assert type(message.options) is ReadOnlyDict
        first, second = by_key["same-1"], by_key["same-2"]
        assert first.options is second.options  # decoded once, shared
        assert type(first.payload) is dict
        assert first.payload is not second.payload
        listed = by_key["listed"]
        assert type(listed.options["x"]) is ReadOnlyList
        assert type(listed.options["x"][1]["y"]) is ReadOnlyList
        listed_payload: Any = listed.payload
        assert type(listed_payload) is list  # payloads stay plain
        assert type(by_key["long"].options["removeOnComplete"]) is ReadOnlyDict
        with pytest.raises(TypeError, match="read-only"):
            by_key["long"].options["note"] = ""
        assert len(store._options) <= 256  # distinct values are kept up to a bound
        again = await store.claim(limit=1000, claim_ms=60_000, token=uuid.uuid4())
        assert again == []


async def test_a_row_whose_json_python_cannot_decode_fails_alone_and_ends_dead(
    pg_dsn: str,
) -> None:
    """OB-13: jsonb holds what Python's json refuses (an int of 5,000 digits, 3,000 nested
    arrays); such a row is a poison message, not a claim that fails for its whole batch."""
    from sdcore.outbox import OutboxRelay, OutboxStatus
    from sdcore.testing import RecordingPublisher

    outbox = Outbox(max_attempts=2)
    huge = "('{\"n\": ' || repeat('9', 5000) || '}')::jsonb"
    deep = "(repeat('[', 3000) || repeat(']', 3000))::jsonb"
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await outbox.ensure_schema(conn)
        async with conn.transaction():
            await outbox.enqueue_once(
                conn, idempotency_key="before", queue="mail", name="send", payload={"n": 1}
            )
        for key, payload, options, trace in (
            ("huge-payload", huge, "'{}'::jsonb", "NULL"),
            ("deep-payload", deep, "'{}'::jsonb", "NULL"),
            ("huge-options", "'{}'::jsonb", huge, "NULL"),
            ("deep-trace", "'{}'::jsonb", "'{}'::jsonb", deep),
        ):
            await conn.execute(
                "INSERT INTO outbox (idempotency_key, queue, name, job_id, payload, options,"
                f" max_attempts, message_digest, trace_context) VALUES (%s, 'mail', 'send',"
                f" %s, {payload}, {options}, 2, '\\x00', {trace})",
                (key, "sd2-" + "b" * 64),
            )
        async with conn.transaction():
            await outbox.enqueue_once(
                conn, idempotency_key="after", queue="mail", name="send", payload={"n": 2}
            )
        publisher = RecordingPublisher()
        pool = AsyncConnectionPool(pg_dsn, kwargs={"autocommit": True}, open=False)
        async with pool:
            relay = OutboxRelay(
                PostgresOutboxStore(pool, outbox=outbox), publisher, retry_base_ms=1
            )
            assert await relay.run_once() == 6
            await asyncio.sleep(0.05)
            assert await relay.run_once() == 4  # the second and last attempt of each bad row
        assert sorted(m.idempotency_key for m in publisher.publishes) == ["after", "before"]
        cur = await conn.execute("SELECT idempotency_key, status, attempts, last_error FROM outbox")
        rows = {row[0]: row[1:] for row in await cur.fetchall()}
    assert rows["before"][0] == rows["after"][0] == OutboxStatus.PUBLISHED.value
    for key, field in (
        ("huge-payload", "payload"),
        ("deep-payload", "payload"),
        ("huge-options", "options"),
        ("deep-trace", "trace_context"),
    ):
        status, attempts, error = rows[key]
        assert (status, attempts) == (OutboxStatus.DEAD.value, 2), key
        assert field in error, (key, error)
        assert "cannot be decoded" in error, (key, error)
