"""Claims that must not stall the outbox: a message that kills its relay, a batch too big to send.

Both with real processes or sockets: a relay process that dies (``os._exit``, as a segfault or the
OOM killer would end it) inside ``publish()``, and a private redis-server behind a proxy that
passes the client's bytes slowly, so that a large pipeline cannot be written within the
publisher's socket timeout (RELIABILITY.md OB-17, OB-18).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis.asyncio as aioredis
from psycopg_pool import AsyncConnectionPool

from sdcore.outbox import (
    Outbox,
    OutboxDatabaseError,
    OutboxRelay,
    PostgresOutboxStore,
    PublisherUnavailableError,
)
from sdcore.queues import BullMQPublisher
from tests._servers import redis_server

ROOT = Path(__file__).resolve().parents[2]

_CRASHING_RELAY = """
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

async def main(dsn, url, prefix):
    async with AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False) as pool:
        await pool.open()
        async with BullMQPublisher.from_url(url, prefix=prefix, check_server=False) as publisher:
            store = PostgresOutboxStore(pool, outbox=Outbox(max_attempts=2))
            relay = OutboxRelay(store, DiesOnPoison(publisher), claim_ms=300)
            print(await relay.drain(), flush=True)

asyncio.run(main(*sys.argv[1:]))
"""


async def _rows(dsn: str) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute(
            "SELECT idempotency_key, status, attempts, lost_claims, last_error FROM outbox"
            " ORDER BY id"
        )
        return await cur.fetchall()


async def test_a_message_that_kills_its_relay_ends_dead_and_its_batch_is_published(
    pg_dsn: str, tmp_path: Path
) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        await Outbox().ensure_schema(conn)
        async with conn.transaction():
            for key in ("innocent-1", "poison", "innocent-2", "innocent-3"):
                await Outbox(max_attempts=2).enqueue_once(
                    conn, idempotency_key=key, queue="crash", name="n",
                    payload={"poison": key == "poison"},
                )  # fmt: skip
    script = tmp_path / "relay.py"
    script.write_text(_CRASHING_RELAY)
    prefix = f"sdcore-test-{uuid.uuid4().hex[:12]}"
    url = "redis://127.0.0.1:6379/0"
    exits: list[int] = []
    for _ in range(8):  # each relay process drains until nothing is due, or dies
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(script), pg_dsn, url, prefix,
            stdout=asyncio.subprocess.DEVNULL, cwd=ROOT,
        )  # fmt: skip
        exits.append(await asyncio.wait_for(proc.wait(), 60))
        if exits[-1] == 0 and all(r[1] != "PENDING" for r in await _rows(pg_dsn)):
            break
        await asyncio.sleep(0.4)  # the dead relay's claims expire
    rows = {r[0]: r[1:] for r in await _rows(pg_dsn)}
    client = aioredis.Redis.from_url(url, decode_responses=True)
    try:
        waiting = await client.llen(f"{prefix}:crash:wait")
    finally:
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
    # The batch's relay dies, then the poison's own claim's relay: two crashes, then a clean run.
    assert exits == [86, 86, 0], (exits, rows)
    assert rows["poison"] == (
        "DEAD",
        2,
        2,
        "claimed 2 times, 2 of them with no outcome: the relay died (or lost its database)"
        " while publishing it; its job may already be in the broker",
    )
    assert {k: v[0] for k, v in rows.items() if k != "poison"} == dict.fromkeys(
        ("innocent-1", "innocent-2", "innocent-3"), "PUBLISHED"
    )
    assert waiting == 3


# --- a batch too big for the socket timeout -------------------------------------------------


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[int]:
    """A redis-server of this test alone, on a spare port (killed at the end)."""
    with redis_server(tmp_path) as server:
        yield server.port


@contextlib.asynccontextmanager
async def _slow_link(upstream: int, bytes_per_s: int) -> AsyncIterator[int]:
    """A proxy to ``upstream`` passing client→server bytes at ``bytes_per_s`` (a slow link).

    Its sockets have small buffers, so the kernel does not absorb a large write.
    """
    chunk = 16 * 1024
    # Every stream of the proxy, closed on exit: Server.close() leaves accepted connections
    # open, and a writer left open when the test's loop closes warns when it is collected (in a
    # later test, which then fails on the unraisable warning).
    writers: list[asyncio.StreamWriter] = []
    tasks: set[asyncio.Task[None]] = set()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, slow: bool) -> None:
        try:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while data := await reader.read(chunk):
                    writer.write(data)
                    await writer.drain()
                    if slow:
                        await asyncio.sleep(len(data) / bytes_per_s)
        finally:
            writer.close()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream)
        except OSError:
            writer.close()
            return
        writers.append(up_writer)
        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    listener.bind(("127.0.0.1", 0))
    server = await asyncio.start_server(serve, sock=listener, limit=chunk)
    try:
        yield int(listener.getsockname()[1])
    finally:
        server.close()
        for writer in writers:
            writer.transport.abort()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


async def test_a_batch_too_big_to_write_within_the_socket_timeout_is_split(
    pg_dsn: str, private_redis: int
) -> None:
    """600 KB rows over a 4 MB/s link with a 0.5 s socket timeout: the whole batch never fits."""
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=4, open=False) as pool:
        await pool.open()
        outbox = Outbox(max_attempts=1)
        await outbox.ensure_schema(pool)
        async with pool.connection() as conn, conn.transaction():
            for i in range(24):
                await outbox.enqueue_once(
                    conn, idempotency_key=f"big-{i}", queue="big", name="n",
                    payload={"i": i, "blob": "x" * 600_000},
                )  # fmt: skip
        async with (
            _slow_link(private_redis, 4_000_000) as port,
            BullMQPublisher.from_url(
                f"redis://127.0.0.1:{port}", socket_timeout_s=0.5, check_server=False
            ) as publisher,
        ):
            relay = OutboxRelay(PostgresOutboxStore(pool, outbox=outbox), publisher)
            outages = 0
            for _ in range(12):
                try:
                    await relay.run_once()
                except PublisherUnavailableError:
                    outages += 1
                if (await relay.stats()).pending == 0:
                    break
            stats = await relay.stats()
        client = aioredis.Redis(port=private_redis)
        try:
            waiting = await client.llen("bull:big:wait")
        finally:
            await client.aclose()
    assert outages >= 1  # the first batch (the byte budget's 8 MiB) did not fit
    assert (stats.pending, stats.dead, stats.published) == (0, 0, 24), outages
    assert waiting == 24


# --- a delivery whose mark is lost with the database ------------------------------------------


async def test_a_delivery_whose_mark_failed_ends_published_not_dead(pg_dsn: str) -> None:
    # max_attempts=1: the batch's claim, then the row's own claim, are all it gets before the
    # claim that finds both lost marks it DEAD. The relay publishes each time and then cannot
    # mark: the database refuses the mark (a real statement error, as a failover or a dropped
    # connection would give), twice. Once the database takes marks again the row must end
    # PUBLISHED: its job is in Redis.
    outbox = Outbox(max_attempts=1)
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await outbox.ensure_schema(conn)
        async with conn.transaction():
            await outbox.enqueue_once(
                conn, idempotency_key="delivered", queue="marks", name="n", payload={"a": 1}
            )
        await conn.execute(
            "CREATE FUNCTION refuse_mark() RETURNS trigger LANGUAGE plpgsql AS"
            " $$BEGIN RAISE EXCEPTION 'database lost'; END$$"
        )
        await conn.execute(
            "CREATE TRIGGER refuse_mark BEFORE UPDATE ON outbox FOR EACH ROW"
            " WHEN (NEW.status = 'PUBLISHED') EXECUTE FUNCTION refuse_mark()"
        )
    prefix = f"sdcore-test-{uuid.uuid4().hex[:12]}"
    url = "redis://127.0.0.1:6379/0"
    client = aioredis.Redis.from_url(url, decode_responses=True)
    try:
        async with (
            AsyncConnectionPool(pg_dsn, min_size=1, max_size=2, open=False) as pool,
            BullMQPublisher.from_url(url, prefix=prefix, check_server=False) as publisher,
        ):
            await pool.open()
            relay = OutboxRelay(PostgresOutboxStore(pool, outbox=outbox), publisher, claim_ms=100)
            for _ in range(3):
                with contextlib.suppress(OutboxDatabaseError):
                    await relay.run_once()
                await asyncio.sleep(0.3)  # the claim expires with no outcome recorded
            async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
                await conn.execute("DROP TRIGGER refuse_mark ON outbox")
            await relay.run_once()
        waiting = await client.llen(f"{prefix}:marks:wait")
    finally:
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
    rows = await _rows(pg_dsn)
    assert waiting == 1
    assert [r[1] for r in rows] == ["PUBLISHED"], rows


async def test_a_split_batch_does_not_grow_back_into_the_size_that_was_refused(
    pg_dsn: str, private_redis: int
) -> None:
    """300 KB rows over a 4 MB/s link, 0.5 s socket timeout: once a split batch went through and
    the next, twice as large, was refused, claims stay at the size that went through (before,
    every other round doubled back and timed out again)."""
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=4, open=False) as pool:
        await pool.open()
        outbox = Outbox(max_attempts=1)
        await outbox.ensure_schema(pool)
        async with pool.connection() as conn, conn.transaction():
            for i in range(80):
                await outbox.enqueue_once(
                    conn, idempotency_key=f"big-{i}", queue="big", name="n",
                    payload={"i": i, "blob": "x" * 300_000},
                )  # fmt: skip
        async with (
            _slow_link(private_redis, 4_000_000) as port,
            BullMQPublisher.from_url(
                f"redis://127.0.0.1:{port}", socket_timeout_s=0.5, check_server=False
            ) as publisher,
        ):
            relay = OutboxRelay(PostgresOutboxStore(pool, outbox=outbox), publisher)
            rounds: list[int | str] = []
            for _ in range(60):
                try:
                    rounds.append(await relay.run_once())
                except PublisherUnavailableError:
                    rounds.append("refused")
                if (await relay.stats()).pending == 0:
                    break
            stats = await relay.stats()
    assert (stats.pending, stats.dead, stats.published) == (0, 0, 80), rounds
    # The byte budget's batch, then the first split batch grown back twice as large: refused
    # (more only if the loaded machine slows the link below the split size too).
    assert rounds.count("refused") <= 3, rounds
    published = [n for n in rounds if isinstance(n, int)]
    assert len(published) >= 4, rounds


# --- a Redis that stalls longer than a claim ------------------------------------------------


async def test_a_redis_stall_longer_than_the_claim_does_not_bury_a_healthy_message(
    pg_dsn: str, private_redis: int
) -> None:
    """Redis is stopped (SIGSTOP): each publish waits for the 1 s socket timeout, longer than the
    300 ms claim. Two relays keep trying; neither died, so the message must stay PENDING with no
    lost claim, and be published once Redis resumes (before, the relays took each other's
    expired claims over, counted them lost, and buried the message DEAD within seconds)."""
    url = f"redis://127.0.0.1:{private_redis}/0"
    client = aioredis.Redis.from_url(url, decode_responses=True)
    pid = int((await client.info("server"))["process_id"])
    outbox = Outbox(max_attempts=1)
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=6, open=False) as pool:
        await pool.open()
        await outbox.ensure_schema(pool)
        async with pool.connection() as conn, conn.transaction():
            await outbox.enqueue_once(
                conn, idempotency_key="healthy", queue="stall", name="n", payload={}
            )
        async with (
            BullMQPublisher.from_url(url, socket_timeout_s=1.0, check_server=False) as first,
            BullMQPublisher.from_url(url, socket_timeout_s=1.0, check_server=False) as second,
        ):
            relays = [
                OutboxRelay(PostgresOutboxStore(pool, outbox=outbox), publisher, claim_ms=300)
                for publisher in (first, second)
            ]

            async def keep_trying(relay: OutboxRelay, delay: float) -> None:
                await asyncio.sleep(delay)
                for _ in range(5):
                    with contextlib.suppress(PublisherUnavailableError):
                        await relay.run_once()
                    await asyncio.sleep(0.1)

            os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.gather(keep_trying(relays[0], 0), keep_trying(relays[1], 0.5))
                during = await _rows(pg_dsn)
            finally:
                os.kill(pid, signal.SIGCONT)
            await relays[0].run_once()
        after = await _rows(pg_dsn)
        waiting = await client.llen("bull:stall:wait")
    await client.aclose()
    assert [(r[1], r[3]) for r in during] == [("PENDING", 0)], during
    assert [r[1] for r in after] == ["PUBLISHED"], after
    assert waiting == 1


# --- one row too big for the socket timeout, with Redis up ------------------------------------


async def test_a_single_row_too_big_for_the_socket_timeout_ends_dead_and_does_not_stall(
    pg_dsn: str, private_redis: int
) -> None:
    """A 1 MB row, then 50 small ones, over a 200 KB/s link with a 0.5 s socket timeout: the big
    row's one-job write can never finish. The rows behind it must be published, and the big row
    must end DEAD with a reason, while Redis answers (before, the one-row batch was handed back
    as an outage, attempts untouched, and stayed first in line for ever)."""
    outbox = Outbox(max_attempts=3)
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=4, open=False) as pool:
        await pool.open()
        await outbox.ensure_schema(pool)
        async with pool.connection() as conn, conn.transaction():
            await outbox.enqueue_once(
                conn, idempotency_key="huge", queue="slow", name="n",
                payload={"blob": "x" * 1_000_000},
            )  # fmt: skip
            for i in range(50):
                await outbox.enqueue_once(
                    conn, idempotency_key=f"small-{i}", queue="slow", name="n", payload={"i": i}
                )
        async with (
            _slow_link(private_redis, 200_000) as port,
            BullMQPublisher.from_url(
                f"redis://127.0.0.1:{port}", socket_timeout_s=0.5, check_server=False
            ) as publisher,
        ):
            # The relay's own loop, as in production: on each refusal it backs off (here at most
            # 1 s, to keep the splits 51 → 25 → … → 1 short), so a row handed back as an outage
            # for ever holds the rows behind it to a trickle, and never ends.
            relay = OutboxRelay(
                PostgresOutboxStore(pool, outbox=outbox), publisher, retry_base_ms=200,
                poll_interval_ms=100, unavailable_max_ms=1_000,
            )  # fmt: skip
            await relay.start()
            try:
                for _ in range(200):  # at most about 20 s
                    stats = await relay.stats()
                    if stats.pending == 0:
                        break
                    await asyncio.sleep(0.1)
                state = relay.state
            finally:
                await relay.stop()
        rows = {r[0]: r[1:] for r in await _rows(pg_dsn)}
        client = aioredis.Redis(port=private_redis)
        try:
            small = await client.exists(*[f"bull:slow:{r[0]}" for r in await _job_ids(pg_dsn)])
        finally:
            await client.aclose()
    assert (stats.pending, stats.dead, stats.published) == (0, 1, 50), (state, rows["huge"])
    assert small == 50  # every small row's job is in Redis (the big one's may be too: see below)
    assert state.broker_available
    status, attempts, lost, error = rows["huge"]
    assert (status, attempts, lost) == ("DEAD", 3, 0)
    # A write cut off by the timeout may still reach Redis (the kernel sends what it buffered),
    # so the reason says the job may be there already.
    for part in ("1000011 bytes", "socket timeout of 0.5 s", "raise the publisher's socket"):
        assert part in error, error
    assert "may already be in Redis" in error, error


async def _job_ids(dsn: str) -> list[tuple[str]]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute(
            "SELECT job_id FROM outbox WHERE idempotency_key LIKE 'small-%' ORDER BY id"
        )
        return await cur.fetchall()
