"""The campaign of the outbox-to-Celery acceptance tests, on a broker of the test's choice.

Rows are committed; relay processes publish them through a TCP proxy in front of the shared
broker, and a ``celery worker`` process (prefork, ``acks_late``, through the proxy too unless
the broker says otherwise) runs each task under ``exactly_once``. During the run a relay is
``kill -9``-ed twice and every broker connection through the proxy is cut once. Verdict: every
row ``PUBLISHED``, every task's effect written exactly once, however many times its message was
delivered.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from sdcore.outbox import Outbox
from sdcore.outbox.celery import TaskLedger
from tests._tcpproxy import TcpProxy

ROOT = Path(__file__).resolve().parents[2]
STALL_S = 30  # a stage that counts no progress this long is stuck

_RELAY = """
import asyncio, json, sys
from psycopg_pool import AsyncConnectionPool
from sdcore.outbox import OutboxRelay, PostgresOutboxStore
from sdcore.outbox.celery import CeleryPublisher


async def main(dsn, url, options):
    async with AsyncConnectionPool(dsn, min_size=1, max_size=4, open=False) as pool:
        await pool.open()
        publisher = CeleryPublisher(
            url, confirm_timeout_s=2.0, connect_timeout_s=1.0,
            transport_options=json.loads(options),
        )
        relay = OutboxRelay(
            PostgresOutboxStore(pool), publisher, poll_interval_ms=50, claim_ms=1500,
            unavailable_max_ms=300,
        )
        async with publisher, relay:
            await asyncio.Event().wait()

asyncio.run(main(*sys.argv[1:]))
"""


class Stall:
    """Fails a wait that makes no progress for :data:`STALL_S` seconds: how long the whole
    campaign takes depends on the machine's load (a loaded worker runs its tasks slower), but
    a stage whose count stands still that long is stuck."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._last: int | None = None
        self._since = time.monotonic()

    def check(self, progress: int) -> None:
        now = time.monotonic()
        if progress != self._last:
            self._last, self._since = progress, now
        assert now - self._since < STALL_S, f"{self._what} (no progress for {STALL_S} s)"


def _report(line: str) -> None:
    print(line)  # noqa: T201


@dataclass(frozen=True, slots=True, kw_only=True)
class Broker:
    """The broker a campaign runs on."""

    name: str
    target: tuple[str, int]
    url: Callable[[int], str]
    """The broker's URL through a proxy listening on this port."""
    transport_options: dict[str, Any] = field(default_factory=dict)
    """The worker's and the publisher's (kombu) transport options."""
    clean: Callable[[str], None]
    """Delete what the campaign left on the broker, given its queue name."""
    cut_worker: bool = True
    """Whether the worker goes through the proxy too (its connection cut with the relay's)."""


def _prepare(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        TaskLedger().ensure_schema(conn)
        conn.execute("CREATE TABLE effects (key text NOT NULL)")
        conn.execute("CREATE TABLE deliveries (task_id text NOT NULL)")


async def _count(pool: AsyncConnectionPool[Any], query: str) -> int:
    async with pool.connection() as conn:
        cur = await conn.execute(query)
        row = await cur.fetchone()
        return int(row[0]) if row else 0


async def campaign(pg_dsn: str, tmp_path: Path, broker: Broker, *, messages: int) -> None:
    """Run the campaign with ``messages`` rows; assert its verdict and print its figures."""
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=4, open=False) as pool:
        await pool.open()
        await Outbox().ensure_schema(pool)
        await _campaign(pool, pg_dsn, tmp_path, broker, messages)


async def _campaign(
    pool: AsyncConnectionPool[Any], pg_dsn: str, tmp_path: Path, broker: Broker, messages: int
) -> None:
    MESSAGES = messages
    started = time.monotonic()
    await asyncio.to_thread(_prepare, pg_dsn)
    outbox = Outbox()
    queue = f"acceptance-{uuid.uuid4().hex[:10]}"
    keys = [f"order-{n}" for n in range(MESSAGES)]

    async def write(part: list[str]) -> None:
        async with pool.connection() as conn:
            for start in range(0, len(part), 500):
                async with conn.transaction():
                    for key in part[start : start + 500]:
                        await outbox.enqueue_once(
                            conn, idempotency_key=key, queue=queue, name="effects.apply",
                            payload={"key": key},
                        )  # fmt: skip

    await asyncio.gather(*(write(keys[i::4]) for i in range(4)))
    enqueued_s = time.monotonic() - started
    script = tmp_path / "relay.py"
    script.write_text(_RELAY)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        "SDCORE_CELERY_DSN": pg_dsn,
        "SDCORE_CELERY_QUEUE": queue,
        "SDCORE_CELERY_TRANSPORT_OPTIONS": json.dumps(broker.transport_options),
    }
    processes: list[asyncio.subprocess.Process] = []
    kills = cuts = 0
    async with TcpProxy(*broker.target) as proxy:
        url = broker.url(proxy.port)
        options = json.dumps(broker.transport_options)

        async def relay() -> asyncio.subprocess.Process:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, str(script), pg_dsn, url, options, cwd=ROOT, env=env,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            processes.append(proc)
            return proc

        async def published() -> int:
            return await _count(pool, "SELECT count(*) FROM outbox WHERE status = 'PUBLISHED'")

        async def until_published(n: int) -> None:
            stall = Stall(f"stuck below {n} published")
            while (count := await published()) < n:
                stall.check(count)
                await asyncio.sleep(0.02)

        worker = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "celery", "-A", "tests.acceptance._celery_app", "worker",
            "-Q", queue, "-c", "2", "-P", "prefork", "--without-gossip", "--without-mingle",
            "--without-heartbeat", "-l", "error", cwd=ROOT,
            env={
                **env,
                "SDCORE_CELERY_BROKER": url if broker.cut_worker else broker.url(broker.target[1]),
            },
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        processes.append(worker)
        try:
            first = await relay()
            await until_published(MESSAGES // 5)
            first.send_signal(signal.SIGKILL)
            await first.wait()
            kills += 1
            second = await relay()
            await until_published(MESSAGES // 2)
            cuts += 1
            cut = proxy.cut()
            assert cut >= (2 if broker.cut_worker else 1)  # the relay's, and the worker's
            await until_published(MESSAGES * 7 // 10)
            second.send_signal(signal.SIGKILL)
            await second.wait()
            kills += 1
            await relay()
            stall = Stall("the tasks stopped running before every one had")
            while True:
                effects = await _count(pool, "SELECT count(*) FROM effects")
                left = await _count(pool, "SELECT count(*) FROM outbox WHERE status <> 'PUBLISHED'")
                if effects >= MESSAGES and not left:
                    break
                stall.check(effects * (MESSAGES + 1) - left)
                await asyncio.sleep(0.1)
            done_s = time.monotonic() - started
            await asyncio.sleep(1.0)  # a late duplicate would show up now
        finally:
            for proc in processes:
                if proc.returncode is None:
                    proc.send_signal(signal.SIGKILL)
                    await proc.wait()
            await asyncio.to_thread(broker.clean, queue)
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT status, count(*) FROM outbox GROUP BY status")
        statuses = dict(await cur.fetchall())
        cur = await conn.execute("SELECT count(*), count(DISTINCT key) FROM effects")
        effects, distinct = await cur.fetchone() or (0, 0)
        cur = await conn.execute("SELECT count(*), count(DISTINCT task_id) FROM deliveries")
        deliveries, delivered_ids = await cur.fetchone() or (0, 0)
        cur = await conn.execute("SELECT count(*) FROM outbox WHERE attempts > 1")
        reclaimed = (await cur.fetchone() or (0,))[0]
        cur = await conn.execute("SELECT count(*) FROM sdcore_celery_done")
        ledger = (await cur.fetchone() or (0,))[0]
    _report(
        f"outbox to celery on {broker.name}: messages={MESSAGES} relay_kills={kills}"
        f" connection_cuts={cuts}"
        f" deliveries={deliveries} repeats_skipped={deliveries - effects}"
        f" rows_published_again={reclaimed} effects={effects} enqueue_s={enqueued_s:.1f}"
        f" all_done_s={done_s:.1f} (from the first enqueue)"
    )
    assert statuses == {"PUBLISHED": MESSAGES}
    assert (effects, distinct) == (MESSAGES, MESSAGES)
    assert ledger == MESSAGES
    assert delivered_ids == MESSAGES
    # Repeats did reach the worker (re-published rows, redeliveries after the cut): the skip
    # was exercised, not only the happy path.
    assert deliveries > MESSAGES, "no message was delivered twice: the faults did not bite"
