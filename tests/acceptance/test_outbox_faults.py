"""The outbox's fault campaign: relays SIGKILLed in a loop and Redis crashed, while rows commit.

Two loops each start a relay process (its own pool and BullMQ publisher), let it run for a random
0.2–1.2 s and ``kill -9`` it; a writer commits rows in small transactions meanwhile; Redis (a
private server with ``appendfsync always``, so an acknowledged write survives a crash) is
``kill -9``-ed and restarted twice. Then a clean relay drains the outbox and a consumer runs
every job: committed = processed, every key once, one job per key in Redis (RELIABILITY.md
OB-01/OB-02 under load).
"""

from __future__ import annotations

import asyncio
import random
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis.asyncio as aioredis
from psycopg_pool import AsyncConnectionPool

from sdcore.outbox import Outbox, OutboxRelay, PostgresOutboxStore
from sdcore.queues import BullMQPublisher, Job, Processor, Workers
from tests._servers import RedisServer
from tests._servers import redis_server as private_redis_server

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

_RELAY = """
import asyncio, sys
from psycopg_pool import AsyncConnectionPool
from sdcore.outbox import OutboxRelay, PostgresOutboxStore
from sdcore.queues import BullMQPublisher

async def main(dsn, url, prefix):
    async with AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False) as pool:
        await pool.open()
        publisher = BullMQPublisher.from_url(
            url, prefix=prefix, socket_timeout_s=1.0, connect_timeout_s=1.0, check_server=False
        )
        relay = OutboxRelay(
            PostgresOutboxStore(pool), publisher, batch_size=7, poll_interval_ms=50, claim_ms=600,
            unavailable_max_ms=300,
        )
        async with publisher, relay:
            print("up", flush=True)
            await asyncio.Event().wait()

asyncio.run(main(*sys.argv[1:]))
"""


def _report(line: str) -> None:
    print(line)  # noqa: T201


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with private_redis_server(tmp_path, durable=True) as server:
        yield server


class Ledger(Processor):
    """The consumer: counts every run of every job (by the key in its data)."""

    queue = "campaign"

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()
        self.ids: dict[str, set[str]] = {}

    async def process(self, job: Job) -> Any:
        key = job.data["key"]
        self.runs[key] += 1
        self.ids.setdefault(key, set()).add(job.id)
        return None


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=4, open=False) as pool:
        await pool.open()
        await Outbox().ensure_schema(pool)
        yield pool


async def test_relays_killed_in_a_loop_and_redis_crashed_lose_and_double_nothing(
    pool: AsyncConnectionPool[Any], pg_dsn: str, redis_server: RedisServer, tmp_path: Path
) -> None:
    script = tmp_path / "relay.py"
    script.write_text(_RELAY)
    prefix = f"campaign-{uuid.uuid4().hex[:8]}"
    rng = random.Random(9)
    outbox = Outbox()
    committed: list[str] = []
    kills = 0
    restarts = 0
    stop = asyncio.Event()

    async def writer() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            batch = 0
            while not stop.is_set():
                keys = [f"order:{batch}:{i}" for i in range(rng.randint(1, 4))]
                async with conn.transaction():
                    for key in keys:
                        await outbox.enqueue_once(
                            conn,
                            idempotency_key=key,
                            queue="campaign",
                            name="n",
                            payload={"key": key},
                        )
                committed.extend(keys)
                batch += 1
                await asyncio.sleep(rng.uniform(0.005, 0.04))

    async def relay_loop() -> None:
        nonlocal kills
        while not stop.is_set():
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                str(script),
                pg_dsn,
                redis_server.url,
                prefix,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
                cwd=ROOT,
            )
            await asyncio.sleep(rng.uniform(0.2, 1.2) + 0.6)  # ~0.6 s to import and connect
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            kills += 1

    async def redis_crasher() -> None:
        nonlocal restarts
        for _ in range(2):
            await asyncio.sleep(3.0)
            await asyncio.to_thread(redis_server.crash)
            await asyncio.sleep(0.5)
            await asyncio.to_thread(redis_server.start)
            restarts += 1

    tasks = [asyncio.create_task(c) for c in (writer(), relay_loop(), relay_loop())]
    await asyncio.wait_for(redis_crasher(), 60)
    deadline = time.monotonic() + 60
    while kills < 16 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert kills >= 16

    ledger = Ledger()
    async with BullMQPublisher.from_url(redis_server.url, prefix=prefix) as publisher:
        drain = OutboxRelay(PostgresOutboxStore(pool), publisher, claim_ms=600)
        await asyncio.sleep(0.7)  # claims of killed relays expire
        deadline = time.monotonic() + 30
        while (await drain.stats()).pending:
            assert time.monotonic() < deadline, await drain.stats()
            if not await drain.run_once():
                await asyncio.sleep(0.1)
        async with Workers([ledger], redis_url=redis_server.url, prefix=prefix):
            deadline = time.monotonic() + 60
            while sum(ledger.runs.values()) < len(committed):
                assert time.monotonic() < deadline, (len(ledger.runs), len(committed))
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # a duplicate would show up now
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        head = f"{prefix}:campaign:"
        jobs = [
            k
            async for k in client.scan_iter(match=f"{head}sd*", count=1000)
            if ":" not in k[len(head) :]
        ]
    finally:
        await client.aclose()
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT status, count(*) FROM outbox GROUP BY status")
        statuses = dict(await cur.fetchall())
        # Rows claimed more than once: a relay died (or Redis did) while holding them.
        cur = await conn.execute("SELECT count(*) FROM outbox WHERE attempts > 1")
        reclaimed = (await cur.fetchone() or (0,))[0]
    duplicates = sum(n - 1 for n in ledger.runs.values())
    lost = len(set(committed) - set(ledger.runs))
    _report(
        f"outbox campaign: relay_kills={kills} redis_crashes={restarts} committed={len(committed)}"
        f" processed={len(ledger.runs)} duplicates={duplicates} lost={lost}"
        f" redis_jobs={len(jobs)} rows_claimed_again_after_a_fault={reclaimed}"
    )
    assert restarts == 2
    assert statuses == {"PUBLISHED": len(committed)}
    assert set(ledger.runs) == set(committed)
    assert duplicates == 0
    assert all(len(ids) == 1 for ids in ledger.ids.values())
    assert len(jobs) == len(committed)


_RELAY_FROZEN_BEFORE_MARK = """
import asyncio, sys
from psycopg_pool import AsyncConnectionPool
from sdcore.outbox import OutboxRelay, PostgresOutboxStore
from sdcore.queues import BullMQPublisher

async def main(dsn, url, prefix):
    async with AsyncConnectionPool(dsn, min_size=1, max_size=4, open=False) as pool:
        await pool.open()
        publisher = BullMQPublisher.from_url(url, prefix=prefix, check_server=False)
        relay = OutboxRelay(
            PostgresOutboxStore(pool), publisher, batch_size=5, poll_interval_ms=50, claim_ms=1000
        )

        async def frozen(ids):  # the jobs are in Redis; the rows are not marked yet
            print("published", len(ids), flush=True)
            await asyncio.Event().wait()

        relay.store.mark_published = frozen
        async with publisher, relay:
            await asyncio.Event().wait()

asyncio.run(main(*sys.argv[1:]))
"""


async def test_a_relay_killed_between_publish_and_mark_loses_and_doubles_nothing(
    pool: AsyncConnectionPool[Any], pg_dsn: str, redis_server: RedisServer
) -> None:
    """SIGKILL right after a pipelined relay published batches and before it marked them."""
    prefix = f"kill-mark-{uuid.uuid4().hex[:8]}"
    keys = [f"order-{i}" for i in range(40)]
    async with pool.connection() as conn, conn.transaction():
        for key in keys:
            await Outbox().enqueue_once(
                conn, idempotency_key=key, queue="campaign", name="n", payload={"key": key}
            )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _RELAY_FROZEN_BEFORE_MARK, pg_dsn, redis_server.url, prefix,
        stdout=asyncio.subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
        assert line.startswith(b"published ")
        await asyncio.sleep(0.2)  # let the pipeline's other batch reach Redis too, if it will
    finally:
        proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), timeout=10)
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) FROM outbox WHERE status = 'PUBLISHED'")
        assert await cur.fetchone() == (0,)  # killed before any mark
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        before = await client.llen(f"{prefix}:campaign:wait")
        assert 5 <= before < len(keys)  # at least the frozen batch is in Redis
        publisher = BullMQPublisher(client, prefix=prefix, check_server=False)
        relay = OutboxRelay(
            PostgresOutboxStore(pool), publisher, batch_size=5, poll_interval_ms=50, claim_ms=1000
        )
        async with relay:
            deadline = time.monotonic() + 30
            while (await relay.stats()).published < len(keys):
                assert time.monotonic() < deadline, "the claims of the killed relay never expired"
                await asyncio.sleep(0.05)
        waiting = await client.lrange(f"{prefix}:campaign:wait", 0, -1)
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT job_id, status, attempts FROM outbox ORDER BY id")
            rows = await cur.fetchall()
    finally:
        await client.aclose()
    assert sorted(waiting) == sorted(r[0] for r in rows)  # one job per row: none lost, none twice
    assert {r[1] for r in rows} == {"PUBLISHED"}
    assert max(r[2] for r in rows) == 2  # the re-published rows: one more attempt, same job id
