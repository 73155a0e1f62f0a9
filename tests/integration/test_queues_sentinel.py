"""Queues on Redis Sentinel: the relay and the workers follow a failover without a restart.

Each test starts its own group (a master, a replica, three sentinels on spare loopback ports)
and removes it at the end; the shared Redis is never touched.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest
import redis
from psycopg_pool import AsyncConnectionPool

from sdcore.outbox import Outbox, OutboxRelay, PostgresOutboxStore
from sdcore.queues import BullMQPublisher, Job, Processor, Workers
from tests._servers import sentinel_group

ROWS = 5_000
QUEUE = "sentinel-mails"
PREFIX = "bull"


async def _produce(pg_dsn: str, outbox: Outbox) -> None:
    """Commit ``ROWS`` outbox rows in 40 transactions spread over about two seconds."""
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        for batch in range(40):
            async with conn.transaction():
                for index in range(ROWS // 40):
                    number = batch * (ROWS // 40) + index
                    await outbox.enqueue_once(
                        conn,
                        idempotency_key=f"mail-{number}",
                        queue=QUEUE,
                        name="send",
                        payload={"n": number},
                    )
            await asyncio.sleep(0.05)


async def _statuses(pg_dsn: str) -> dict[str, int]:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        cur = await conn.execute("SELECT status, count(*) FROM outbox GROUP BY status")
        return {str(status): int(count) for status, count in await cur.fetchall()}


async def test_the_relay_follows_a_sentinel_failover_without_losing_or_doubling_a_job(
    pg_dsn: str,
) -> None:
    # SENTINEL FAILOVER leaves the old master running: it acknowledges writes until the sentinels
    # demote it (their INFO period, ten seconds). With one replica, the publisher's WAIT 1 fails
    # on it at once (its replica left to be promoted), and on the new master until the old one
    # has rejoined as its replica: rows wait in the outbox, none is marked on a lost write.
    outbox = Outbox()
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await outbox.ensure_schema(conn)
    samples: list[tuple[float, int]] = []
    with sentinel_group(replicas=1) as group:
        first_master = group.master_port()
        async with (
            AsyncConnectionPool(pg_dsn, min_size=1, max_size=4, open=False) as pool,
            BullMQPublisher.from_url(group.url, socket_timeout_s=2.0, connect_timeout_s=1.0) as pub,
        ):
            await pool.open()
            async with _relay(pool, outbox, pub) as relay:
                producer = asyncio.create_task(_produce(pg_dsn, outbox))
                while relay.state.published < ROWS // 4:
                    await asyncio.sleep(0.01)
                failover_at = time.monotonic()
                await asyncio.to_thread(group.failover)
                deadline = failover_at + 25
                while relay.state.published < ROWS and time.monotonic() < deadline:
                    samples.append((time.monotonic(), relay.state.published))
                    await asyncio.sleep(0.01)
                await producer
        new_master = group.master_port()
        with redis.Redis(port=new_master, decode_responses=True) as client:
            waiting = client.lrange(f"{PREFIX}:{QUEUE}:wait", 0, -1)
            jobs = list(client.scan_iter(f"{PREFIX}:{QUEUE}:sd*", count=1000))
    print(  # noqa: T201 - the recovery time, shown with -s
        f"\nSENTINEL FAILOVER (1 replica) at a quarter: publishing stood still at most"
        f" {_stalls(samples):.3f} s; all {ROWS} published {samples[-1][0] - failover_at:.3f} s"
        " after it"
    )
    assert new_master != first_master
    assert await _statuses(pg_dsn) == {"PUBLISHED": ROWS}
    assert len(waiting) == ROWS  # every job once in the wait list: nothing lost, none twice
    assert len(set(waiting)) == ROWS
    assert len(jobs) == ROWS


def _relay(
    pool: AsyncConnectionPool[Any], outbox: Outbox, publisher: BullMQPublisher
) -> OutboxRelay:
    return OutboxRelay(
        PostgresOutboxStore(pool, outbox=outbox),
        publisher,
        batch_size=50,
        poll_interval_ms=50,
        unavailable_max_ms=500,
    )


class Collector(Processor):
    """Records the job id of every run."""

    queue = QUEUE
    concurrency = 20
    # Short, so a job whose completion the dead master took with it runs again within seconds.
    lock_duration_ms = 2_000

    def __init__(self) -> None:
        self.runs: list[str] = []

    async def process(self, job: Job) -> Any:
        self.runs.append(str(job.id))
        return None


# After the master is killed, redis-py's pools (reached through ``get_connection``) can leave up to
# about 76 connections to a node unclosed, a count that depends on how the failover plays out; who
# drops them is not found yet. collected_here collects them before the test ends, so their warnings
# are this test's, and ignored here.
@pytest.mark.usefixtures("collected_here")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_relay_and_workers_follow_a_killed_master_and_run_every_job_once_published(
    pg_dsn: str,
) -> None:
    # The sentinels notice the dead master after down-after-milliseconds, promote the replica
    # with the most data (every job the publisher's WAIT 1 confirmed) and re-point the other:
    # the new master has a replica again about a second after the promotion.
    outbox = Outbox()
    samples: list[tuple[float, int]] = []
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await outbox.ensure_schema(conn)
    collector = Collector()
    with sentinel_group(replicas=2) as group:
        first_master = group.master_port()
        async with (
            AsyncConnectionPool(pg_dsn, min_size=1, max_size=4, open=False) as pool,
            BullMQPublisher.from_url(group.url, socket_timeout_s=2.0, connect_timeout_s=1.0) as pub,
            Workers([collector], redis_url=group.url, stalled_interval_ms=1_000) as workers,
        ):
            await pool.open()
            await asyncio.wait_for(workers.wait_ready(), 10)
            async with _relay(pool, outbox, pub) as relay:
                producer = asyncio.create_task(_produce(pg_dsn, outbox))
                while len(set(collector.runs)) < ROWS // 4:
                    await asyncio.sleep(0.01)
                killed_at = time.monotonic()
                next(n for n in group.nodes if n.port == first_master).crash()
                deadline = killed_at + 20
                while len(set(collector.runs)) < ROWS and time.monotonic() < deadline:
                    samples.append((time.monotonic(), relay.state.published))
                    await asyncio.sleep(0.01)
                recovered = time.monotonic() - killed_at
                await producer
        new_master = group.master_port()
        with redis.Redis(port=new_master, decode_responses=True) as client:
            completed = client.zcard(f"{PREFIX}:{QUEUE}:completed")
            jobs = list(client.scan_iter(f"{PREFIX}:{QUEUE}:sd*", count=1000))
    ran = set(collector.runs)
    print(  # noqa: T201 - the recovery time, shown with -s
        f"\nmaster killed (2 replicas) at a quarter: publishing stood still at most"
        f" {_stalls(samples):.3f} s; every job ran {recovered:.3f} s after the kill;"
        f" {len(collector.runs) - len(ran)} ran twice (at-least-once)"
    )
    assert new_master != first_master
    assert await _statuses(pg_dsn) == {"PUBLISHED": ROWS}
    assert len(ran) == ROWS
    assert len(jobs) == ROWS  # one job per row: nothing lost, none twice
    assert completed == ROWS


def _stalls(samples: list[tuple[float, int]]) -> float:
    """The longest time between two increases of the published count."""
    longest = 0.0
    since = samples[0][0] if samples else 0.0
    last = samples[0][1] if samples else 0
    for at, published in samples:
        if published != last:
            longest = max(longest, at - since)
            since, last = at, published
    return longest
