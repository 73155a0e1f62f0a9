"""The schedules control plane: sync cost of 10,000 declared schedules, propagation of an action.

``sync``
    One replica declaring ``--schedules`` interval schedules starts its ``ScheduleControl`` (the
    upsert of every schedule, the replica and its declarations in one transaction, then the read
    of the paused state): first start on an empty table, then restarts of replicas with the same
    code (rows unchanged), then a restart where every definition changed. Also
    ``PostgresScheduleStore.sync`` alone.
``propagation``
    ``--replicas`` in-process replicas (each its own pool and, with LISTEN, its own listening
    connection); ``ScheduleAdmin.pause``/``resume`` alternately, ``--rounds`` times; the delay
    from the action's commit to each replica holding the new state (p50 / p99), with
    LISTEN/NOTIFY and poll-only (``listen=False``, poll every 1 s: PgBouncer transaction
    pooling).

``saturated``
    One default ``Runtime`` (pool 10, LISTEN) runs ``export`` every 250 ms with ``overlap="allow"``;
    each run holds one of ``runtime.pool``'s connections for 8 s, so the application's pool stays
    exhausted (the load an operator pauses). Pause/resume alternately, ``--rounds`` times, from
    the operator's own pool: the delay from the action's commit to the replica holding it, and
    the ticks that started more than 2 s after a pause's commit.

Prints figures only; exits 0 whatever they are. Targets: sync of 10,000 "well under a second";
propagation within 2 s (also under a saturated pool).

Usage::

    python benchmarks/control.py [--database-url URL] [--schedules 10000] [--replicas 3]
        [--rounds 20] [--only sync|propagation|saturated]
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import base_parser, machine, scratch_database, summary

from sdcore.job_scheduler import JobSchedulerService
from sdcore.scheduling import PostgresScheduleStore, ScheduleAdmin, ScheduleControl, Scheduler, Tick


async def _noop(tick: Tick) -> None:
    return None


def _scheduler(jobs: JobSchedulerService, count: int, every_base: int) -> Scheduler:
    scheduler = Scheduler(jobs=jobs)
    for index in range(count):
        scheduler.add_interval(f"s{index:05d}", every_base + index, _noop)
    return scheduler


async def _pool(dsn: str, size: int = 4) -> AsyncConnectionPool[Any]:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn, min_size=1, max_size=size, kwargs={"autocommit": True}, open=False
    )
    await pool.open(wait=True, timeout=30)
    return pool


async def bench_sync(dsn: str, count: int, rounds: int) -> None:
    pool = await _pool(dsn)
    try:
        jobs = JobSchedulerService(pool, max_connections=2)
        await jobs.ensure_schema()
        store = PostgresScheduleStore(pool)
        await store.ensure_schema()

        async def start_once(every_base: int) -> float:
            control = ScheduleControl(_scheduler(jobs, count, every_base), store)
            began = time.perf_counter()
            await control.start()
            took = time.perf_counter() - began
            await control.aclose()
            return took

        first = await start_once(60_000)
        same = [await start_once(60_000) for _ in range(rounds)]
        changed = [await start_once(120_000 + 7 * r) for r in range(rounds)]
        control = ScheduleControl(_scheduler(jobs, count, 60_000), store)
        from sdcore.scheduling._plane import _declared

        declared = [_declared(e) for e in control.scheduler._entries.values()]
        alone = []
        for _ in range(rounds):
            began = time.perf_counter()
            await store.sync(control.replica, declared)
            alone.append(time.perf_counter() - began)
        await store.leave(control.replica)
        print(f"sync of {count} declared schedules (seconds):")
        print(f"  first start, empty table      {first:.3f}")
        print(f"  restart, same code            {_fmt(summary(same))}")
        print(f"  restart, every one changed    {_fmt(summary(changed))}")
        print(f"  PostgresScheduleStore.sync    {_fmt(summary(alone))}")
    finally:
        await pool.close()


def _fmt(s: dict[str, float]) -> str:
    if not s.get("n"):
        return "n/a"
    return f"p50 {s['p50']:.3f}  p99 {s['p99']:.3f}  (n={int(s['n'])}, max {s['max']:.3f})"


async def bench_propagation(dsn: str, replicas: int, rounds: int, *, listen: bool) -> list[float]:
    admin_pool = await _pool(dsn, 2)
    pools = [await _pool(dsn, 3) for _ in range(replicas)]
    controls = []
    try:
        for pool in pools:
            jobs = JobSchedulerService(pool, max_connections=1)
            scheduler = Scheduler(jobs=jobs)
            scheduler.add_interval("beat", 3_600_000, _noop)
            control = ScheduleControl(
                scheduler, PostgresScheduleStore(pool), listen=listen, poll_interval_ms=1_000
            )
            await control.start()
            controls.append(control)
        admin = ScheduleAdmin(PostgresScheduleStore(admin_pool))
        await asyncio.sleep(0.5)  # LISTEN established
        delays: list[float] = []
        for round_ in range(rounds):
            pausing = round_ % 2 == 0
            began = time.perf_counter()
            if pausing:
                await admin.pause("beat", actor="bench")
            else:
                await admin.resume("beat", actor="bench")
            committed = time.perf_counter()
            pending = dict(enumerate(controls))
            while pending:
                for i, control in list(pending.items()):
                    if control.paused("beat") == pausing:
                        delays.append(time.perf_counter() - committed)
                        del pending[i]
                if time.perf_counter() - began > 10:
                    raise RuntimeError("an action did not propagate within 10 s")
                await asyncio.sleep(0.001)
            # A random phase against the replicas' 1 s poll timers (else poll-only would always
            # land just after a poll and measure ~1 s).
            await asyncio.sleep(random.uniform(0.05, 1.05))
        return delays
    finally:
        for control in controls:
            await control.aclose()
        for pool in [admin_pool, *pools]:
            await pool.close()


async def bench_saturated(dsn: str, rounds: int) -> tuple[list[float], int]:
    """Pause/resume propagation to a ``Runtime`` whose application pool is exhausted."""
    from sdcore import Runtime

    admin_pool = await _pool(dsn, 2)
    runtime = Runtime(database_url=dsn)
    paused_at: list[float] = []  # commit instants of pauses still held
    late = 0

    async def export(tick: Tick) -> None:
        nonlocal late
        if paused_at and time.perf_counter() - paused_at[-1] > 2.0:
            late += 1
        async with runtime.pool.connection():
            await asyncio.sleep(8.0)

    runtime.scheduler.add_interval("export", 250, export, overlap="allow")
    delays: list[float] = []
    try:
        async with runtime:
            admin = ScheduleAdmin(PostgresScheduleStore(admin_pool))
            await asyncio.sleep(4.0)  # the handlers hold every free connection by now
            for round_ in range(rounds):
                pausing = round_ % 2 == 0
                if pausing:
                    await admin.pause("export", actor="bench")
                    paused_at.append(time.perf_counter())
                else:
                    await admin.resume("export", actor="bench")
                    paused_at.clear()
                committed = time.perf_counter()
                while runtime.control.paused("export") != pausing:
                    if time.perf_counter() - committed > 30:
                        raise RuntimeError("an action did not reach the replica within 30 s")
                    await asyncio.sleep(0.001)
                delays.append(time.perf_counter() - committed)
                await asyncio.sleep(random.uniform(1.0, 2.0))
            paused_at.clear()
    finally:
        await admin_pool.close()
    return delays, late


async def main() -> None:
    parser = base_parser(__doc__.splitlines()[0] if __doc__ else "control plane")
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--only", choices=("sync", "propagation", "saturated"), default=None)
    args = parser.parse_args()
    with scratch_database(args.database_url, "sdcore_bench_control") as dsn:
        with psycopg.connect(dsn) as conn:
            print(machine(conn))
        if args.only in (None, "sync"):
            await bench_sync(dsn, args.schedules, max(3, args.rounds // 4))
        if args.only in (None, "saturated"):
            delays, late = await bench_saturated(dsn, args.rounds)
            s = summary([d * 1000 for d in delays])
            print(
                f"propagation of pause/resume to a Runtime with its pool exhausted: "
                f"p50 {s['p50']:.1f} ms  p99 {s['p99']:.1f} ms  max {s['max']:.1f} ms "
                f"(n={int(s['n'])}); ticks started > 2 s after a pause: {late}"
            )
        for listen in (True, False) if args.only in (None, "propagation") else ():
            delays = await bench_propagation(dsn, args.replicas, args.rounds, listen=listen)
            mode = "LISTEN/NOTIFY" if listen else "poll-only (1 s)"
            ms = [d * 1000 for d in delays]
            s = summary(ms)
            print(
                f"propagation of pause/resume to {args.replicas} replicas, {mode}: "
                f"p50 {s['p50']:.1f} ms  p99 {s['p99']:.1f} ms  max {s['max']:.1f} ms "
                f"(n={int(s['n'])})"
            )


if __name__ == "__main__":
    asyncio.run(main())
