"""A contended tick: N replicas race for one run key; what do the losers cost?

Every tick, N clients (each on its own connection, started together behind a barrier) acquire
the same fresh run key; one wins and completes it. Measured per replica count:

``sdcore``
    ``JobSchedulerService.acquire`` through the public API, one service per client.
``floor``
    The cheapest statement that decides a race at all, on bare psycopg:
    ``INSERT … ON CONFLICT (lock_key) DO NOTHING RETURNING id`` (a loser waits for the winner's
    unique-index entry, then does nothing: no row lock, no WAL) — a lower bound no lease that can
    also take over expired rows can beat.

Reported: the summed acquire time of all N clients per tick (client round trips: the closest
measure of what the server spends without ``pg_stat_statements``), the losers' p50 / p99, and the
ratios 30 / 3 replicas. Targets (issue 14): the summed time at 30 ≤ 5× that at 3, loser p99 ≤ 5 ms.
``sdcore`` and ``floor`` alternate tick by tick.

Usage::

    python benchmarks/contention.py [--database-url URL] [--replicas 3,10,30] [--ticks 200]
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import base_parser, machine, scratch_database, summary

from sdcore.job_scheduler import JobSchedulerService

FLOOR = """
INSERT INTO floor_jobs (lock_key, owner_token) VALUES (%s, %s::uuid)
ON CONFLICT (lock_key) DO NOTHING RETURNING id
"""
FLOOR_DDL = """
CREATE TABLE IF NOT EXISTS floor_jobs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    lock_key text NOT NULL UNIQUE,
    owner_token uuid NOT NULL
)"""


class Result:
    """Per workload: summed acquire time per tick (ms) and every loser's latency (ms)."""

    def __init__(self) -> None:
        self.tick_sums: list[float] = []
        self.losers: list[float] = []
        self.winners = 0


async def _sdcore_tick(services: Sequence[JobSchedulerService], key: str, result: Result) -> None:
    barrier = asyncio.Barrier(len(services))
    times: list[tuple[float, bool]] = []

    async def one(service: JobSchedulerService) -> None:
        await barrier.wait()
        start = time.perf_counter()
        outcome = await service.acquire({"code": "contended", "run_key": key, "lease_ms": 60_000})
        elapsed = (time.perf_counter() - start) * 1000
        times.append((elapsed, outcome.acquired))
        if outcome.acquired:
            await service.complete(outcome.lease)

    await asyncio.gather(*(one(s) for s in services))
    _record(times, result)


async def _floor_tick(
    conns: Sequence[psycopg.AsyncConnection[Any]], key: str, result: Result
) -> None:
    barrier = asyncio.Barrier(len(conns))
    times: list[tuple[float, bool]] = []

    async def one(conn: psycopg.AsyncConnection[Any]) -> None:
        await barrier.wait()
        start = time.perf_counter()
        cur = await conn.execute(FLOOR, (key, str(uuid.uuid4())))
        won = await cur.fetchone() is not None
        times.append(((time.perf_counter() - start) * 1000, won))

    await asyncio.gather(*(one(c) for c in conns))
    _record(times, result)


def _record(times: list[tuple[float, bool]], result: Result) -> None:
    winners = [t for t, won in times if won]
    if len(winners) != 1:
        raise RuntimeError(f"{len(winners)} winners in one tick")
    result.winners += 1
    result.tick_sums.append(sum(t for t, _ in times))
    result.losers.extend(t for t, won in times if not won)


async def _measure(dsn: str, replicas: int, ticks: int) -> tuple[Result, Result]:
    services = []
    conns: list[psycopg.AsyncConnection[Any]] = []
    sdcore, floor = Result(), Result()
    try:
        for _ in range(replicas):
            cm = JobSchedulerService.connect(dsn, min_size=1, max_size=2)
            services.append((cm, await cm.__aenter__()))
            conns.append(await psycopg.AsyncConnection.connect(dsn, autocommit=True))
        live = [s for _, s in services]
        for i in range(3):  # warm: connections configured, statements prepared
            await _sdcore_tick(live, f"warm-{replicas}-{i}", Result())
            await _floor_tick(conns, f"warm-{replicas}-{i}", Result())
        for i in range(ticks):
            key = f"{replicas}-{i}-{uuid.uuid4().hex[:8]}"
            if i % 2 == 0:
                await _sdcore_tick(live, key, sdcore)
                await _floor_tick(conns, key, floor)
            else:
                await _floor_tick(conns, key, floor)
                await _sdcore_tick(live, key, sdcore)
    finally:
        for cm, _ in services:
            await cm.__aexit__(None, None, None)
        for conn in conns:
            await conn.close()
    return sdcore, floor


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("contended tick: the losers' cost")
    parser.add_argument("--replicas", default="3,10,30", help="comma-separated replica counts")
    parser.add_argument("--ticks", type=int, default=200, help="ticks per replica count")
    args = parser.parse_args(argv)
    counts = [int(part) for part in args.replicas.split(",")]
    with scratch_database(args.database_url, "sdcore_bench_contention") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            print(machine(conn))
            conn.execute(FLOOR_DDL)
        asyncio.run(_schema(dsn))
        sums: dict[int, tuple[float, float]] = {}
        for replicas in counts:
            sdcore, floor = asyncio.run(_measure(dsn, replicas, args.ticks))
            s_sum, f_sum = summary(sdcore.tick_sums), summary(floor.tick_sums)
            s_lose, f_lose = summary(sdcore.losers), summary(floor.losers)
            sums[replicas] = (s_sum["p50"], f_sum["p50"])
            print(
                f"{replicas:>3} replicas, {args.ticks} ticks, exactly one winner each:"
                f" summed acquire time per tick p50 sdcore {s_sum['p50']:.2f} ms /"
                f" floor {f_sum['p50']:.2f} ms;"
                f" loser p50/p99 sdcore {s_lose['p50']:.2f}/{s_lose['p99']:.2f} ms,"
                f" floor {f_lose['p50']:.2f}/{f_lose['p99']:.2f} ms"
            )
        if len(counts) >= 2:
            low, high = counts[0], counts[-1]
            growth = sums[high][0] / sums[low][0]
            floor_growth = sums[high][1] / sums[low][1]
            print(
                f"summed time {high}/{low} replicas: sdcore {growth:.1f}x,"
                f" floor {floor_growth:.1f}x (target ≤ 5x); replicas grew {high / low:.0f}x"
            )
    return 0


async def _schema(dsn: str) -> None:
    async with JobSchedulerService.connect(dsn, max_size=1) as jobs:
        await jobs.ensure_schema()


if __name__ == "__main__":
    sys.exit(main())
