"""Lease cycles through PgBouncer transaction pooling: what pinning each statement's settings costs.

A *lease cycle* is one ``acquire`` of a fresh run and its ``complete`` (as in ``lease.py``), on one
client connection. Workloads, each timed in short alternating slices so that load from elsewhere
hits all of them alike:

``bare``
    One psycopg connection through PgBouncer (``prepare_threshold=None``), the library's rendered
    statements sent as they are: the floor, and *unsafe* (another client's ``SET`` reaches them).
``prelude``
    The same connection and statements, each sent as sdcore sends it in transaction-pooling
    mode: one simple-protocol message ``SET TRANSACTION …; SELECT set_config(…, true) …;
    <statement>`` (client-side binding).
``pipeline``
    The alternative: a libpq pipeline of ``SELECT set_config(…, true)`` and the statement, one
    Sync (one implicit transaction, extended protocol, one round trip).
``sdcore``
    ``JobSchedulerService.connect(pgbouncer, pool=PoolSettings(transaction_pooling=True))``
    through the public API.

Usage::

    python benchmarks/pooling.py [--database-url URL] [--seconds S] [--slice S]

A scratch database is created on the server of ``--database-url`` (default
``$SDCORE_BENCH_DATABASE_URL`` or ``postgresql://postgres@127.0.0.1:5432/postgres``), a PgBouncer
of our own (Debian's ``pgbouncer``, as the postgres OS user) in transaction mode is started in
front of it, and both are removed at the end. Exits 0 whatever the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import AsyncClientCursor, AsyncCursor
from psycopg.conninfo import conninfo_to_dict, make_conninfo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests._servers import pgbouncer

from sdcore.job_scheduler import JobAcquireOptions, JobSchedulerService
from sdcore.job_scheduler._sql import LeaseStatements
from sdcore.postgres import PoolSettings, schema_sql
from sdcore.postgres._pooling import _ISOLATION, statement_prelude
from sdcore.postgres._schema import qualified

Cycle = Callable[[int], Awaitable[None]]
SQL = LeaseStatements.render(qualified("job_scheduler", None))


def _params(i: int) -> tuple[tuple[Any, ...], str]:
    token = str(uuid.uuid4())
    key = f"v2:{uuid.uuid4().hex}{uuid.uuid4().hex}"
    return (key, key, "bench", "bench", "SCHEDULE", f"r{i}", token, 60_000), token


async def _bare(conn: psycopg.AsyncConnection[Any]) -> Cycle:
    async def cycle(i: int) -> None:
        params, token = _params(i)
        row = await (await conn.execute(SQL.acquire, params)).fetchone()
        assert row is not None
        await conn.execute(SQL.finalize, ("SUCCESS", None, row[0], token))

    return cycle


async def _prelude(conn: psycopg.AsyncConnection[Any]) -> Cycle:
    prelude = (
        _ISOLATION + statement_prelude(conn, statement_timeout_ms=30_000, search_path=None)
    ).replace(b"%", b"%%")
    cur = AsyncClientCursor(conn)

    async def run(query: bytes, params: tuple[Any, ...]) -> AsyncClientCursor[Any]:
        await cur.execute(prelude + query, params)
        cur.nextset()
        cur.nextset()
        return cur

    async def cycle(i: int) -> None:
        params, token = _params(i)
        row = await (await run(SQL.acquire, params)).fetchone()
        assert row is not None
        await run(SQL.finalize, ("SUCCESS", None, row[0], token))

    return cycle


async def _pipeline(conn: psycopg.AsyncConnection[Any]) -> Cycle:
    settings = statement_prelude(conn, statement_timeout_ms=30_000, search_path=None)[:-2]

    async def run(query: bytes, params: tuple[Any, ...]) -> AsyncCursor[Any]:
        async with conn.pipeline():
            await AsyncCursor(conn).execute(settings)
            cur = await conn.execute(query, params)
        return cur

    async def cycle(i: int) -> None:
        params, token = _params(i)
        row = await (await run(SQL.acquire, params)).fetchone()
        assert row is not None
        await run(SQL.finalize, ("SUCCESS", None, row[0], token))

    return cycle


def _sdcore(jobs: JobSchedulerService) -> Cycle:
    async def cycle(i: int) -> None:
        result = await jobs.acquire(JobAcquireOptions(code="bench", run_key=f"s{uuid.uuid4()}"))
        assert result.acquired
        await jobs.complete(result.lease)

    return cycle


async def _slice(cycle: Cycle, seconds: float) -> float:
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        await cycle(done)
        done += 1
    return done / (time.perf_counter() - started)


async def measure(dsn: str, seconds: float, slice_s: float) -> dict[str, list[float]]:
    """Alternate the workloads in slices until each ran ``seconds``; return cycles/s per slice."""
    async with (
        await psycopg.AsyncConnection.connect(dsn, autocommit=True, prepare_threshold=None) as c,
        JobSchedulerService.connect(
            dsn, pool=PoolSettings(transaction_pooling=True, max_size=1)
        ) as jobs,
    ):
        await jobs.ensure_schema()
        cycles = {
            "bare": await _bare(c),
            "prelude": await _prelude(c),
            "pipeline": await _pipeline(c),
            "sdcore": _sdcore(jobs),
        }
        for cycle in cycles.values():  # warm up
            await _slice(cycle, 0.2)
        rates: dict[str, list[float]] = {name: [] for name in cycles}
        names = list(cycles)
        for round_no in range(max(1, int(seconds / slice_s))):
            order = names if round_no % 2 == 0 else names[::-1]
            for name in order:
                rates[name].append(await _slice(cycles[name], slice_s))
        return rates


def main() -> int:
    """Run the benchmark and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--database-url",
        default=os.environ.get(
            "SDCORE_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--slice", type=float, default=0.5)
    args = parser.parse_args()
    params = {k: str(v) for k, v in conninfo_to_dict(args.database_url).items()}
    scratch = f"sdcore_bench_pooling_{os.getpid()}"
    with psycopg.connect(args.database_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{scratch}"'.encode())
    try:
        with psycopg.connect(make_conninfo(**{**params, "dbname": scratch}), autocommit=True) as c:
            c.execute(schema_sql().encode())
        host, port = params.get("host", "127.0.0.1"), int(params.get("port", "5432"))
        with pgbouncer(
            upstream_host=host, upstream_port=port, mode="transaction", pool_size=2
        ) as pgb:
            rates = asyncio.run(measure(pgb.dsn(scratch), args.seconds, args.slice))
    finally:
        with psycopg.connect(args.database_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{scratch}" WITH (FORCE)'.encode())
    base = statistics.median(rates["bare"])
    print(f"PgBouncer transaction mode, 1 client, {args.seconds:.0f} s per workload")
    slices = len(rates["bare"])
    print(f"{'workload':10s} {'cycles/s':>9s} {'ratio':>6s}  (median of {slices} slices)")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:10s} {median:9.0f} {median / base:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
