"""Queues on Redis Cluster: the relay publishes, the workers run every job once, across nodes.

Each test starts its own cluster (three masters, a replica each where a failover is tested, on
spare loopback ports) and removes it at the end; the shared Redis is never touched.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import psycopg
import pytest
import redis
from psycopg_pool import AsyncConnectionPool

from sdcore.dashboard._data import queue_counts
from sdcore.outbox import Outbox, OutboxMessage, PublisherUnavailableError
from sdcore.queues import BullMQPublisher, Workers
from tests._servers import RedisClusterGroup, redis_cluster
from tests.integration import test_queues_sentinel as sentinel

pytestmark = pytest.mark.slow
ROWS = 1_500
QUEUES = ("mails", "sms", "push")
# The hash tag puts every key of every queue on one slot, as BullMQ's scripts need.
PREFIX = "{sd}"


async def _produce(pg_dsn: str, outbox: Outbox, rows: int, *, pause_s: float = 0.02) -> None:
    """Commit ``rows`` outbox rows over the queues, in 30 transactions."""
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        for batch in range(30):
            async with conn.transaction():
                for index in range(rows // 30):
                    number = batch * (rows // 30) + index
                    await outbox.enqueue_once(
                        conn,
                        idempotency_key=f"msg-{number}",
                        queue=QUEUES[number % len(QUEUES)],
                        name="send",
                        payload={"n": number},
                    )
            await asyncio.sleep(pause_s)


def _message(outbox: Outbox, number: int) -> OutboxMessage:
    """The message ``_produce`` commits as its ``number``-th row, as the relay claims it."""
    key = f"msg-{number}"
    return OutboxMessage(
        id=number + 1,
        idempotency_key=key,
        queue=QUEUES[number % len(QUEUES)],
        name="send",
        job_id=outbox.job_id(key),
        payload={"n": number},
        options={},
        attempts=1,
        max_attempts=10,
        created_at=datetime.now(UTC),
    )


def _cluster_client(group: RedisClusterGroup) -> redis.RedisCluster:
    return redis.RedisCluster(host="127.0.0.1", port=group.nodes[0].port, decode_responses=True)


class Collector(sentinel.Collector):
    """Records the job id of every run, for one of :data:`QUEUES`."""

    lock_duration_ms = 5_000

    def __init__(self, queue: str) -> None:
        super().__init__()
        self.queue = queue


async def _outbox(pg_dsn: str) -> Outbox:
    outbox = Outbox(namespace="cluster")
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await outbox.ensure_schema(conn)
    return outbox


async def test_the_relay_publishes_to_a_cluster_and_the_workers_run_every_job_once(
    pg_dsn: str,
) -> None:
    outbox = await _outbox(pg_dsn)
    collectors = [Collector(queue) for queue in QUEUES]
    with redis_cluster() as group:
        # Not the first node (the clients' startup node): the commands are routed.
        assert group.owner_of(f"{PREFIX}:{QUEUES[0]}:wait") != group.nodes[0].port
        async with (
            AsyncConnectionPool(pg_dsn, min_size=1, max_size=4, open=False) as pool,
            BullMQPublisher.from_url(group.url, prefix=PREFIX) as publisher,
            Workers(collectors, redis_url=group.url, prefix=PREFIX) as workers,
        ):
            await pool.open()
            await asyncio.wait_for(workers.wait_ready(), 15)
            assert workers.server is not None  # the masters' settings were read
            async with sentinel._relay(pool, outbox, publisher):
                await _produce(pg_dsn, outbox, ROWS)
                deadline = time.monotonic() + 60
                while (
                    sum(len(set(c.runs)) for c in collectors) < ROWS and time.monotonic() < deadline
                ):
                    await asyncio.sleep(0.05)
            # Published again (a relay that crashed before marking them): nothing is added.
            again = [_message(outbox, n) for n in range(30)]
            assert await publisher.publish(again) == [None] * 30
        with _cluster_client(group) as client:
            completed = {q: client.zcard(f"{PREFIX}:{q}:completed") for q in QUEUES}
            waiting = {q: client.llen(f"{PREFIX}:{q}:wait") for q in QUEUES}
    assert await sentinel._statuses(pg_dsn) == {"PUBLISHED": ROWS}
    runs = [run for c in collectors for run in c.runs]
    assert len(runs) == ROWS  # every job ran, none twice
    assert len(set(runs)) == ROWS
    assert sum(completed.values()) == ROWS
    assert waiting == dict.fromkeys(QUEUES, 0)


async def test_a_prefix_without_a_hash_tag_is_refused_by_name_and_a_tagged_one_is_shown() -> None:
    with redis_cluster() as group:
        refusal = "on Redis Cluster the BullMQ key prefix must hold a hash tag, e.g. '{bull}'"
        with pytest.raises(ValueError, match=refusal):
            Workers([Collector("mails")], redis_url=group.url, prefix="bull")
        with pytest.raises(ValueError, match=refusal):
            BullMQPublisher.from_url(group.url)  # the default prefix, "bull"
        async with BullMQPublisher.from_url(group.url, prefix="app:{bull}") as publisher:
            assert await publisher.publish([_message(Outbox(namespace="cluster"), 1)]) == [None]
        # No replica: WAIT 1 on the slot's master says 0, and the batch counts as unpublished.
        async with BullMQPublisher.from_url(
            group.url, prefix="app:{bull}", min_replicas=1, replica_timeout_ms=100
        ) as publisher:
            with pytest.raises(PublisherUnavailableError, match="0 of 1 replica"):
                await publisher.publish([_message(Outbox(namespace="cluster"), 1)])
        # The dashboard finds the queues on the master of the prefix's slot.
        [row] = await queue_counts(group.url, "app:{bull}")
        assert (row.name, row.counts["waiting"]) == (QUEUES[1], 1)


async def test_the_relay_follows_a_cluster_failover_without_losing_or_doubling_a_job(
    pg_dsn: str,
) -> None:
    # CLUSTER FAILOVER on a replica: the master stops taking writes, the replica catches up,
    # then takes over its slots; the publisher's next command gets MOVED (or a connection
    # error) and the client re-reads the slot map. The new master never loaded bullmq's
    # scripts: the publisher loads them again on NOSCRIPT. WAIT 1 holds the rows back until
    # the old master has rejoined as the new one's replica.
    outbox = await _outbox(pg_dsn)
    collectors = [Collector(queue) for queue in QUEUES]
    samples: list[tuple[float, int]] = []
    with redis_cluster(replicas=1) as group:
        master = group.owner_of(f"{PREFIX}:{QUEUES[0]}:wait")
        replica = group.replica_of(master)
        async with (
            AsyncConnectionPool(pg_dsn, min_size=1, max_size=4, open=False) as pool,
            BullMQPublisher.from_url(
                group.url, prefix=PREFIX, socket_timeout_s=2.0, min_replicas=1
            ) as pub,
            Workers(collectors, redis_url=group.url, prefix=PREFIX) as workers,
        ):
            await pool.open()
            await asyncio.wait_for(workers.wait_ready(), 15)
            async with sentinel._relay(pool, outbox, pub) as relay:
                producer = asyncio.create_task(_produce(pg_dsn, outbox, ROWS, pause_s=0.05))
                while relay.state.published < ROWS // 4:
                    await asyncio.sleep(0.01)
                failover_at = time.monotonic()
                await asyncio.to_thread(group.failover, replica)
                deadline = failover_at + 30
                while (
                    sum(len(set(c.runs)) for c in collectors) < ROWS and time.monotonic() < deadline
                ):
                    samples.append((time.monotonic(), relay.state.published))
                    await asyncio.sleep(0.01)
                await producer
        assert group.owner_of(f"{PREFIX}:{QUEUES[0]}:wait") == replica
        with _cluster_client(group) as client:
            jobs = sum(len(list(client.scan_iter(f"{PREFIX}:{q}:sd*", count=1000))) for q in QUEUES)
    runs = [run for c in collectors for run in c.runs]
    print(  # noqa: T201 - the recovery time, shown with -s
        f"\nCLUSTER FAILOVER at a quarter: publishing stood still at most"
        f" {sentinel._stalls(samples):.3f} s;"
        f" every job ran {samples[-1][0] - failover_at:.3f} s after it;"
        f" {len(runs) - len(set(runs))} ran twice (at-least-once)"
    )
    assert await sentinel._statuses(pg_dsn) == {"PUBLISHED": ROWS}
    assert len(set(runs)) == ROWS
    assert jobs == ROWS  # one job per row: nothing lost, none twice


async def test_relay_and_workers_follow_a_killed_master_and_lose_no_published_job(
    pg_dsn: str,
) -> None:
    # The cluster promotes a replica of the killed master after cluster-node-timeout (2 s)
    # and moves its other replica under it. With min_replicas=1 every batch a row was marked
    # published for is on a replica too, so on the promoted one.
    outbox = await _outbox(pg_dsn)
    collectors = [Collector(queue) for queue in QUEUES]
    samples: list[tuple[float, int]] = []
    with redis_cluster(replicas=2) as group:
        master = group.owner_of(f"{PREFIX}:{QUEUES[0]}:wait")
        async with (
            AsyncConnectionPool(pg_dsn, min_size=1, max_size=4, open=False) as pool,
            BullMQPublisher.from_url(
                group.url, prefix=PREFIX, socket_timeout_s=2.0, min_replicas=1
            ) as pub,
            Workers(
                collectors, redis_url=group.url, prefix=PREFIX, stalled_interval_ms=1_000
            ) as workers,
        ):
            await pool.open()
            await asyncio.wait_for(workers.wait_ready(), 15)
            async with sentinel._relay(pool, outbox, pub) as relay:
                producer = asyncio.create_task(_produce(pg_dsn, outbox, ROWS, pause_s=0.05))
                while relay.state.published < ROWS // 4:
                    await asyncio.sleep(0.01)
                killed_at = time.monotonic()
                next(n for n in group.nodes if n.port == master).crash()
                deadline = killed_at + 40
                while (
                    sum(len(set(c.runs)) for c in collectors) < ROWS and time.monotonic() < deadline
                ):
                    samples.append((time.monotonic(), relay.state.published))
                    await asyncio.sleep(0.01)
                recovered = time.monotonic() - killed_at
                await producer
        new_master = group.owner_of(f"{PREFIX}:{QUEUES[0]}:wait")
        with _cluster_client(group) as client:
            jobs = sum(len(list(client.scan_iter(f"{PREFIX}:{q}:sd*", count=1000))) for q in QUEUES)
    runs = [run for c in collectors for run in c.runs]
    print(  # noqa: T201 - the recovery time, shown with -s
        f"\nmaster killed (2 replicas) at a quarter: publishing stood still at most"
        f" {sentinel._stalls(samples):.3f} s; every job ran {recovered:.3f} s after the kill;"
        f" {len(runs) - len(set(runs))} ran twice (at-least-once)"
    )
    assert new_master != master
    assert await sentinel._statuses(pg_dsn) == {"PUBLISHED": ROWS}
    assert len(set(runs)) == ROWS
    assert jobs == ROWS  # one job per row: nothing lost, none twice
