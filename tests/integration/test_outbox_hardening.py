"""The outbox and its BullMQ publisher against real PostgreSQL and Redis: the edge cases.

- A reply error is an outage only by its class or error code, never by words in the queue name
  or the key prefix that redis-py writes in front of a pipeline's error.
- One size, one unit: what ``enqueue_once`` accepts, the default publisher publishes.
- A ``Mapping`` that is not a ``dict`` is a JSON object.
- Messages that jsonb's ``=`` equates (``10`` and ``10.0``) are the same message.
- The debounced NOTIFY is spent only by an enqueue that inserted a row, and covers the rows after
  it only once its transaction committed (a long-open or rolled-back notifier holds none back).
- The publisher's memory does not grow with the number of distinct queue names.
- A hand-written row with another key's job id, or options enqueue_once refuses, ends DEAD.

Every test uses its own database (the ``pool`` fixture) and its own Redis key prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from types import MappingProxyType
from typing import Any

import psycopg
import pytest
import redis.asyncio as aioredis
from psycopg_pool import AsyncConnectionPool

from sdcore.outbox import (
    Outbox,
    OutboxKeyConflictError,
    OutboxMessage,
    OutboxRelay,
    PostgresOutboxStore,
)
from sdcore.outbox._model import job_id_v2
from sdcore.queues import BullMQPublisher
from tests.conftest import delete_prefix

REDIS_URL = os.environ.get("SDCORE_TEST_REDIS_URL", "redis://127.0.0.1:6379")


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    """A pool on a fresh database with the outbox table."""
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=4, open=False) as p:
        await Outbox().ensure_schema(p)
        yield p


async def _enqueue(
    pool: AsyncConnectionPool[Any], outbox: Outbox, key: str, queue: str, payload: dict[str, Any]
) -> str:
    async with pool.connection() as conn, conn.transaction():
        assert await outbox.enqueue_once(
            conn, idempotency_key=key, queue=queue, name="job", payload=payload
        )
        cur = await conn.execute("SELECT job_id FROM outbox WHERE idempotency_key = %s", (key,))
        row = await cur.fetchone()
        assert row is not None
        return str(row[0])


async def _status(pool: AsyncConnectionPool[Any]) -> dict[str, tuple[str, int, str | None]]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT idempotency_key, status, attempts, last_error FROM outbox")
        rows = await cur.fetchall()
        return {key: (status, attempts, error) for key, status, attempts, error in rows}


# --------------------------------------------------------------------------- error codes


@pytest.mark.parametrize(
    ("prefix_word", "queue"),
    [
        ("", "DOCK_LOADING"),
        ("", "BUSY"),
        ("", "READONLY_EXPORT"),
        ("NOAUTH-MASTERDOWN-", "dock"),
    ],
    ids=["queue-LOADING", "queue-BUSY", "queue-READONLY", "prefix-NOAUTH"],
)
async def test_a_marker_word_in_a_queue_or_prefix_name_is_not_an_outage(
    pool: AsyncConnectionPool[Any], redis: aioredis.Redis, prefix_word: str, queue: str
) -> None:
    """A WRONGTYPE poison on a queue named like an outage code is DEAD; its neighbour published."""
    prefix = f"{prefix_word}sdcore-test-{uuid.uuid4().hex[:12]}"
    outbox = Outbox(max_attempts=1)
    try:
        await _enqueue(pool, outbox, "good", queue, {"n": 1})
        poison_id = await _enqueue(pool, outbox, "poison", queue, {"n": 2})
        # BullMQ's add script then fails for this one job with WRONGTYPE, inside the EXEC.
        await redis.set(f"{prefix}:{queue}:{poison_id}", "not a hash")
        async with BullMQPublisher.from_url(REDIS_URL, prefix=prefix) as publisher:
            relay = OutboxRelay(PostgresOutboxStore(pool, outbox=outbox), publisher)
            await relay.run_once()
        rows = await _status(pool)
        assert rows["good"][:2] == ("PUBLISHED", 1)
        assert rows["poison"][:2] == ("DEAD", 1)
        assert rows["poison"][2] is not None
        assert "WRONGTYPE" in rows["poison"][2]
    finally:
        await delete_prefix(redis, prefix)


async def test_an_outage_code_in_a_pipeline_is_still_unavailable(redis: aioredis.Redis) -> None:
    """The real code of a pipeline error still decides: -BUSY from a script is an outage."""
    from redis.exceptions import ResponseError

    from sdcore.queues._redis import error_code, is_unavailable

    key = f"sdcore-test-{uuid.uuid4().hex[:12]}:LOADING"
    try:
        await redis.set(key, "x")
        async with redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, "f", "v")
            with pytest.raises(ResponseError) as wrongtype:
                await pipe.execute()
        assert error_code(wrongtype.value) == "WRONGTYPE"
        assert not is_unavailable(wrongtype.value)
        async with redis.pipeline(transaction=True) as pipe:
            pipe.eval("return redis.error_reply('BUSY Redis is busy running a script')", 0)
            with pytest.raises(ResponseError) as busy:
                await pipe.execute()
        assert error_code(busy.value) == "BUSY"
        assert is_unavailable(busy.value)
    finally:
        await redis.delete(key)


def test_error_codes_come_from_the_reply_not_the_text() -> None:
    """Classification by code: the Redis 6 script frame, BUSYGROUP, and annotated commands."""
    from redis.exceptions import ResponseError

    from sdcore.queues._redis import error_code, is_unavailable

    wrapped = ResponseError(
        "Error running script (call to f_8f55ae4a3be429c6d38c5d5db3e80edf89197b64):"
        " @user_script:41: @user_script: 41: -OOM command not allowed when used memory >"
        " 'maxmemory'.",
        status_code="ERR",
    )
    assert error_code(wrapped) == "OOM"
    assert is_unavailable(wrapped)
    annotated = ResponseError(
        "Command # 2 (EVALSHA 10f8 9 bull:TRUCK_LOADING:wait BUSY READONLY) of pipeline caused"
        " error: WRONGTYPE Operation against a key holding the wrong kind of value"
    )
    assert error_code(annotated) == "WRONGTYPE"
    assert not is_unavailable(annotated)
    assert not is_unavailable(ResponseError("BUSYGROUP Consumer Group name already exists"))
    assert not is_unavailable(ResponseError("ERR unknown command 'LOADING'"))
    assert is_unavailable(ResponseError("MISCONF Redis is configured to save RDB snapshots"))


# --------------------------------------------------------------------------- one size, one unit


@pytest.mark.parametrize(
    "text",
    [
        # {"text":"…"} is 11 bytes; é is 6 bytes escaped (\u00e9), 😀 12 (two escapes).
        pytest.param("é" * ((1_048_576 - 11) // 6), id="accented"),
        pytest.param("😀" * ((1_048_576 - 11) // 12), id="emoji"),
        pytest.param("e" * (1_048_576 - 11), id="ascii"),
    ],
)
async def test_what_enqueue_once_accepts_the_default_publisher_publishes(
    pool: AsyncConnectionPool[Any], redis: aioredis.Redis, text: str
) -> None:
    """A payload just under the limit is published; one character more is refused at enqueue."""
    from sdcore._json import MAX_JSON_BYTES, JsonValueError

    outbox = Outbox(max_attempts=1)
    payload = {"text": text}
    escaped = len(json.dumps(payload, separators=(",", ":")))
    assert MAX_JSON_BYTES - 20 < escaped <= MAX_JSON_BYTES
    prefix = f"sdcore-test-{uuid.uuid4().hex[:12]}"
    try:
        await _enqueue(pool, outbox, "fits", "q", payload)
        async with BullMQPublisher.from_url(REDIS_URL, prefix=prefix) as publisher:
            await OutboxRelay(PostgresOutboxStore(pool, outbox=outbox), publisher).run_once()
        assert (await _status(pool))["fits"][:2] == ("PUBLISHED", 1)
        bigger = {"text": text + text[:4]}
        async with pool.connection() as conn, conn.transaction():
            with pytest.raises(JsonValueError, match="as the relay sends it"):
                await outbox.enqueue_once(
                    conn, idempotency_key="over", queue="q", name="job", payload=bigger
                )
    finally:
        await delete_prefix(redis, prefix)


async def test_big_floats_are_measured_as_jsonb_returns_them(
    pool: AsyncConnectionPool[Any], redis: aioredis.Redis
) -> None:
    """1e300 comes back from jsonb as 301 digits: measured so, refused at enqueue, never DEAD."""
    from sdcore._json import JsonValueError

    outbox = Outbox(max_attempts=1)
    prefix = f"sdcore-test-{uuid.uuid4().hex[:12]}"
    try:
        fits = {"n": [1e300] * 3400}  # about 1,027,000 bytes once jsonb wrote the digits out
        await _enqueue(pool, outbox, "fits", "q", fits)
        async with BullMQPublisher.from_url(REDIS_URL, prefix=prefix) as publisher:
            await OutboxRelay(PostgresOutboxStore(pool, outbox=outbox), publisher).run_once()
        assert (await _status(pool))["fits"][:2] == ("PUBLISHED", 1)
        async with pool.connection() as conn, conn.transaction():
            with pytest.raises(JsonValueError, match="as the relay sends it"):
                await outbox.enqueue_once(
                    conn,
                    idempotency_key="over",
                    queue="q",
                    name="job",
                    payload={"n": [1e300] * 3500},
                )
    finally:
        await delete_prefix(redis, prefix)


# --------------------------------------------------------------------------- Mapping payloads


async def test_a_mapping_that_is_not_a_dict_is_enqueued_as_an_object(
    pool: AsyncConnectionPool[Any],
) -> None:
    """MappingProxyType at the top and inside is stored as a JSON object."""
    outbox = Outbox()
    payload = MappingProxyType({"user": MappingProxyType({"id": 7}), "tags": ("a", "b")})
    async with pool.connection() as conn, conn.transaction():
        assert await outbox.enqueue_once(
            conn, idempotency_key="m", queue="q", name="job", payload=payload
        )
        assert not await outbox.enqueue_once(
            conn, idempotency_key="m", queue="q", name="job", payload=dict(payload)
        )
        cur = await conn.execute("SELECT payload FROM outbox WHERE idempotency_key = 'm'")
        assert await cur.fetchone() == ({"user": {"id": 7}, "tags": ["a", "b"]},)


def test_a_mapping_holding_a_bad_value_names_its_path() -> None:
    """Inside a Mapping, a value with no JSON form is a JsonTypeError with the path."""
    from sdcore._json import JsonTypeError, dump_json_object

    with pytest.raises(JsonTypeError) as caught:
        dump_json_object(MappingProxyType({"user": MappingProxyType({"at": object()})}))
    assert caught.value.path == "$.user.at"


# --------------------------------------------------------------------------- equal messages


async def _tombstone(pool: AsyncConnectionPool[Any], key: str) -> None:
    """What the relay's pruning does to a published row past its retention."""
    async with pool.connection() as conn:
        await conn.execute(
            "UPDATE outbox SET status = 'PUBLISHED', published_at = clock_timestamp(),"
            " payload = '{}', options = '{}', pruned_at = clock_timestamp()"
            " WHERE idempotency_key = %s",
            (key,),
        )


@pytest.mark.parametrize("pruned", [False, True], ids=["live", "tombstone"])
async def test_numbers_equal_by_value_are_the_same_message(
    pool: AsyncConnectionPool[Any], pruned: bool
) -> None:
    """10 and 10.0, 1e2 and 100, key order: the same message, as jsonb's = says; 11 is not."""
    outbox = Outbox()
    first = {"amount": 10, "fee": 1e2, "big": 1e16, "items": [{"b": 1, "a": 2.5}]}
    again = {"items": [{"a": 2.5, "b": 1.0}], "big": 10**16, "fee": 100, "amount": 10.0}
    async with pool.connection() as conn, conn.transaction():
        assert await outbox.enqueue_once(
            conn, idempotency_key="charge:42", queue="q", name="job", payload=first
        )
        cur = await conn.execute(
            "SELECT %s::jsonb = %s::jsonb", (json.dumps(first), json.dumps(again))
        )
        assert await cur.fetchone() == (True,)
    if pruned:
        await _tombstone(pool, "charge:42")
    async with pool.connection() as conn, conn.transaction():
        assert not await outbox.enqueue_once(
            conn, idempotency_key="charge:42", queue="q", name="job", payload=again
        )
        with pytest.raises(OutboxKeyConflictError):
            await outbox.enqueue_once(
                conn,
                idempotency_key="charge:42",
                queue="q",
                name="job",
                payload={**again, "amount": 11},
            )


async def test_a_tombstone_written_before_the_canonical_digest_still_matches(
    pool: AsyncConnectionPool[Any],
) -> None:
    """A tombstone holding the old digest (jsonb's text) still recognises the same message."""
    outbox = Outbox()
    payload = {"amount": 10, "who": "é"}
    async with pool.connection() as conn, conn.transaction():
        assert await outbox.enqueue_once(
            conn, idempotency_key="old", queue="q", name="job", payload=payload
        )
        await conn.execute(
            "UPDATE outbox SET message_digest = sha256(convert_to(jsonb_build_array("
            "queue, name, payload, options)::text, 'UTF8'))"
        )
    await _tombstone(pool, "old")
    async with pool.connection() as conn, conn.transaction():
        assert not await outbox.enqueue_once(
            conn, idempotency_key="old", queue="q", name="job", payload=payload
        )
        with pytest.raises(OutboxKeyConflictError):
            await outbox.enqueue_once(
                conn, idempotency_key="old", queue="q", name="job", payload={"amount": 11}
            )


def test_the_memory_store_equates_numbers_by_value_too() -> None:
    """MemoryOutboxStore answers as PostgreSQL does."""
    from sdcore.testing import MemoryOutboxStore

    store = MemoryOutboxStore()
    assert store.enqueue(idempotency_key="k", queue="q", name="n", payload={"a": 10, "b": [1e2]})
    assert not store.enqueue(
        idempotency_key="k", queue="q", name="n", payload={"b": [100], "a": 10.0}
    )
    with pytest.raises(OutboxKeyConflictError):
        store.enqueue(idempotency_key="k", queue="q", name="n", payload={"a": 10.5, "b": [100]})


# --------------------------------------------------------------------------- debounced wake-ups


class _Recorder:
    """A publisher that records when each key was published."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}

    async def publish(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        now = time.monotonic()
        for message in messages:
            self.at.setdefault(message.idempotency_key, now)
        return [None] * len(messages)


# The writer debounces for 10 s and the relay polls once a minute: a row that no NOTIFY announces
# waits for the poll, so "published within 20 s" can only be a NOTIFY's work.
WRITER_INTERVAL_MS = 10_000
POLL_MS = 60_000
WITHIN_S = 20.0


async def _until_published(recorder: _Recorder, key: str) -> float:
    deadline = time.monotonic() + WITHIN_S
    while key not in recorder.at:
        if time.monotonic() > deadline:
            pytest.fail(f"{key!r} was not published within {WITHIN_S} s: no NOTIFY announced it")
        await asyncio.sleep(0.02)
    return recorder.at[key]


@contextlib.asynccontextmanager
async def _idle_relay(pool: AsyncConnectionPool[Any]) -> AsyncIterator[_Recorder]:
    """A listening relay that has found nothing yet (so it does not look again by itself)."""
    recorder = _Recorder()
    relay_outbox = Outbox(notify_interval_ms=0)
    async with OutboxRelay(
        PostgresOutboxStore(pool, outbox=relay_outbox), recorder, poll_interval_ms=POLL_MS
    ) as relay:
        deadline = time.monotonic() + 10
        while not relay.state.listening:
            if time.monotonic() > deadline:
                pytest.fail("the relay did not LISTEN within 10 s")
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # its first (empty) claim is over
        yield recorder


async def test_a_no_op_enqueue_does_not_spend_the_notify(pool: AsyncConnectionPool[Any]) -> None:
    """enqueue_once of a key that holds the same message sends no NOTIFY, and takes no slot."""
    async with pool.connection() as conn, conn.transaction():
        await Outbox(notify=False).enqueue_once(
            conn, idempotency_key="old", queue="q", name="job", payload={"n": 1}
        )
        await conn.execute("UPDATE outbox SET status = 'PUBLISHED', published_at = now()")
    writer = Outbox(notify_interval_ms=WRITER_INTERVAL_MS)
    async with _idle_relay(pool) as recorder:
        async with pool.connection() as conn, conn.transaction():
            assert not await writer.enqueue_once(
                conn, idempotency_key="old", queue="q", name="job", payload={"n": 1}
            )
        async with pool.connection() as conn, conn.transaction():
            assert await writer.enqueue_once(
                conn, idempotency_key="new", queue="q", name="job", payload={"n": 2}
            )
        committed = time.monotonic()
        await _until_published(recorder, "new")
    assert recorder.at["new"] - committed < WITHIN_S


async def test_a_long_open_notifier_does_not_hold_back_rows_committed_meanwhile(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    """A's transaction carries the NOTIFY and stays open; B, committed meanwhile, is announced."""
    writer = Outbox(notify_interval_ms=WRITER_INTERVAL_MS)
    async with _idle_relay(pool) as recorder, pool.connection() as conn_a:
        async with conn_a.transaction():
            assert await writer.enqueue_once(
                conn_a, idempotency_key="A", queue="q", name="job", payload={}
            )
            async with pool.connection() as conn_b, conn_b.transaction():
                assert await writer.enqueue_once(
                    conn_b, idempotency_key="B", queue="q", name="job", payload={}
                )
            await _until_published(recorder, "B")
            assert "A" not in recorder.at  # still uncommitted
        await _until_published(recorder, "A")
        # Rows after A committed are quiet again (the debounce holds): C sends no NOTIFY.
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as listener:
            await listener.execute('LISTEN "sdcore_outbox"')
            async with pool.connection() as conn_c, conn_c.transaction():
                assert await writer.enqueue_once(
                    conn_c, idempotency_key="C", queue="q", name="job", payload={}
                )
            notes = 0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    async for _ in listener.notifies():
                        notes += 1
        assert notes == 0


async def test_a_rolled_back_notifier_hands_the_notify_on(pool: AsyncConnectionPool[Any]) -> None:
    """A's NOTIFY is rolled back; B, within the interval, notifies itself."""
    writer = Outbox(notify_interval_ms=WRITER_INTERVAL_MS)
    async with _idle_relay(pool) as recorder:
        async with pool.connection() as conn_a, conn_a.transaction(force_rollback=True):
            assert await writer.enqueue_once(
                conn_a, idempotency_key="A", queue="q", name="job", payload={}
            )
        async with pool.connection() as conn_b, conn_b.transaction():
            assert await writer.enqueue_once(
                conn_b, idempotency_key="B", queue="q", name="job", payload={}
            )
        await _until_published(recorder, "B")
    assert "A" not in recorder.at


async def test_a_row_after_a_rolled_back_savepoint_notify_in_its_transaction_is_announced(
    pool: AsyncConnectionPool[Any],
) -> None:
    """A's NOTIFY is rolled back with its savepoint; B, later in the same transaction, notifies."""
    writer = Outbox(notify_interval_ms=WRITER_INTERVAL_MS)
    async with _idle_relay(pool) as recorder:
        async with pool.connection() as conn, conn.transaction():
            with contextlib.suppress(psycopg.Rollback):
                async with conn.transaction():  # a savepoint
                    assert await writer.enqueue_once(
                        conn, idempotency_key="A", queue="q", name="job", payload={}
                    )
                    raise psycopg.Rollback()
            assert await writer.enqueue_once(
                conn, idempotency_key="B", queue="q", name="job", payload={}
            )
        await _until_published(recorder, "B")
    assert "A" not in recorder.at


async def test_a_row_watching_a_savepoint_notify_that_was_rolled_back_is_announced(
    pool: AsyncConnectionPool[Any],
) -> None:
    """A's NOTIFY is rolled back with its savepoint and A's transaction commits without a row;
    B, in another transaction within the interval, notifies itself."""
    writer = Outbox(notify_interval_ms=WRITER_INTERVAL_MS)
    async with _idle_relay(pool) as recorder:
        async with pool.connection() as conn_a, conn_a.transaction():
            with contextlib.suppress(psycopg.Rollback):
                async with conn_a.transaction():  # a savepoint
                    assert await writer.enqueue_once(
                        conn_a, idempotency_key="A", queue="q", name="job", payload={}
                    )
                    raise psycopg.Rollback()
        async with pool.connection() as conn_b, conn_b.transaction():
            assert await writer.enqueue_once(
                conn_b, idempotency_key="B", queue="q", name="job", payload={}
            )
        await _until_published(recorder, "B")
    assert "A" not in recorder.at


# --------------------------------------------------------------------------- many queue names


def _messages(start: int, stop: int) -> list[OutboxMessage]:
    from datetime import UTC, datetime

    from sdcore.outbox import check_options

    options = check_options(None)
    return [
        OutboxMessage(
            id=i,
            idempotency_key=f"k{i}",
            queue=f"tenant-{i}",
            name="job",
            job_id=job_id_v2("test", f"k{i}"),
            payload={"i": i},
            options=options,
            attempts=1,
            max_attempts=10,
            created_at=datetime.now(UTC),
        )
        for i in range(start, stop)
    ]


async def test_the_publishers_memory_does_not_grow_with_queue_names(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """400 more queue names after the first 100 cost well under 1 MB (283 KB each before)."""
    import gc
    import tracemalloc

    from sdcore.queues import _publisher

    monkeypatch.setattr(_publisher, "MAX_CACHED_QUEUES", 64, raising=False)
    prefix = f"sdcore-test-{uuid.uuid4().hex[:12]}"
    tracemalloc.start()
    try:
        async with BullMQPublisher.from_url(REDIS_URL, prefix=prefix) as publisher:
            assert await publisher.publish(_messages(0, 100)) == [None] * 100
            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            for start in range(100, 500, 100):
                assert await publisher.publish(_messages(start, start + 100)) == [None] * 100
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        assert grown < 1024 * 1024, f"{grown} bytes for 400 more queue names"
        for i in (0, 99, 250, 499):  # every job is in its own queue, with its own data
            job = await redis.hgetall(f"{prefix}:tenant-{i}:{job_id_v2('test', f'k{i}')}")
            assert json.loads(job["data"]) == {"i": i}
            assert await redis.llen(f"{prefix}:tenant-{i}:wait") == 1
    finally:
        tracemalloc.stop()
        await delete_prefix(redis, prefix)


async def test_a_shared_script_queue_is_the_queue_bullmq_would_build(
    redis: aioredis.Redis,
) -> None:
    """sibling_queue sets every field Queue.__init__ sets, to what it would set."""
    from sdcore.queues._bullmq import Queue, sibling_queue

    template = Queue("first", {"connection": redis, "prefix": "p"})
    fresh = Queue("second", {"connection": redis, "prefix": "p"})
    sibling = sibling_queue(template, "second")
    assert set(vars(sibling)) == set(vars(fresh))
    assert sibling.keys == fresh.keys
    assert sibling.qualifiedName == fresh.qualifiedName == "p:second"
    assert sibling.name == "second"
    assert template.name == "first"
    assert sibling.redisConnection is template.redisConnection
    assert sibling.scripts.keys == fresh.scripts.keys
    assert template.keys != fresh.keys


# --------------------------------------------------------------------------- hand-written rows


async def test_hand_written_rows_with_another_keys_id_or_foreign_options_end_dead(
    pool: AsyncConnectionPool[Any], redis: aioredis.Redis
) -> None:
    """The relay checks a row's job id against its key and its options as enqueue_once would."""
    from sdcore.job_scheduler import bullmq_job_id

    outbox = Outbox(max_attempts=1)
    victim_id = await _enqueue(pool, outbox, "victim", "q", {"n": 1})
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT job_namespace FROM outbox WHERE idempotency_key = 'victim'"
        )
        row = await cur.fetchone()
        assert row is not None
        namespace = row[0]
        assert victim_id == job_id_v2(namespace, "victim")
        keep = json.dumps({"removeOnComplete": {"age": 60}, "removeOnFail": {"age": 60}})
        forged = [
            ("stolen-v2", victim_id, namespace, keep),
            ("stolen-v1", bullmq_job_id("victim"), None, keep),
            ("repeat", job_id_v2(namespace, "repeat"), namespace, '{"repeat": {"every": 1000}}'),
            ("lifo", job_id_v2(namespace, "lifo"), namespace, '{"lifo": "yes"}'),
            ("priority", job_id_v2(namespace, "priority"), namespace, '{"priority": 1073741824}'),
            ("fine", job_id_v2(namespace, "fine"), namespace, keep),
        ]
        for key, job_id, ns, options in forged:
            await conn.execute(
                "INSERT INTO outbox (idempotency_key, queue, name, job_id, payload, options,"
                " max_attempts, message_digest, job_namespace)"
                " VALUES (%s, 'q', 'job', %s, '{}', %s, 1, '\\x00', %s)",
                (key, job_id, options, ns),
            )
    prefix = f"sdcore-test-{uuid.uuid4().hex[:12]}"
    try:
        async with BullMQPublisher.from_url(REDIS_URL, prefix=prefix) as publisher:
            await OutboxRelay(PostgresOutboxStore(pool, outbox=outbox), publisher).run_once()
        rows = await _status(pool)
        assert rows["victim"][0] == "PUBLISHED"
        assert rows["fine"][0] == "PUBLISHED"
        for key in ("stolen-v2", "stolen-v1"):
            assert rows[key][0] == "DEAD", key
            assert "not the id of this row's idempotency key" in str(rows[key][2])
        assert "unsupported job option 'repeat'" in str(rows["repeat"][2])
        assert "options.lifo" in str(rows["lifo"][2])
        assert "options.priority" in str(rows["priority"][2])
        assert {rows[k][0] for k in ("repeat", "lifo", "priority")} == {"DEAD"}
        data = await redis.hget(f"{prefix}:q:{victim_id}", "data")
        assert json.loads(str(data)) == {"n": 1}  # the victim's own job, not a forger's
        assert await redis.exists(f"{prefix}:q:repeat") == 0
    finally:
        await delete_prefix(redis, prefix)


async def test_a_hand_written_row_with_another_rows_id_and_no_namespace_ends_dead(
    pool: AsyncConnectionPool[Any], redis: aioredis.Redis
) -> None:
    """A row written by hand without job_namespace (as an INSERT that leaves the new column out
    writes it) cannot have its sd2- id checked against its key: it must still not share another
    row's id. A row older than outbox/0005 (no namespace, its own key's id) and one whose id is
    another outbox's (no other row holds it) are published."""
    outbox = Outbox(max_attempts=1)
    victim_id = await _enqueue(pool, outbox, "victim", "q", {"n": 1})
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT job_namespace FROM outbox WHERE idempotency_key = 'victim'"
        )
        row = await cur.fetchone()
        assert row is not None
        namespace = row[0]
        keep = json.dumps({"removeOnComplete": {"age": 60}, "removeOnFail": {"age": 60}})
        for key, job_id in (
            ("forged", victim_id),
            ("pre-0.3", job_id_v2(namespace, "pre-0.3")),
            ("other-namespace", job_id_v2("another service", "other-namespace")),
        ):
            await conn.execute(
                "INSERT INTO outbox (idempotency_key, queue, name, job_id, payload, options,"
                " max_attempts, message_digest)"
                " VALUES (%s, 'q', 'job', %s, %s, %s, 1, '\\x00')",
                (key, job_id, json.dumps({"who": key}), keep),
            )
    prefix = f"sdcore-test-{uuid.uuid4().hex[:12]}"
    try:
        async with BullMQPublisher.from_url(REDIS_URL, prefix=prefix) as publisher:
            await OutboxRelay(PostgresOutboxStore(pool, outbox=outbox), publisher).run_once()
        rows = await _status(pool)
        assert {k: v[0] for k, v in rows.items()} == {
            "victim": "PUBLISHED",
            "forged": "DEAD",
            "pre-0.3": "PUBLISHED",
            "other-namespace": "PUBLISHED",
        }, rows
        assert "another row's job id" in str(rows["forged"][2])
        data = await redis.hget(f"{prefix}:q:{victim_id}", "data")
        assert json.loads(str(data)) == {"n": 1}  # the victim's own job, not the forger's
    finally:
        await delete_prefix(redis, prefix)
