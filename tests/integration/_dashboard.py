"""A small cluster with real data for the dashboard tests, and the dashboard served over HTTP.

Two Runtimes (replicas A and B) declare the same schedules on one fresh database and run them:
one succeeds every second, one fails with HTML in its error, one holds its lease RUNNING, one has
a hostile name. The outbox gets a published row, a DEAD row (a relay whose publisher refuses
the message) and a pending one; a BullMQ queue under a unique prefix gets a real job. One cron
schedule gets 24 hours of history with exactly three hourly ticks missing.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
import uvicorn

from sdcore import Runtime
from sdcore.outbox import Outbox, OutboxRelay, PostgresOutboxStore
from sdcore.scheduling import Tick
from sdcore.testing import RecordingPublisher

TOKEN = "test-operator-token-0123456789"
HOSTILE = "<img src=x onerror=alert(1)>"
REDIS_URL = os.environ.get("SDCORE_TEST_REDIS_URL", "redis://127.0.0.1:6379")
CHROMIUM = "/usr/bin/chromium"


def chromium() -> str:
    """The browser's path; skip without it, except in CI where a missing browser fails."""
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: .ci/run installs Debian's chromium", False)
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium); CI installs it")
    return CHROMIUM


@dataclass(slots=True)
class Cluster:
    """What the tests look at."""

    dsn: str
    a: Runtime
    b: Runtime
    prefix: str
    cron_minute: int
    dead_id: int


def _declare(runtime: Runtime, started: asyncio.Event) -> None:
    scheduler = runtime.scheduler

    @scheduler.interval(1_000, name="heartbeat-every-second")
    async def ok(tick: Tick) -> None:
        return None

    @scheduler.interval(2_000, name="flaky-export")
    async def flaky(tick: Tick) -> None:
        raise RuntimeError("export failed: <b>bold</b> & <script>alert('x')</script>")

    @scheduler.initial(name="slow-rebuild", lease_ms=60_000)
    async def slow(tick: Tick) -> None:
        started.set()
        await asyncio.sleep(600)

    @scheduler.interval(60_000, name=HOSTILE)
    async def hostile(tick: Tick) -> None:
        return None


async def _history(dsn: str, minute: int) -> None:
    """24 hours of an hourly cron schedule's runs, minus three ticks (replica B declares it)."""
    now = datetime.now(UTC)
    created = now - timedelta(hours=30)
    top = now.replace(minute=0, second=0, microsecond=0)
    instants = [top - timedelta(hours=h) + timedelta(minutes=minute) for h in range(25)]
    due = [t for t in instants if top - timedelta(hours=23) <= t < now]
    skipped = sorted(due)[2:5]
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            "UPDATE sdcore_schedules SET created_at = %s WHERE name = 'hourly-report'", (created,)
        )
        for at in due:
            if at in skipped:
                continue
            await conn.execute(
                "INSERT INTO sdcore_schedules_runs (schedule, run_key, source, scheduled_at,"
                " attempt, fencing_token, replica_id, host, pid, started_at, finished_at, status)"
                " VALUES ('hourly-report', %s, 'tick', %s, 1, 1, %s, 'replica-b', 4242, %s, %s,"
                " 'SUCCESS')",
                (
                    at.strftime("%Y-%m-%dT%H:%M:%SZ"),
                    at,
                    uuid.uuid4(),
                    at + timedelta(seconds=1),
                    at + timedelta(seconds=3),
                ),
            )


async def _outbox(a: Runtime) -> int:
    outbox = Outbox(max_attempts=1)
    async with a.pool.connection() as conn, conn.transaction():
        for key, name in (("welcome-1", "welcome"), ("poison-1", "<i>poison</i>")):
            await outbox.enqueue_once(
                conn, idempotency_key=key, queue="emails", name=name, payload={"to": "x"}
            )
    publisher = RecordingPublisher()
    publisher.fail.add("<i>poison</i>")
    async with OutboxRelay(
        PostgresOutboxStore(a.pool, outbox=outbox), publisher, poll_interval_ms=50
    ):
        deadline = time.monotonic() + 20
        while True:
            async with a.pool.connection() as conn:
                cur = await conn.execute("SELECT id FROM outbox WHERE status = 'DEAD'")
                row = await cur.fetchone()
            if row is not None:
                break
            assert time.monotonic() < deadline, "the poison row never became DEAD"
            await asyncio.sleep(0.1)
    async with a.pool.connection() as conn, conn.transaction():
        await outbox.enqueue_once(
            conn, idempotency_key="later-1", queue="emails", name="digest", payload={}
        )
    return int(row[0])


async def _queue(prefix: str) -> None:
    from sdcore.outbox import OutboxMessage
    from sdcore.queues import BullMQPublisher

    async with BullMQPublisher.from_url(REDIS_URL, prefix=prefix) as publisher:
        message = OutboxMessage(
            id=1,
            idempotency_key="q-1",
            queue="thumbnails",
            name="resize",
            job_id="sd2-test-job-1",
            payload={"image": 1},
            options={},
            attempts=1,
            max_attempts=3,
            created_at=datetime.now(UTC),
        )
        results = await publisher.publish([message])
        assert results == [None]


async def _drop_prefix(prefix: str) -> None:
    from redis.asyncio import Redis

    async with Redis.from_url(REDIS_URL) as client:
        keys = [key async for key in client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await client.delete(*keys)


@asynccontextmanager
async def cluster(dsn: str) -> AsyncIterator[Cluster]:
    """Start replicas A and B with data; stop them (and drop the Redis keys) after."""
    started = asyncio.Event()
    a = Runtime(database_url=dsn, grace_period_ms=200, relay=None)
    b = Runtime(database_url=dsn, grace_period_ms=200, relay=None)
    _declare(a, started)
    _declare(b, asyncio.Event())
    minute = (datetime.now(UTC).minute + 30) % 60

    @b.scheduler.cron(f"{minute} * * * *", name="hourly-report")
    async def hourly(tick: Tick) -> None:
        return None

    prefix = f"sdtest-dash-{uuid.uuid4().hex[:8]}"
    async with a, b:
        await _history(dsn, minute)
        dead = await _outbox(a)
        await _queue(prefix)
        await asyncio.wait_for(started.wait(), 30)
        await _wait_for_runs(dsn)
        try:
            yield Cluster(dsn=dsn, a=a, b=b, prefix=prefix, cron_minute=minute, dead_id=dead)
        finally:
            await _drop_prefix(prefix)


async def _wait_for_runs(dsn: str) -> None:
    deadline = time.monotonic() + 30
    query = (
        "SELECT count(DISTINCT schedule) FROM sdcore_schedules_runs"
        " WHERE schedule IN ('heartbeat-every-second', 'flaky-export') AND finished_at IS NOT NULL"
    )
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        while True:
            row = await (await conn.execute(query)).fetchone()
            if row is not None and row[0] == 2:
                return
            assert time.monotonic() < deadline, "the schedules never ran"
            await asyncio.sleep(0.2)


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    """Serve an ASGI app with uvicorn on a free port; yield its base URL."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        assert not task.done(), "uvicorn stopped at start"
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 10) -> None:
    """Wait until ``check()`` is true, failing with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)
