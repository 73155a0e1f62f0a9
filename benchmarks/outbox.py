"""Outbox throughput (rows committed → jobs in Redis) next to bare BullMQ adds, and enqueue cost.

Three measurements per round, in this order: throughput and enqueue overhead in this process (one
event loop), then the NOTIFY comparison with pgbench; then, once, the wake-up latency.

**Throughput.** Every workload puts the same N jobs into an empty BullMQ queue under this run's
own key prefix: job ids shaped like the outbox's (``bullmq_job_id(key)``: ``"sd-"`` + 64 hex
digits), the same small JSON payload and the options the relay sends (``removeOnComplete`` and
``removeOnFail`` ``{"age": 604800}``, plus ``jobId``). All of them share one ``redis.asyncio``
client, built as ``BullMQPublisher.from_url`` builds its own (``decode_responses``, 5 s
timeouts); the relay's publisher is ``BullMQPublisher(client, prefix=…, check_server=False)``
(the server check runs once per publisher and is not part of the throughput).

``add``
    A bare Python bullmq loop: ``await queue.add(name, data, {"jobId": …, …})`` N times (ids and
    payloads made before the clock starts): one ``EVALSHA`` round trip per job.
``bulk``
    Bare ``queue.addBulk`` in batches of 100 (one MULTI/EXEC pipeline per batch), awaited one
    after another: the baseline of the relay's target (≥ 0.8×).
``relay-B``
    N rows already committed in the outbox (written with ``Outbox.enqueue_once`` before the clock
    starts, then ``ANALYZE`` and ``CHECKPOINT``); timed: ``OutboxRelay(PostgresOutboxStore(pool),
    BullMQPublisher(…), batch_size=B).drain(max_rows=…)`` — what the relay's background loop runs
    — until all N rows are claimed, published and marked. That is rows committed → jobs in Redis,
    with the claim and mark statements (each an autocommit statement with a durable commit) and
    the relay's Python work, pipelined (the next claim and the previous mark overlap a publish).
    B sweeps 100, 250, 500 (the default ``batch_size``, chosen from this sweep) and 1000. A thin
    wrapper around the publisher times ``publish`` (with the pipeline, the overlapping claim and
    mark work of the same process runs inside that time too).

The workloads alternate in chunks of ``--chunk`` jobs (default 2000, a multiple of the largest
batch; order A…F, F…A, … starting at a different workload each round) until each has put N jobs
into Redis, so a burst of load from elsewhere hits them alike. Each relay drains its own outbox
table (``outbox_100``, …), filled before the round. Before a round the run's Redis
keys are deleted and the relay tables refilled; after it each workload is checked (N entries in its
queue's wait list; for a relay, N rows ``PUBLISHED``).

**Enqueue overhead.** At each client count of ``--enqueue-clients`` (default 1 and 8), that many
psycopg ``AsyncConnection`` (autocommit; ``async with conn.transaction()`` per business
transaction), one per asyncio task, run a user transaction that inserts one row into a business
table (``INSERT … RETURNING id``) and commits, in seven variants alternating in short slices
(``--slice``; order A…G, G…A, …) until each has run ``--enqueue-seconds`` per round:

``plain``
    Just the business insert.
``+enqueue_once``
    Plus ``await Outbox().enqueue_once(conn, idempotency_key=f"order-created:{id}", …)``: our
    validation, key hashing and the one-statement ``INSERT … ON CONFLICT DO NOTHING``, with the
    NOTIFY debounced (``notify_interval_ms`` = 20: at most one notifying enqueue per 20 ms in
    this process).
``+once_notify_all``
    The same with ``Outbox(notify_interval_ms=0)``: every insert notifies (no debounce).
``+once_no_notify``
    The same with ``Outbox(notify=False)``: the same statement and Python work, never a NOTIFY.
    The target's baseline: ``+enqueue_once`` ≥ 0.9× this at 8 clients.
``+enqueue_sql``
    Plus the library's own rendered enqueue statement with cheaply made parameters (a random job
    id of the same shape): ``enqueue_once`` without its Python work.
``+sql_no_notify``
    The same statement without its ``pg_notify``: prices the NOTIFY, which PostgreSQL serializes
    across concurrent committers (a cluster-wide lock held from pre-commit until after the commit
    record is flushed).
``+insert``
    Plus a bare ``INSERT`` of the same row shape into the outbox table (no ``ON CONFLICT``, no
    NOTIFY, no validation): the floor of "one more row in that table".

**NOTIFY under concurrency.** ``pgbench -M prepared -c C`` (``--pgbench-clients``, default 1, 8
and 32; ``--pgbench-seconds`` each) runs the business transaction alone, with the library's
rendered enqueue statement, and with that statement minus its ``pg_notify``: the same SQL with no
Python client in the way, at client counts a single Python process cannot drive.

**Wake-up latency under steady traffic.** After the rounds (or alone, with ``--only-wake``): a
relay with LISTEN/NOTIFY and ``poll_interval_ms`` = ``--wake-poll-ms`` (default 1000) runs while
one writer commits one outbox row at a time at each rate of ``--wake-rates`` (default 20 and 200
rows/s) for ``--wake-seconds``, once with every insert notifying and once debounced (20 ms);
per row, the time from its COMMIT returning to the end of the claim that took it and to the end
of the ``publish`` call that put it in Redis (p50, p99). A lost wake-up shows as a latency near
the poll interval: that is what the debounce trades for the writers' throughput.

The script exits 0 whatever the figures (it is a benchmark, not a test) and prints whether the
targets were met: ``relay-B`` ≥ 0.8× ``bulk`` (per B of the sweep), and ``+enqueue_once`` ≥ 0.9×
``+once_no_notify`` at 8 clients.

Usage::

    python benchmarks/outbox.py [--database-url URL] [--redis-url URL] [--messages N]
                                [--rounds R] [--chunk N] [--enqueue-seconds S]
                                [--enqueue-clients 1,8] [--slice S]
                                [--pgbench-clients 1,8,32] [--pgbench-seconds S]
                                [--wake-seconds S] [--wake-rates 20,200] [--wake-poll-ms MS]
                                [--only-wake]

The database URL defaults to ``$SDCORE_BENCH_DATABASE_URL`` or
``postgresql://postgres@127.0.0.1:5432/postgres`` (a scratch database is created there and
dropped at the end); the Redis URL to ``$SDCORE_BENCH_REDIS_URL`` or ``redis://127.0.0.1:6379/0``
(keys go under a prefix unique to the run and are deleted at the end).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import redis
from _harness import run_pgbench as harness_pgbench
from bullmq import Queue  # type: ignore[import-untyped]
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool
from redis.asyncio import Redis

from sdcore.job_scheduler import bullmq_job_id
from sdcore.outbox import DEFAULT_KEEP, OutboxMessage, OutboxRelay, PostgresOutboxStore, Publisher
from sdcore.outbox._outbox import DEFAULT_NOTIFY_INTERVAL_MS, Outbox
from sdcore.queues import BullMQPublisher
from sdcore.queues._redis import connect

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
TARGET = 0.8
BULK = 100
RELAY_BATCHES = (100, 250, 500, 1000)  # the sweep that chose the default batch_size
DEFAULT_BATCH = 500  # OutboxRelay's default batch_size
JOB_NAME = "order.created"
WARMUP = 1000  # jobs per workload before round 1
FILL_CHUNK = 500  # outbox rows per (untimed) filling transaction
ENQUEUE_VARIANTS = (
    "plain", "+enqueue_once", "+once_notify_all", "+once_no_notify", "+enqueue_sql",
    "+sql_no_notify", "+insert",
)  # fmt: skip
NOTIFY_TARGET = 0.9  # +enqueue_once ÷ +once_no_notify at 8 clients

BUSINESS_DDL = """\
CREATE TABLE orders (
    id         bigint        GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer   text          NOT NULL,
    amount     numeric(12,2) NOT NULL,
    created_at timestamptz   NOT NULL DEFAULT now()
)"""
BUSINESS_INSERT = b"INSERT INTO orders (customer, amount) VALUES (%s, %s) RETURNING id"
BARE_OUTBOX_INSERT = (
    b"INSERT INTO outbox (idempotency_key, queue, name, job_id, payload, options, max_attempts,"
    b" message_digest) VALUES (%s, %s, %s, %s, %s::jsonb, %s::jsonb, %s, %s)"
)


def _payload(i: int) -> dict[str, Any]:
    """A small job payload (~90 bytes of JSON), the same for every workload."""
    return {"order_id": i, "customer": f"customer-{i % 97}", "amount": "19.90", "currency": "EUR"}


async def _checkpoint(conn: psycopg.AsyncConnection[Any]) -> None:
    """Flush dirty pages now (autocommit connection), so no checkpoint lands in a measurement."""
    with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
        await conn.execute("CHECKPOINT")


def _keep() -> dict[str, Any]:
    return {"removeOnComplete": dict(DEFAULT_KEEP), "removeOnFail": dict(DEFAULT_KEEP)}


# --------------------------------------------------------------------------- throughput


@dataclass
class Sample:
    """One workload, one round: N jobs into Redis, timed chunk by chunk."""

    jobs: int = 0
    elapsed: float = 0.0  # wall seconds
    cpu: float = 0.0  # this process's CPU seconds (user + system)
    publish: float = 0.0  # relay only: wall seconds inside BullMQPublisher.publish

    @property
    def rate(self) -> float:
        return self.jobs / self.elapsed

    @property
    def cpu_us(self) -> float:
        return 1e6 * self.cpu / self.jobs


class TimedPublisher:
    """Delegates to a publisher and adds up the wall time spent in ``publish``."""

    def __init__(self, inner: Publisher) -> None:
        self._inner = inner
        self.elapsed = 0.0

    async def publish(self, messages: Sequence[OutboxMessage]) -> Sequence[BaseException | None]:
        start = time.perf_counter()
        try:
            return await self._inner.publish(messages)
        finally:
            self.elapsed += time.perf_counter() - start


@dataclass
class Bench:
    """What every throughput workload shares."""

    pool: AsyncConnectionPool[Any]
    client: Redis
    prefix: str
    serial: int = 0  # makes every job id of the run unique

    def queue(self, name: str) -> Any:
        # Never closed one by one: Queue.close() would close the shared client.
        return Queue(name, {"connection": self.client, "prefix": self.prefix})

    def jobs(self, n: int) -> list[tuple[str, str, dict[str, Any]]]:
        """``n`` fresh (idempotency key, job id, payload) triples."""
        self.serial += 1
        keys = [f"bench:{self.serial}:{i}" for i in range(n)]
        return [(key, bullmq_job_id(key), _payload(i)) for i, key in enumerate(keys)]

    async def delete_keys(self) -> int:
        """Delete every Redis key of this run (``{prefix}:*``)."""
        deleted = 0
        batch: list[str] = []
        async for key in self.client.scan_iter(match=f"{self.prefix}:*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                deleted += await self.client.delete(*batch)
                batch.clear()
        if batch:
            deleted += await self.client.delete(*batch)
        return deleted

    async def waiting(self, queue: str) -> int:
        return int(await self.client.llen(f"{self.prefix}:{queue}:wait"))


class Workload:
    """N jobs into the queue named like the workload, ``step`` by ``step`` (each one timed)."""

    def __init__(self, name: str, bench: Bench) -> None:
        self.name = name
        self.bench = bench
        self.sample = Sample()
        self.done = 0

    async def prepare(self, n: int) -> None:
        """Untimed set-up of a round."""
        self.sample = Sample()
        self.done = 0

    async def step(self, target: int) -> None:
        """Bring the jobs in Redis to ``target`` (or a little past it, by whole batches)."""
        raise NotImplementedError

    async def check(self, n: int) -> None:
        waiting = await self.bench.waiting(self.name)
        if waiting != n or self.done != n:
            raise RuntimeError(f"{self.name}: {self.done} done, {waiting} waiting, expected {n}")


class BareAdd(Workload):
    """``await queue.add(name, data, opts)`` one job at a time."""

    async def prepare(self, n: int) -> None:
        await super().prepare(n)
        self.queue = self.bench.queue(self.name)
        self.todo = self.bench.jobs(n)

    async def step(self, target: int) -> None:
        queue, keep = self.queue, DEFAULT_KEEP
        for _, job_id, data in self.todo[self.done : target]:
            await queue.add(
                JOB_NAME, data, {"jobId": job_id, "removeOnComplete": keep, "removeOnFail": keep}
            )
        self.done = max(self.done, min(target, len(self.todo)))


class BareBulk(BareAdd):
    """``await queue.addBulk([...])`` in batches of ``BULK``."""

    async def step(self, target: int) -> None:
        queue, keep = self.queue, DEFAULT_KEEP
        while self.done < min(target, len(self.todo)):
            chunk = self.todo[self.done : self.done + BULK]
            await queue.addBulk(
                [
                    {
                        "name": JOB_NAME,
                        "data": data,
                        "opts": {"jobId": job_id, "removeOnComplete": keep, "removeOnFail": keep},
                    }
                    for _, job_id, data in chunk
                ]
            )
            self.done += len(chunk)


class RelayWorkload(Workload):
    """``OutboxRelay.drain()`` over its own outbox table, filled before the round."""

    def __init__(self, name: str, bench: Bench, batch: int) -> None:
        super().__init__(name, bench)
        self.batch = batch
        self.outbox = Outbox(table=f"outbox_{batch}")

    async def prepare(self, n: int) -> None:
        await super().prepare(n)
        bench = self.bench
        async with bench.pool.connection() as conn:
            await conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(self.outbox.table)))
            todo = bench.jobs(n)
            for offset in range(0, n, FILL_CHUNK):
                async with conn.transaction():
                    for key, _, data in todo[offset : offset + FILL_CHUNK]:
                        await self.outbox.enqueue_once(
                            conn, idempotency_key=key, queue=self.name, name=JOB_NAME, payload=data
                        )
            await conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(self.outbox.table)))
        self.publisher = TimedPublisher(
            BullMQPublisher(bench.client, prefix=bench.prefix, check_server=False)
        )
        self.relay = OutboxRelay(
            PostgresOutboxStore(bench.pool, outbox=self.outbox),
            self.publisher,
            batch_size=self.batch,
        )

    async def step(self, target: int) -> None:
        # drain() is what the relay's background loop runs: claim, publish and mark pipelined.
        while self.done < target:
            claimed = await self.relay.drain(max_rows=target - self.done)
            if claimed == 0:
                break
            self.done += claimed

    async def check(self, n: int) -> None:
        await super().check(n)
        query = sql.SQL("SELECT count(*) FROM {} WHERE status = 'PUBLISHED'")
        async with self.bench.pool.connection() as conn:
            cur = await conn.execute(query.format(sql.Identifier(self.outbox.table)))
            row = await cur.fetchone()
        if row is None or row[0] != n:
            raise RuntimeError(f"{self.name}: {row} rows published, expected {n}")


def _workloads(bench: Bench) -> list[Workload]:
    return [
        BareAdd("add", bench),
        BareBulk("bulk", bench),
        *(RelayWorkload(f"relay-{b}", bench, b) for b in RELAY_BATCHES),
    ]


WORKLOADS = ("add", "bulk", *(f"relay-{b}" for b in RELAY_BATCHES))


async def _throughput_round(
    bench: Bench, workloads: Sequence[Workload], n: int, chunk: int, rotate: int
) -> dict[str, Sample]:
    """Every workload puts ``n`` jobs into Redis, alternating in chunks of ``chunk`` jobs."""
    await bench.delete_keys()
    for workload in workloads:
        await workload.prepare(n)
    async with bench.pool.connection() as conn:
        await _checkpoint(conn)
    order = list(workloads[rotate % len(workloads) :]) + list(workloads[: rotate % len(workloads)])
    target = 0
    while target < n:
        target = min(target + chunk, n)
        for workload in order:
            before = workload.done
            publish = workload.publisher.elapsed if isinstance(workload, RelayWorkload) else 0.0
            cpu = time.process_time()
            start = time.perf_counter()
            await workload.step(target)
            elapsed = time.perf_counter() - start
            sample = workload.sample
            sample.elapsed += elapsed
            sample.cpu += time.process_time() - cpu
            sample.jobs += workload.done - before
            if isinstance(workload, RelayWorkload):
                sample.publish += workload.publisher.elapsed - publish
        order.reverse()  # ABCD DCBA: a linear drift cancels out
    for workload in workloads:
        await workload.check(n)
    return {workload.name: workload.sample for workload in workloads}


# --------------------------------------------------------------------------- enqueue overhead


@dataclass
class Slices:
    """What one enqueue variant did over all its timed slices of a round (all clients)."""

    txns: int = 0
    elapsed: float = 0.0
    cpu: float = 0.0

    @property
    def rate(self) -> float:
        return self.txns / self.elapsed

    @property
    def wall_us(self) -> float:
        return 1e6 * self.elapsed / self.txns

    @property
    def cpu_us(self) -> float:
        return 1e6 * self.cpu / self.txns


Txn = Callable[[int], Awaitable[None]]


def _enqueue_variants(conn: psycopg.AsyncConnection[Any], outbox: Outbox) -> dict[str, Txn]:
    options = json.dumps(_keep())  # what check_options(None) stores
    max_attempts = outbox.max_attempts
    enqueue_sql = outbox.sql.enqueue
    no_notify = outbox.sql.enqueue_quiet  # the same statement minus its pg_notify
    channel = outbox.channel
    target = sql.Identifier(outbox.table).as_string(None)

    async def business(i: int) -> int:
        cur = await conn.execute(BUSINESS_INSERT, (f"customer-{i % 97}", "19.90"))
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])

    def cheap_params(order_id: int) -> dict[str, Any]:
        # The statement's parameters made without validation (the job id is computed by the
        # statement itself; the digest is a random one of the library's shape, no hashing).
        return {
            "key": f"order-created:{order_id}",
            "queue": "orders",
            "name": JOB_NAME,
            "payload": json.dumps(_payload(order_id)),
            "options": options,
            "max": max_attempts,
            "namespace": None,
            "target": target,
            "channel": channel,
            "trace": None,  # no trace context: what an untraced enqueue sends
            "digest": random.getrandbits(256).to_bytes(32, "big"),
        }

    def bare_params(order_id: int) -> tuple[Any, ...]:
        # Random job ids and digests shaped like the library's: same index work, no hashing.
        return (
            f"order-created:{order_id}",
            "orders",
            JOB_NAME,
            f"sd2-{random.getrandbits(256):064x}",
            json.dumps(_payload(order_id)),
            options,
            max_attempts,
            random.getrandbits(256).to_bytes(32, "big"),
        )

    async def plain(i: int) -> None:
        async with conn.transaction():
            await business(i)

    def public_api(other: Outbox) -> Txn:
        async def txn(i: int) -> None:
            async with conn.transaction():
                order_id = await business(i)
                await other.enqueue_once(
                    conn,
                    idempotency_key=f"order-created:{order_id}",
                    queue="orders",
                    name=JOB_NAME,
                    payload=_payload(order_id),
                )

        return txn

    async def with_enqueue_sql(i: int) -> None:
        async with conn.transaction():
            order_id = await business(i)
            cur = await conn.execute(enqueue_sql, cheap_params(order_id))
            if await cur.fetchone() is None:
                raise RuntimeError("+enqueue_sql: row not inserted")

    async def with_no_notify(i: int) -> None:
        async with conn.transaction():
            order_id = await business(i)
            cur = await conn.execute(no_notify, cheap_params(order_id))
            if await cur.fetchone() is None:
                raise RuntimeError("+sql_no_notify: row not inserted")

    async def with_insert(i: int) -> None:
        async with conn.transaction():
            order_id = await business(i)
            await conn.execute(BARE_OUTBOX_INSERT, bare_params(order_id))

    variants: dict[str, Txn] = {
        "plain": plain,
        "+enqueue_once": public_api(outbox),
        # The NOTIFY on every insert (no debounce), and never: the same Python work as
        # +enqueue_once, so the ratios to these two price the NOTIFY alone.
        "+once_notify_all": public_api(Outbox(notify_interval_ms=0)),
        "+once_no_notify": public_api(Outbox(notify=False)),
        "+enqueue_sql": with_enqueue_sql,
        "+sql_no_notify": with_no_notify,
        "+insert": with_insert,
    }
    assert tuple(variants) == ENQUEUE_VARIANTS
    return variants


async def _enqueue_round(
    dsn: str, clients: int, seconds: float, slice_seconds: float
) -> dict[str, Slices]:
    """Alternate the variants in slices over ``clients`` connections until each ran ``seconds``.

    In a slice every client runs the same variant on its own connection, back to back.
    """
    outbox = Outbox()
    totals = {name: Slices() for name in ENQUEUE_VARIANTS}
    conns = [await psycopg.AsyncConnection.connect(dsn, autocommit=True) for _ in range(clients)]
    try:
        await conns[0].execute("TRUNCATE orders, outbox RESTART IDENTITY")
        await _checkpoint(conns[0])
        per_client = [_enqueue_variants(conn, outbox) for conn in conns]
        counters = [0] * clients

        async def client(index: int, name: str, deadline: float | None, count: int) -> int:
            txn = per_client[index][name]
            done = 0
            while (time.perf_counter() < deadline) if deadline is not None else done < count:
                await txn(counters[index])
                counters[index] += 1
                done += 1
            return done

        for name in ENQUEUE_VARIANTS:  # warm: past psycopg's prepare threshold (5)
            await asyncio.gather(*(client(c, name, None, 10) for c in range(clients)))
        order = list(ENQUEUE_VARIANTS)
        while min(t.elapsed for t in totals.values()) < seconds:
            for name in order:
                cpu = time.process_time()
                start = time.perf_counter()
                deadline = start + slice_seconds
                done = await asyncio.gather(*(client(c, name, deadline, 0) for c in range(clients)))
                total = totals[name]
                total.elapsed += time.perf_counter() - start
                total.cpu += time.process_time() - cpu
                total.txns += sum(done)
            order.reverse()  # ABCDE EDCBA: a linear drift cancels out
    finally:
        for conn in conns:
            await conn.close()
    return totals


# ------------------------------------------------------------------ NOTIFY under concurrency

PGBENCH_SCRIPTS = ("plain", "+enqueue_sql", "+debounced_sql", "+sql_no_notify")


def _substitute(statement: bytes, names: Sequence[str] | dict[str, str]) -> str:
    """Replace a rendered statement's placeholders with pgbench variables.

    ``names`` is a list for positional ``%s`` placeholders (in order), a mapping for named
    ``%(name)s`` ones.
    """
    # One line for pgbench: drop the statement's "--" comment lines first, or the rest of the
    # joined line would be a comment.
    lines = statement.decode("utf-8").splitlines()
    text = "\n".join(line for line in lines if not line.lstrip().startswith("--"))
    if isinstance(names, dict):
        found = set(re.findall(r"%\((\w+)\)s", text))
        if not found <= set(names):
            raise RuntimeError(f"no pgbench variable for {sorted(found - set(names))}")
        joined = re.sub(r"%\((\w+)\)s", lambda m: names[m.group(1)], text)
        return " ".join(joined.split())
    parts = text.split("%s")
    if len(parts) != len(names) + 1:
        raise RuntimeError(f"expected {len(names)} placeholders, found {len(parts) - 1}")
    out = [parts[0]]
    for name, part in zip(names, parts[1:], strict=True):
        out.extend((name, part))
    return " ".join("".join(out).split())  # one line: pgbench's \gset must end it


def pgbench_scripts(outbox: Outbox) -> dict[str, str]:
    """The business transaction without and with the library's enqueue statement, for pgbench.

    The business insert's ``RETURNING id`` (``\\gset``) is the idempotency key (the statement
    derives the job id from it, and here the digest too, which the library computes in Python);
    the other parameters are constants passed with ``-D``.
    """
    business = _substitute(BUSINESS_INSERT, [":p_customer", ":p_amount"])
    params = {
        "key": ":id",
        "queue": ":p_queue",
        "name": ":p_name",
        "payload": ":p_payload",
        "options": ":p_options",
        "max": ":p_max",
        "namespace": "NULL",
        "target": ":p_target",
        "channel": ":p_channel",
        "trace": "NULL",  # no trace context (migration outbox/0003): what an untraced call sends
        "digest": "sha256(convert_to(CAST(:id AS text), 'UTF8'))",  # the library's: in Python
    }
    with_notify = _substitute(outbox.sql.enqueue, params)
    without = _substitute(outbox.sql.enqueue_quiet, params)
    head = f"BEGIN;\n{business} \\gset\n"
    # The debounce of Outbox(notify_interval_ms=20) for clients that share one process, as the
    # Python part's clients do: in each 20 ms bucket of the database clock one client (the
    # bucket's number modulo the client count) notifies with its first enqueue, the others do
    # not. (P processes would send up to P NOTIFYs per bucket.)
    bucket = business.replace(
        "RETURNING id",
        "RETURNING id, CAST(extract(epoch FROM clock_timestamp()) * 1000 / :p_interval AS bigint)"
        " AS bucket",
    )
    debounced = (
        f"BEGIN;\n{bucket} \\gset\n"
        "\\if :bucket > :last and :client_id = :bucket % :p_clients\n"
        f"{with_notify};\n\\set last :bucket\n"
        f"\\else\n{without};\n\\endif\nCOMMIT;\n"
    )
    return {
        "plain": f"{head}COMMIT;\n",
        "+enqueue_sql": f"{head}{with_notify};\nCOMMIT;\n",
        "+debounced_sql": debounced,
        "+sql_no_notify": f"{head}{without};\nCOMMIT;\n",
    }


def run_pgbench(dsn: str, script: Path, clients: int, seconds: int, outbox: Outbox) -> float:
    """Run pgbench with one script; return its transactions per second."""
    defines = {
        "p_customer": "customer-1",
        "p_amount": "19.90",
        "p_queue": "orders",
        "p_name": JOB_NAME,
        "p_payload": json.dumps(_payload(1)),
        "p_options": json.dumps(_keep()),
        "p_max": str(outbox.max_attempts),
        "p_channel": outbox.channel,
        "p_target": sql.Identifier(outbox.table).as_string(None),
        "p_interval": str(DEFAULT_NOTIFY_INTERVAL_MS),
        "last": "0",
    }
    defines["p_clients"] = str(clients)
    return harness_pgbench(dsn, script, clients, seconds, defines, threads=min(clients, 4))


async def _pgbench_round(
    dsn: str, scripts: dict[str, Path], clients: Sequence[int], seconds: int, rotate: int
) -> dict[int, dict[str, float]]:
    """Each script at each client count for ``seconds``; the order of the scripts rotates."""
    outbox = Outbox()
    turn = rotate % len(PGBENCH_SCRIPTS)
    names = [*PGBENCH_SCRIPTS[turn:], *PGBENCH_SCRIPTS[:turn]]
    result: dict[int, dict[str, float]] = {}
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for n in clients:
            result[n] = {}
            for name in names:
                await conn.execute("TRUNCATE orders, outbox RESTART IDENTITY")
                await _checkpoint(conn)
                tps = await asyncio.to_thread(run_pgbench, dsn, scripts[name], n, seconds, outbox)
                result[n][name] = tps
    return result


# ------------------------------------------------------------- wake-up latency under traffic


class _Stamped:
    """Publishes through ``inner`` and notes when each message was in Redis (monotonic s)."""

    def __init__(self, inner: Publisher) -> None:
        self.inner = inner
        self.published: dict[str, float] = {}

    async def publish(self, messages: Sequence[OutboxMessage]) -> Sequence[BaseException | None]:
        results = await self.inner.publish(messages)
        now = time.monotonic()
        for message, result in zip(messages, results, strict=True):
            if result is None:
                self.published.setdefault(message.idempotency_key, now)
        return results


@dataclass
class Wake:
    """Per row, seconds from its COMMIT returning to the relay's claim and to Redis."""

    claim: list[float]
    redis: list[float]


async def wake_latency(
    pool: AsyncConnectionPool[Any],
    dsn: str,
    client: Redis,
    prefix: str,
    *,
    rate: float,
    seconds: float,
    poll_ms: int,
    interval_ms: int,
) -> Wake:
    """Commit → claimed and → in Redis, per row, one writer committing ``rate`` rows/s.

    A relay (``poll_interval_ms`` = ``poll_ms``, LISTEN/NOTIFY) runs while a writer commits one
    outbox row at a time on its own connection at a steady rate, with an ``Outbox`` debouncing
    its NOTIFY by ``interval_ms`` (0: every insert notifies); the relay's outbox has the same
    setting. Each row's latencies run from its COMMIT returning to the end of the claim that
    took it and to the end of the ``publish`` call that put it in Redis. A lost wake-up shows as
    a latency near ``poll_ms``.
    """
    outbox = Outbox(table="outbox_wake", notify_interval_ms=interval_ms)
    await outbox.ensure_schema(pool)
    async with pool.connection() as conn:
        await conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(outbox.table)))
    stamped = _Stamped(BullMQPublisher(client, prefix=prefix, check_server=False))
    committed: dict[str, float] = {}
    claimed: dict[str, float] = {}
    relay = OutboxRelay(PostgresOutboxStore(pool, outbox=outbox), stamped, poll_interval_ms=poll_ms)
    claim = relay.store.claim

    async def stamped_claim(**kwargs: Any) -> list[OutboxMessage]:
        messages = await claim(**kwargs)
        now = time.monotonic()
        for message in messages:
            claimed.setdefault(message.idempotency_key, now)
        return messages

    relay.store.claim = stamped_claim  # type: ignore[method-assign]
    async with relay, await psycopg.AsyncConnection.connect(dsn) as writer:
        deadline = time.monotonic() + 10
        while not relay.state.listening:
            if time.monotonic() > deadline:
                raise RuntimeError("the relay did not LISTEN within 10 s")
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        period = 1 / rate
        start = time.monotonic()
        i = 0
        while time.monotonic() - start < seconds:
            key = f"wake-{rate:g}-{interval_ms}-{i}"
            async with writer.transaction():
                await outbox.enqueue_once(
                    writer, idempotency_key=key, queue="wake", name=JOB_NAME, payload=_payload(i)
                )
            committed[key] = time.monotonic()
            i += 1
            await asyncio.sleep(max(0.0, start + i * period - time.monotonic()))
        deadline = time.monotonic() + 2 * poll_ms / 1000 + 10
        while len(stamped.published) < len(committed):
            if time.monotonic() > deadline:
                raise RuntimeError("rows were not published in time")
            await asyncio.sleep(0.01)
    return Wake(
        claim=sorted(claimed[k] - t for k, t in committed.items()),
        redis=sorted(stamped.published[k] - t for k, t in committed.items()),
    )


def _quantile(values: Sequence[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def print_wake(results: dict[tuple[int, float], Wake], poll_ms: int) -> None:
    """Print the latency distributions per NOTIFY debounce and rate."""
    print(f"\nwake-up latency under steady traffic, poll {poll_ms} ms:")
    print(
        f"{'debounce':>8} {'rows/s':>7} | {'rows':>5} | commit → claim {'p50':>5} {'p99':>6}"
        f" {'max':>6} | → in Redis {'p50':>5} {'p99':>6} | {'≥ poll/2':>8}"
    )
    for (interval, rate), wake in results.items():
        lat, claim = wake.redis, wake.claim
        slow = sum(1 for x in lat if x >= poll_ms / 2000)
        print(
            f"{interval:>6}ms {rate:>7g} | {len(lat):>5} |"
            f" {'':>14} {_quantile(claim, 0.5) * 1e3:>5.1f} {_quantile(claim, 0.99) * 1e3:>6.1f}"
            f" {claim[-1] * 1e3:>6.1f} |"
            f" {'':>10} {_quantile(lat, 0.5) * 1e3:>5.1f} {_quantile(lat, 0.99) * 1e3:>6.1f} |"
            f" {slow:>8}"
        )
    print(
        "ms. debounce: Outbox(notify_interval_ms=…) of the writer and the relay (0: every insert"
        "\nnotifies). ≥ poll/2: rows that waited half the poll interval or more (a lost wake-up"
        "\nwaits for the poll). One writer connection, one relay, BullMQPublisher on Redis."
    )


# --------------------------------------------------------------------------- orchestration


@dataclass
class Round:
    """Every measurement of one round."""

    samples: dict[str, Sample]  # by workload
    enqueue: dict[int, dict[str, Slices]]  # by client count, then variant
    pgbench: dict[int, dict[str, float]]  # by client count, then script: transactions/s
    load: float  # 1-minute load average when the round ended


def _ratio(rounds: Sequence[Round], num: str, den: str) -> list[float]:
    return sorted(r.samples[num].rate / r.samples[den].rate for r in rounds)


def _print_round(index: int, result: Round, order: Sequence[str]) -> None:
    rates = ", ".join(f"{name} {result.samples[name].rate:,.0f}/s" for name in order)
    add = result.samples["add"].rate
    bulk = result.samples["bulk"].rate
    relay = result.samples[f"relay-{DEFAULT_BATCH}"].rate
    enqueue = "; ".join(
        f"{n} client(s) plain {e['plain'].wall_us:,.0f}"
        f" +enqueue_once {e['+enqueue_once'].wall_us:,.0f}"
        for n, e in result.enqueue.items()
    )
    notify = "; ".join(
        f"{n} clients {t['+enqueue_sql']:,.0f} vs {t['+sql_no_notify']:,.0f} without NOTIFY"
        for n, t in result.pgbench.items()
    )
    print(
        f"round {index}: {rates} | relay-{DEFAULT_BATCH} ÷ add {relay / add:.2f},"
        f" ÷ bulk {relay / bulk:.2f}"
        f" | txn µs {enqueue}" + (f" | pgbench txn/s {notify}" if notify else "")
        + f" [load {result.load:.1f}]",
        flush=True,
    )  # fmt: skip


def _range(values: Sequence[float], fmt: str) -> str:
    return f"{min(values):{fmt}}–{max(values):{fmt}}"


def report(rounds: Sequence[Round], n: int, clients: Sequence[int]) -> bool:
    """Print the summary; return whether the target was met."""
    med = statistics.median
    print(f"\nthroughput, {n} jobs per workload, medians over {len(rounds)} round(s):")
    print(
        f"{'workload':>10} | {'jobs/s':>7} {'rounds':>15} | {'µs/job':>6} {'CPU µs/job':>10} |"
        f" {'÷ add':>6} {'rounds':>9} | {'÷ bulk':>6} {'rounds':>9} | {'in publish':>10}"
    )
    for name in WORKLOADS:
        rates = [r.samples[name].rate for r in rounds]
        vs_add = _ratio(rounds, name, "add")
        vs_bulk = _ratio(rounds, name, "bulk")
        share = "-"
        if name.startswith("relay"):
            share = f"{med(r.samples[name].publish / r.samples[name].elapsed for r in rounds):.0%}"
        print(
            f"{name:>10} | {med(rates):>7,.0f} {_range(rates, ',.0f'):>15} |"
            f" {1e6 / med(rates):>6.0f} {med(r.samples[name].cpu_us for r in rounds):>10.0f} |"
            f" {med(vs_add):>5.2f}× {_range(vs_add, '.2f'):>9} |"
            f" {med(vs_bulk):>5.2f}× {_range(vs_bulk, '.2f'):>9} | {share:>10}"
        )
    print(
        "÷ add, ÷ bulk: medians (and ranges) of the per-round ratios of jobs/s. µs/job: wall time"
        "\n(1e6 / median rate); CPU µs/job: this process's (user + system). in publish: share of"
        "\nthe relay's wall time spent inside BullMQPublisher.publish (the rest: claim, mark,"
        "\nbuilding the messages)."
    )
    for count in clients:
        print(
            f"\nenqueue overhead per user transaction, {count} client(s),"
            f" medians over {len(rounds)} round(s):"
        )
        print(
            f"{'variant':>14} | {'txn/s':>6} | {'µs/txn':>6} {'rounds':>11} | {'+µs':>5} |"
            f" {'× plain':>7} {'rounds':>9} | {'CPU µs':>6} {'+CPU':>5}"
        )
        for name in ENQUEUE_VARIANTS:
            mine = [r.enqueue[count][name] for r in rounds]
            base = [r.enqueue[count]["plain"] for r in rounds]
            walls = [m.wall_us for m in mine]
            ratios = [m.wall_us / b.wall_us for m, b in zip(mine, base, strict=True)]
            print(
                f"{name:>14} | {med(m.rate for m in mine):>6,.0f} |"
                f" {med(walls):>6,.0f} {_range(walls, ',.0f'):>11} |"
                f" {med(m.wall_us - b.wall_us for m, b in zip(mine, base, strict=True)):>+5.0f} |"
                f" {med(ratios):>6.2f}× {_range(ratios, '.2f'):>9} |"
                f" {med(m.cpu_us for m in mine):>6.0f}"
                f" {med(m.cpu_us - b.cpu_us for m, b in zip(mine, base, strict=True)):>+5.0f}"
            )
    print(
        "µs/txn: wall time per business transaction (BEGIN, INSERT … RETURNING id, [outbox row],"
        "\nCOMMIT), 1e6 / txn/s over all clients (at 1 client: the latency). +µs and × plain:"
        "\nmedians of the per-round differences and ratios against 'plain'. CPU µs: this"
        "\nprocess's CPU per transaction; +CPU: the extra against 'plain'."
    )
    if rounds[0].pgbench:
        print(
            "\npgbench, business transaction ± the enqueue statement,"
            f" medians over {len(rounds)} round(s):"
        )
        print(
            f"{'clients':>7} | {'plain':>7} {'+enqueue_sql':>12} {'+debounced_sql':>14}"
            f" {'+sql_no_notify':>14} txn/s | {'every ÷ without':>15} {'rounds':>9} |"
            f" {'debounced ÷ without':>19} {'rounds':>9}"
        )
        for count in rounds[0].pgbench:
            tps = {name: med(r.pgbench[count][name] for r in rounds) for name in PGBENCH_SCRIPTS}
            every = sorted(
                r.pgbench[count]["+enqueue_sql"] / r.pgbench[count]["+sql_no_notify"]
                for r in rounds
            )
            debounced = sorted(
                r.pgbench[count]["+debounced_sql"] / r.pgbench[count]["+sql_no_notify"]
                for r in rounds
            )
            print(
                f"{count:>7} | {tps['plain']:>7,.0f} {tps['+enqueue_sql']:>12,.0f}"
                f" {tps['+debounced_sql']:>14,.0f} {tps['+sql_no_notify']:>14,.0f}       |"
                f" {med(every):>14.2f}× {_range(every, '.2f'):>9} |"
                f" {med(debounced):>18.2f}× {_range(debounced, '.2f'):>9}"
            )
        print(
            "pgbench -M prepared runs the same transactions with no Python client: the enqueue"
            "\nstatement as rendered by the library, with its pg_notify on every insert, debounced"
            "\n(one insert per 20 ms over all clients notifies, as in one process), and without"
            "\nit. PostgreSQL takes a cluster-wide lock for a transaction that notifies and holds"
            "\nit until after its commit record is flushed, so notifying commits cannot share a"
            "\nWAL flush."
        )
    met = False
    print()
    if 8 in clients:

        def vs(num: str, den: str) -> list[float]:
            return sorted(r.enqueue[8][num].rate / r.enqueue[8][den].rate for r in rounds)

        ratios = vs("+enqueue_once", "+once_no_notify")
        every = vs("+once_notify_all", "+once_no_notify")
        raw = vs("+enqueue_once", "+sql_no_notify")
        verdict = "MET" if statistics.median(ratios) >= NOTIFY_TARGET else "NOT MET"
        print(
            f"target: +enqueue_once ≥ {NOTIFY_TARGET}× +once_no_notify at 8 clients:"
            f" {statistics.median(ratios):.2f}× ({_range(ratios, '.2f')}), {verdict};"
            f" notifying every insert: {statistics.median(every):.2f}× ({_range(every, '.2f')});"
            f" +enqueue_once ÷ the bare statement without NOTIFY (+sql_no_notify):"
            f" {statistics.median(raw):.2f}× ({_range(raw, '.2f')})"
        )
    for batch in RELAY_BATCHES:
        ratio = statistics.median(_ratio(rounds, f"relay-{batch}", "bulk"))
        verdict = "MET" if ratio >= TARGET else "NOT MET"
        mark = " (default batch_size)" if batch == DEFAULT_BATCH else ""
        print(f"target: relay-{batch}{mark} ≥ {TARGET}× bare addBulk: {ratio:.2f}×, {verdict}")
        met = met or (batch == DEFAULT_BATCH and ratio >= TARGET)
    return met


def _dsn_for(url: str, dbname: str) -> str:
    params = {k: str(v) for k, v in conninfo_to_dict(url).items()}
    params["dbname"] = dbname
    return make_conninfo(**params)


async def run(
    args: argparse.Namespace,
    dsn: str,
    prefix: str,
    clients: Sequence[int],
    pgbench: Sequence[int],
    scripts: dict[str, Path],
) -> list[Round]:
    """Set up the scratch schema, warm up, run the rounds; delete the Redis keys at the end."""
    client = connect(args.redis_url, socket_timeout_s=5.0, connect_timeout_s=5.0)
    if not isinstance(client, Redis):
        raise SystemExit("the outbox benchmark runs on one Redis server, not a cluster")
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn, min_size=1, max_size=4, kwargs={"autocommit": True}, open=False
    )  # as `sdcore relay` builds its pool
    rounds: list[Round] = []
    try:
        await pool.open(wait=True, timeout=30)
        bench = Bench(pool, client, prefix)
        info = await client.info("server")
        print(f"Redis {info.get('redis_version', '?')}, key prefix {prefix!r}")
        async for _ in client.scan_iter(match=f"{prefix}:*", count=1000):
            raise RuntimeError(f"keys under {prefix!r} already exist")
        try:
            workloads = _workloads(bench)
            for outbox in (
                Outbox(),
                *(w.outbox for w in workloads if isinstance(w, RelayWorkload)),
            ):
                await outbox.ensure_schema(pool)
            async with pool.connection() as conn:
                await conn.execute(BUSINESS_DDL)
            warm = min(args.messages, WARMUP)  # Lua scripts loaded, statements prepared
            if args.only_wake:
                wake = {
                    (interval, rate): await wake_latency(
                        pool, dsn, client, prefix, rate=rate, seconds=args.wake_seconds,
                        poll_ms=args.wake_poll_ms, interval_ms=interval,
                    )
                    for rate in args.wake_rates
                    for interval in (0, DEFAULT_NOTIFY_INTERVAL_MS)
                }  # fmt: skip
                print_wake(wake, args.wake_poll_ms)
                return rounds
            await _throughput_round(bench, workloads, warm, warm, 0)
            for r in range(args.rounds):
                samples = await _throughput_round(bench, workloads, args.messages, args.chunk, r)
                order = [*WORKLOADS[r % len(WORKLOADS) :], *WORKLOADS[: r % len(WORKLOADS)]]
                enqueue = {
                    n: await _enqueue_round(dsn, n, args.enqueue_seconds, args.slice)
                    for n in clients
                }
                notify = (
                    await _pgbench_round(dsn, scripts, pgbench, args.pgbench_seconds, r)
                    if pgbench
                    else {}
                )
                result = Round(samples, enqueue, notify, os.getloadavg()[0])
                rounds.append(result)
                _print_round(r + 1, result, order)
            if args.wake_seconds > 0:
                wake = {
                    (interval, rate): await wake_latency(
                        pool, dsn, client, prefix, rate=rate, seconds=args.wake_seconds,
                        poll_ms=args.wake_poll_ms, interval_ms=interval,
                    )
                    for rate in args.wake_rates
                    for interval in (0, DEFAULT_NOTIFY_INTERVAL_MS)
                }  # fmt: skip
                print_wake(wake, args.wake_poll_ms)
        finally:
            deleted = await bench.delete_keys()
            print(f"deleted {deleted} Redis key(s) under {prefix!r}")
    finally:
        await client.aclose()
        await pool.close()
    return rounds


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--database-url",
        default=os.environ.get("SDCORE_BENCH_DATABASE_URL", DEFAULT_URL),
        help="server to benchmark on (a scratch database is created there and dropped)",
    )
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("SDCORE_BENCH_REDIS_URL", DEFAULT_REDIS_URL),
        help="Redis for the queues (keys under a unique prefix, deleted at the end)",
    )
    parser.add_argument("--messages", type=int, default=6000, help="jobs per workload (6000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument(
        "--chunk", type=int, default=2000, help="jobs per workload between alternations (2000)"
    )
    parser.add_argument(
        "--enqueue-seconds", type=float, default=3.0, help="per enqueue variant and round (3)"
    )
    parser.add_argument(
        "--enqueue-clients", default="1,8", help="client counts of the enqueue part (1,8)"
    )
    parser.add_argument(
        "--pgbench-clients",
        default="1,8,32",
        help="client counts of the pgbench NOTIFY comparison (1,8,32; '' skips it)",
    )
    parser.add_argument(
        "--pgbench-seconds", type=int, default=3, help="per pgbench script and round (3)"
    )
    parser.add_argument(
        "--slice", type=float, default=0.25, help="enqueue variant alternation slice (0.25 s)"
    )
    parser.add_argument(
        "--wake-seconds",
        type=float,
        default=5.0,
        help="steady traffic per rate for the wake-up latency (5; 0 skips it)",
    )
    parser.add_argument(
        "--wake-rates", default="20,200", help="writer rows/s of the wake-up part (20,200)"
    )
    parser.add_argument(
        "--wake-poll-ms", type=int, default=1000, help="relay poll interval there (1000)"
    )
    parser.add_argument(
        "--only-wake", action="store_true", help="run only the wake-up latency measurement"
    )
    args = parser.parse_args(argv)
    try:
        args.wake_rates = [float(part) for part in args.wake_rates.split(",") if part.strip()]
    except ValueError:
        parser.error("--wake-rates must be a list of numbers")
    if not args.wake_rates or min(args.wake_rates) <= 0 or args.wake_poll_ms < 10:
        parser.error("--wake-rates must be positive and --wake-poll-ms at least 10")
    if args.only_wake and args.wake_seconds <= 0:
        parser.error("--only-wake needs a positive --wake-seconds")
    if args.messages < 1 or args.rounds < 1 or args.chunk < 1:
        parser.error("--messages, --rounds and --chunk must be positive")
    try:
        clients = [int(part) for part in args.enqueue_clients.split(",") if part.strip()]
        pgbench = [int(part) for part in args.pgbench_clients.split(",") if part.strip()]
    except ValueError:
        parser.error("--enqueue-clients and --pgbench-clients must be lists of integers")
    if not clients or min(clients) < 1 or min(pgbench, default=1) < 1:
        parser.error("client counts must be positive")
    if args.pgbench_seconds < 1:
        parser.error("--pgbench-seconds must be positive")
    if pgbench and shutil.which("pgbench") is None:
        print("note: pgbench is not on PATH; skipping the pgbench NOTIFY comparison")
        pgbench = []
    if not 0.01 <= args.slice <= args.enqueue_seconds:
        parser.error("--slice must be between 0.01 and --enqueue-seconds")

    dbname = f"sdcore_bench_outbox_{os.getpid()}"
    prefix = f"sdbench-outbox-{os.getpid()}-{secrets.token_hex(4)}"
    admin = psycopg.connect(args.database_url, autocommit=True)
    version = admin.execute("SHOW server_version").fetchone()
    settings = admin.execute(
        "SELECT string_agg(name || '=' || setting, ' ' ORDER BY name) FROM pg_settings"
        " WHERE name IN ('fsync', 'synchronous_commit', 'wal_sync_method', 'shared_buffers')"
    ).fetchone()
    admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    print(
        f"outbox: {args.rounds} round(s) × {args.messages} jobs per workload in chunks of"
        f" {args.chunk}; enqueue variants"
        f" {args.enqueue_seconds} s each per round in {args.slice} s slices at {clients} client(s);"
        f" pgbench {args.pgbench_seconds} s per script at {pgbench or 'no'} clients"
    )
    print(f"PostgreSQL {version[0] if version else '?'} ({settings[0] if settings else ''})")
    print(
        f"Python {platform.python_version()}, psycopg {psycopg.__version__}"
        f" ({psycopg.pq.__impl__}), redis-py {redis.__version__}, {os.cpu_count()} CPUs,"
        f" {platform.platform()}, load average {os.getloadavg()[0]:.1f}"
    )
    try:
        with tempfile.TemporaryDirectory(prefix="sdcore-bench-") as tmp:
            scripts: dict[str, Path] = {}
            for name, text in pgbench_scripts(Outbox()).items():
                scripts[name] = Path(tmp) / f"{name.strip('+')}.sql"
                scripts[name].write_text(text)
            dsn = _dsn_for(args.database_url, dbname)
            rounds = asyncio.run(run(args, dsn, prefix, clients, pgbench, scripts))
    finally:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
        )
        admin.close()
    if rounds:
        report(rounds, args.messages, clients)
    return 0


if __name__ == "__main__":
    sys.exit(main())
