"""``acquire_many`` when the database answers late or the caller is cancelled (real PostgreSQL).

The same promises as ``acquire`` (tests/integration/test_lease_deadlines.py), for a batch: an
answer that used more than half a lease is confirmed before it is reported, an answer later
than the shortest lease is never an owner, and a caller cancelled after its batch committed
gives every row it won back (FAIL) before the cancellation propagates.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import psycopg
import pytest

from sdcore.job_scheduler import LEASE_CLOCK_MARGIN, JobAcquired, JobSchedulerService
from tests.integration.test_lease_deadlines import Proxy, _service, _sleep_trigger, _sql, _status


def _batch(code: str, lease_ms: int, count: int = 2) -> list[dict[str, object]]:
    return [{"code": code, "run_key": f"r{i}", "lease_ms": lease_ms} for i in range(count)]


@pytest.mark.slow
async def test_a_batch_that_used_more_than_half_its_lease_is_confirmed_first(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    """Two inserts sleeping 0.8 s each: the answer comes ~1.6 s after sending, past half of a
    3 s lease. Each won lease is confirmed by a heartbeat (modified_at moves) before it is
    reported, so every reported lease has at least half its time left."""
    await _sleep_trigger(pg_dsn, "AFTER", "INSERT", "slow", 0.8)
    valid = 3.0 * (1 - LEASE_CLOCK_MARGIN)
    async with _service(pg_dsn, "slow") as slow:
        sent = time.monotonic()
        results = await slow.acquire_many(_batch("confirm", 3_000))
        answered = time.monotonic()
    assert answered - sent > valid / 2, "the trigger did not slow the batch down"
    assert all(isinstance(result, JobAcquired) for result in results)
    for result in results:
        assert isinstance(result, JobAcquired)
        # The deadline runs from the confirming heartbeat, not from the batch's send time.
        assert result.lease.deadline - sent > valid + 1.0
    rows = await _sql(
        pg_dsn, "SELECT modified_at - created_at FROM job_scheduler WHERE code = 'confirm'"
    )
    assert len(rows) == 2
    assert all(age.total_seconds() > 0.7 for (age,) in rows), "no heartbeat confirmed the rows"


@pytest.mark.slow
async def test_a_batch_answered_after_its_lease_is_never_an_owner(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    """Two inserts sleeping 1.5 s each, lease 2 s: the batch is abandoned at its lease and
    reports nothing acquired; another replica takes both keys once the lease has passed."""
    await _sleep_trigger(pg_dsn, "AFTER", "INSERT", "slow", 1.5)
    options = _batch("late-many", 2_000)
    async with _service(pg_dsn, "slow") as slow, _service(pg_dsn, "fast") as fast:
        slow_task = asyncio.create_task(slow.acquire_many(options))
        taken: set[int] = set()
        async with asyncio.timeout(20):
            while len(taken) < 2:
                await asyncio.sleep(0.1)
                for i, result in enumerate(await fast.acquire_many(options)):
                    if result.acquired:
                        taken.add(i)
            slow_results = await slow_task
    assert [result.acquired for result in slow_results] == [False, False]
    assert taken == {0, 1}


async def test_a_caller_cancelled_after_its_batch_committed_leaves_fail_rows(
    jobs: JobSchedulerService, pg_dsn: str
) -> None:
    """The batch commits but its answer is held by the proxy; the caller is cancelled then.
    Before the cancellation propagates it reads its rows back by its tokens and marks them FAIL,
    so another replica acquires them at once instead of waiting out a 60 s lease."""
    options = _batch("cancelled-many", 60_000, count=3)
    async with Proxy(pg_dsn) as proxy, _service(proxy.dsn, "cancelled-owner") as owner:
        # One connection open through the proxy, the batch acquire prepared on it: what is held
        # below is the acquire's execution, not its Parse.
        await owner.acquire_many(_batch("cancelled-warm-up", 60_000, count=3))
        proxy.hold()
        task = asyncio.create_task(owner.acquire_many(options))
        async with asyncio.timeout(10):
            while await _status(pg_dsn, "cancelled-many") != "RUNNING":
                await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.sleep(0.3)
        proxy.release()
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(15):
                await task
    rows = await _sql(pg_dsn, "SELECT status FROM job_scheduler WHERE code = 'cancelled-many'")
    assert sorted(status for (status,) in rows) == ["FAIL", "FAIL", "FAIL"]
    again = await jobs.acquire_many(options)
    assert all(result.acquired for result in again), "a cancelled batch left RUNNING rows"


async def test_the_batch_acquires_read_a_key_through_its_index_once(schema_dsn: str) -> None:
    """``acquire_many`` and ``acquire_attempt_many`` look each key up in the lock_key index once
    (``probe``): the takeover lock finds a takeable row again by primary key, and the insert
    takes the keys ``probe`` found no row for without reading again. (They probed the index
    twice per key: a batch of 300 losers took 5.8 -> 4.8 ms.) On a table analyzed before a
    burst of new keys, no acquire statement reads the table whole — the single-key ones
    included, which keep their two lookups (one ``probe`` CTE more cost a fresh acquire more
    executor start-up than the lookup it saved: 0.59-0.60 -> 0.61-0.65 ms per call in
    pgbench)."""
    from psycopg import sql

    from sdcore.job_scheduler._sql import LeaseStatements, TickBatchStatements, TickStatements

    table = sql.Identifier("job_scheduler")
    lease, ticks = LeaseStatements.render(table), TickStatements.render(table)
    batch = TickBatchStatements.render(table)
    n = 300
    keys = [f"new-{i:04d}" for i in range(n)]
    tokens = [str(uuid.uuid4()) for _ in range(n)]
    token = str(uuid.uuid4())
    single = ("k5", "i5", "c", None, "SCHEDULE", "r5", token, 60_000)
    many = (keys, keys, ["c"] * n, [None] * n, ["SCHEDULE"] * n, keys, tokens, [60_000] * n)
    attempts_many = (
        ",".join(keys), ",".join(keys), ["c"] * n, ",".join(tokens),
        None, None, None, "SCHEDULE", None, "r", None, 60_000, None, 3, None, 1000.0,
    )  # fmt: skip
    cases: tuple[tuple[str, bytes, tuple[object, ...]], ...] = (
        ("acquire", lease.acquire, single),
        ("acquire_attempt", ticks.acquire_attempt, (*single, 3, 1000.0)),
        ("acquire_many", lease.acquire_many, many),
        ("acquire_attempt_many", batch.acquire_attempt_many, attempts_many),
    )
    async with await psycopg.AsyncConnection.connect(schema_dsn, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO job_scheduler (lock_key, idempotency_key, code, type, run_key, status,"
            " owner_token) SELECT 'k' || g, 'i' || g, 'c', 'SCHEDULE', 'r' || g,"
            " CASE WHEN g % 2 = 0 THEN 'FAIL' ELSE 'SUCCESS' END, gen_random_uuid()"
            " FROM generate_series(1, 20000) AS g"
        )
        await conn.execute("ANALYZE job_scheduler")
        # new keys, and keys with a row: SUCCESS (never takeable), FAIL (takeable)
        for key_set in (keys, [f"k{i}" for i in range(1, n + 1)]):
            for name, query, params in cases:
                if name.endswith("_many"):
                    params = _with_keys(name, params, key_set)
                elif key_set is not keys:
                    params = ("k4", *params[1:])  # a FAIL row: the takeover path
                async with conn.transaction(force_rollback=True):
                    cur = await conn.execute(
                        b"EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) " + query, params
                    )
                    plan = "\n".join(str(r[0]) for r in await cur.fetchall())
                if name.endswith("_many"):
                    assert plan.count("using job_scheduler_lock_key_key") == 1, (name, plan)
                assert "Seq Scan on job_scheduler" not in plan, (name, plan)


def _with_keys(name: str, params: tuple[object, ...], keys: list[str]) -> tuple[object, ...]:
    if name == "acquire_many":
        return (keys, keys, *params[2:5], keys, *params[6:])
    joined = ",".join(keys)
    return (joined, joined, *params[2:])
