"""Poison messages and large payloads through killed relays and a restarted Redis (OB-17, OB-18).

10,000 messages of mixed sizes (most of them up to 1 KiB, a few hundred from 64 KiB to 1 MiB) go
through three relay processes with the default batch settings. A few are poison: the relay's
publisher ``os._exit()``-s on them, as a segfault or the OOM killer would end it, so no outcome is
ever recorded. Each slot restarts its relay when it dies. One relay is ``kill -9``-ed every
1.5-3 s until the rows are written, Redis was restarted and six relays were killed; a private
Redis (``appendfsync always``) is crashed and restarted twice meanwhile. Then: every good message
is in Redis exactly once, every poison is ``DEAD`` with the reason, no row is left ``PENDING``,
and no relay process's peak RSS (``VmHWM``, sampled every 50 ms) went over the documented bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
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

from sdcore.outbox import Outbox
from tests._servers import RedisServer, redis_server

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

MAX_ATTEMPTS = 4
RSS_BOUND = 256 * 1024 * 1024  # docs/benchmarks.md, "Relay memory"
MESSAGES = 10_000
LARGE = 240  # 64 KiB to 1 MiB each
POISONS = 4

_RELAY = """
import asyncio, os, sys
from psycopg_pool import AsyncConnectionPool
from sdcore.outbox import Outbox, OutboxRelay, PostgresOutboxStore
from sdcore.queues import BullMQPublisher

class DiesOnPoison:
    def __init__(self, inner):
        self.inner = inner

    async def publish(self, messages):
        if any(m.payload.get("poison") for m in messages):
            os._exit(86)  # no outcome recorded: as a segfault or the OOM killer
        return await self.inner.publish(messages)

async def main(dsn, url, prefix, max_attempts):
    async with AsyncConnectionPool(dsn, min_size=1, max_size=4, open=False) as pool:
        await pool.open()
        publisher = BullMQPublisher.from_url(
            url, prefix=prefix, socket_timeout_s=2.0, connect_timeout_s=1.0, check_server=False
        )
        relay = OutboxRelay(
            PostgresOutboxStore(pool, outbox=Outbox(max_attempts=int(max_attempts))),
            DiesOnPoison(publisher),
            poll_interval_ms=100, claim_ms=1500, unavailable_max_ms=300,
        )
        async with publisher, relay:
            await asyncio.Event().wait()

asyncio.run(main(*sys.argv[1:]))
"""


def _report(line: str) -> None:
    print(line)  # noqa: T201


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path, durable=True) as server:
        yield server


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=4, open=False) as pool:
        await pool.open()
        await Outbox().ensure_schema(pool)
        yield pool


def _peak_rss(pid: int) -> int | None:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def _sizes(rng: random.Random) -> list[int]:
    """Blob lengths: most 1 B to 1 KiB, LARGE of them 64 KiB to 1 MiB (log-uniform)."""
    sizes = [int(2 ** rng.uniform(0, 10)) for _ in range(MESSAGES - LARGE)]
    sizes += [int(2 ** rng.uniform(16, 20)) - 64 for _ in range(LARGE)]
    rng.shuffle(sizes)
    return sizes


@pytest.mark.timeout(240)  # about 40 s; the waits below fail it with the counts first
async def test_poisons_die_and_large_rows_pass_through_killed_relays_and_redis_restarts(
    pool: AsyncConnectionPool[Any], pg_dsn: str, private_redis: RedisServer, tmp_path: Path
) -> None:
    script = tmp_path / "relay.py"
    script.write_text(_RELAY)
    prefix = f"poison-{uuid.uuid4().hex[:8]}"
    rng = random.Random(17)
    outbox = Outbox(max_attempts=MAX_ATTEMPTS)
    sizes = _sizes(rng)
    poisons = set(rng.sample(range(MESSAGES), POISONS))
    written = asyncio.Event()
    stop = asyncio.Event()
    procs: dict[int, asyncio.subprocess.Process] = {}
    peaks: dict[int, int] = {}
    exits: Counter[int] = Counter()
    kills = restarts = 0

    async def writer() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            for start in range(0, MESSAGES, 50):
                async with conn.transaction():
                    for i in range(start, min(start + 50, MESSAGES)):
                        payload: dict[str, Any] = {"i": i, "b": "x" * sizes[i]}
                        if i in poisons:
                            payload["poison"] = True
                        await outbox.enqueue_once(
                            conn, idempotency_key=f"m-{i}", queue="mixed", name="n",
                            payload=payload,
                        )  # fmt: skip
        written.set()

    async def relay_slot() -> None:
        while not stop.is_set():
            proc = await asyncio.create_subprocess_exec(
                sys.executable, str(script), pg_dsn, private_redis.url, prefix,
                str(MAX_ATTEMPTS), stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL, cwd=ROOT,
            )  # fmt: skip
            procs[proc.pid] = proc
            while proc.returncode is None and not stop.is_set():
                peak = _peak_rss(proc.pid)
                if peak is not None:
                    peaks[proc.pid] = max(peaks.get(proc.pid, 0), peak)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 0.05)
            if proc.returncode is None:
                proc.send_signal(signal.SIGKILL)
                await proc.wait()
            exits[proc.returncode or 0] += 1
            del procs[proc.pid]

    async def killer() -> None:
        nonlocal kills
        while not stop.is_set():
            await asyncio.sleep(rng.uniform(1.5, 3.0))
            if procs:
                pid = rng.choice(sorted(procs))
                with contextlib.suppress(ProcessLookupError):
                    procs[pid].send_signal(signal.SIGKILL)
                    kills += 1

    async def redis_crasher() -> None:
        nonlocal restarts
        for _ in range(2):
            await asyncio.sleep(4.0)
            await asyncio.to_thread(private_redis.crash)
            await asyncio.sleep(0.5)
            await asyncio.to_thread(private_redis.start)
            restarts += 1

    async def counts() -> dict[str, int]:
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT status, count(*) FROM outbox GROUP BY status")
            return dict(await cur.fetchall())

    started = time.monotonic()
    tasks = [asyncio.create_task(c) for c in (writer(), relay_slot(), relay_slot(), relay_slot())]
    kill_task = asyncio.create_task(killer())
    await asyncio.wait_for(redis_crasher(), 60)
    # Writing the 10,000 rows (about 120 MB in the large ones) beside the rest of the suite
    # once took more than 60 s; this bound stays within the test's own timeout.
    await asyncio.wait_for(written.wait(), 150)
    deadline = time.monotonic() + 30
    while kills < 6:
        assert time.monotonic() < deadline, kills
        await asyncio.sleep(0.1)
    # The storm is over; relays still die on poisons (and restart) until each is DEAD.
    kill_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await kill_task
    deadline = time.monotonic() + 60
    while (await counts()).get("PENDING", 0):
        assert time.monotonic() < deadline, await counts()
        await asyncio.sleep(0.2)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    elapsed = time.monotonic() - started

    client = aioredis.Redis.from_url(private_redis.url, decode_responses=True)
    try:
        waiting = await client.lrange(f"{prefix}:mixed:wait", 0, -1)
    finally:
        await client.aclose()
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT idempotency_key, job_id, status, attempts, last_error FROM outbox"
        )
        rows = {r[0]: r[1:] for r in await cur.fetchall()}
    poison_keys = {f"m-{i}" for i in poisons}
    good = {k: v for k, v in rows.items() if k not in poison_keys}
    in_redis = Counter(waiting)
    peak = max(peaks.values())
    _report(
        f"outbox poison campaign: messages={len(rows)} large={LARGE} poisons={POISONS}"
        f" relay_kills={kills} poison_exits={exits[86]} redis_restarts={restarts}"
        f" relay_processes={sum(exits.values())} peak_rss_mb={peak / 1e6:.0f}"
        f" rows_claimed_again={sum(1 for v in rows.values() if v[2] > 1)}"
        f" elapsed_s={elapsed:.1f}"
    )
    assert len(rows) == MESSAGES
    assert restarts == 2
    assert {v[1] for v in good.values()} == {"PUBLISHED"}
    assert set(in_redis) == {v[0] for v in good.values()}  # every good message in Redis…
    assert max(in_redis.values()) == 1  # …exactly once
    reason = re.compile(
        r"claimed \d+ times, \d+ of them with no outcome: the relay died \(or lost its"
        r" database\) while publishing it; its job may already be in the broker"
    )
    for key in poison_keys:
        _, status, attempts, error = rows[key]
        assert status == "DEAD", (key, rows[key])
        assert attempts >= MAX_ATTEMPTS
        assert error is not None
        assert reason.fullmatch(error), error
    assert exits[86] >= POISONS  # each poison killed at least one relay that held it alone
    assert peak <= RSS_BOUND, {pid: p / 1e6 for pid, p in peaks.items()}
