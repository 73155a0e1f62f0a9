"""``acquire_many`` when the database answers late or the caller is cancelled (real PostgreSQL).

The same promises as ``acquire`` (tests/integration/test_lease_deadlines.py), for a batch: an
answer that used more than half a lease is confirmed before it is reported, an answer later
than the shortest lease is never an owner, and a caller cancelled after its batch committed
gives every row it won back (FAIL) before the cancellation propagates.
"""

from __future__ import annotations

import asyncio
import time

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
        await owner.statuses(["warm-up"])  # one connection open through the proxy
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
