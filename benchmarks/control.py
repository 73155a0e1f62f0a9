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

``history``
    The run history's writes for ``--ticks`` exclusive ticks due at one instant, every tick's
    start and end requested at once (``asyncio.gather``) on one 10-connection pool (the
    ``Runtime``'s application pool, where the history goes): one ``run_started`` and one
    ``run_finished`` statement per tick, each awaited in the tick's task as ``RunHistory`` did
    before it group-committed (*single*), against ``RunHistory`` itself (*batched*), alternating,
    a quarter of ``--rounds`` times each (at least 3), the history table emptied before each.
    Wall time from the first request to the last end recorded, when the last handler started,
    and statements sent.

Prints figures only; exits 0 whatever they are. Targets: sync of 10,000 "well under a second";
propagation within 2 s (also under a saturated pool).

Usage::

    python benchmarks/control.py [--database-url URL] [--schedules 10000] [--replicas 3]
        [--rounds 20] [--ticks 10000] [--only sync|propagation|saturated|history]
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collections.abc import Sequence
from datetime import UTC, datetime

from _harness import base_parser, machine, scratch_database, summary

from sdcore.job_scheduler import JobExecutionLease, JobSchedulerService
from sdcore.postgres import derived_name
from sdcore.scheduling import PostgresScheduleStore, ScheduleAdmin, ScheduleControl, Scheduler, Tick
from sdcore.scheduling._control import Replica, RunFinish, RunStart
from sdcore.scheduling._history import RunHistory


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


class _Counted(PostgresScheduleStore):
    """The store, counting the history statements it sends."""

    statements = 0

    async def runs_started(self, runs: Sequence[RunStart]) -> list[int]:
        self.statements += 1
        return await super().runs_started(runs)

    async def runs_finished(self, runs: Sequence[RunFinish]) -> None:
        self.statements += 1
        await super().runs_finished(runs)


def _ticks(count: int) -> list[Tick]:
    at = datetime.now(UTC).replace(microsecond=0)
    run_key = at.strftime("%Y-%m-%dT%H:%M:%SZ")
    owner = str(uuid.uuid4())
    return [
        Tick(
            schedule=f"s{i:05d}",
            scheduled_at=at,
            local_time=at,
            run_key=run_key,
            lease=JobExecutionLease(
                id=str(i),
                owner_token=owner,
                idempotency_key=f"s{i:05d}:{run_key}",
                fencing_token=i + 1,
            ),
        )
        for i in range(count)
    ]


async def _history_round(store: _Counted, count: int, *, batched: bool) -> tuple[float, float, int]:
    """(wall time, last handler start after the first request, statements) for ``count`` ticks."""
    replica = Replica(replica_id=str(uuid.uuid4()), host="bench", pid=1)
    ticks = _ticks(count)
    store.statements = 0
    last_start = 0.0
    began = time.perf_counter()

    async def handler(tick: Tick) -> None:
        nonlocal last_start
        last_start = time.perf_counter() - began
        await asyncio.sleep(0)

    if batched:
        history = RunHistory(store, replica, logging.getLogger("bench.history"))
        history.loop = asyncio.get_running_loop()
        recorded = history.wrap("bench", handler)

        async def one(tick: Tick) -> None:
            await recorded(tick)

    else:

        async def one(tick: Tick) -> None:
            lease = tick.lease
            run_id = await store.run_started(
                RunStart(
                    schedule=tick.schedule,
                    run_key=tick.run_key or "initial",
                    source="tick",
                    scheduled_at=tick.scheduled_at,
                    attempt=tick.attempt,
                    fencing_token=None if lease is None else lease.fencing_token,
                    replica=replica,
                )
            )
            await handler(tick)
            await store.run_finished(run_id, "SUCCESS", None)

    await asyncio.gather(*(one(tick) for tick in ticks))
    return time.perf_counter() - began, last_start, store.statements


async def bench_history(dsn: str, count: int, rounds: int) -> None:
    pool = await _pool(dsn, 10)
    try:
        store = _Counted(pool)
        await store.ensure_schema()
        runs = derived_name(store.table, "runs")
        figures: dict[bool, list[tuple[float, float, int]]] = {False: [], True: []}
        for round_ in range(rounds):
            for batched in (False, True) if round_ % 2 == 0 else (True, False):
                async with pool.connection() as conn:
                    await conn.execute(f"TRUNCATE {runs}")
                    await conn.execute(f"VACUUM ANALYZE {runs}")
                figures[batched].append(await _history_round(store, count, batched=batched))
        print(f"run history of {count} ticks due at once, {rounds} rounds each (seconds):")
        for batched in (False, True):
            wall = summary([f[0] for f in figures[batched]])
            last = summary([f[1] for f in figures[batched]])
            statements = figures[batched][0][2]
            label = "batched (RunHistory)" if batched else "single-row, awaited"
            print(
                f"  {label:22} wall p50 {wall['p50']:.3f} (min {wall['min']:.3f}, max "
                f"{wall['max']:.3f})  last handler started p50 {last['p50']:.3f}  "
                f"statements {statements}"
            )
        single = statistics.median(f[0] for f in figures[False])
        batched_ = statistics.median(f[0] for f in figures[True])
        print(f"  wall time ratio single / batched: {single / batched_:.1f}x")
    finally:
        await pool.close()


async def main() -> None:
    parser = base_parser(__doc__.splitlines()[0] if __doc__ else "control plane")
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--ticks", type=int, default=10_000)
    parser.add_argument(
        "--only", choices=("sync", "propagation", "saturated", "history"), default=None
    )
    args = parser.parse_args()
    with scratch_database(args.database_url, "sdcore_bench_control") as dsn:
        with psycopg.connect(dsn) as conn:
            print(machine(conn))
        if args.only in (None, "history"):
            await bench_history(dsn, args.ticks, max(3, args.rounds // 4))
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
