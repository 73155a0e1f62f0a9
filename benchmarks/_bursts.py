"""Bursts: N schedules due at one instant, non-exclusive (1 process) and exclusive (3 replicas).

Run through ``python benchmarks/scheduling.py --bursts``. Per round, interleaved, each in fresh
OS processes that share one wall clock (a handler compares ``time.time()`` with the instant):

``bare-tasks``
    Baseline of the non-exclusive case: a bare ``asyncio`` loop sleeps to the instant, then
    creates N tasks; each records ``time.time() - instant`` at its first line.
``sdcore-plain``
    ``Scheduler()`` without jobs, N cron schedules all due at the instant (a 6-field expression
    naming its second of the day: the stored "every customer's digest at 08:00").
``bare-acquire`` (3 processes)
    Baseline of the exclusive case: at the instant each process sends the minimal multi-key
    acquire on a table with only its primary key — ``INSERT … SELECT unnest(keys) ORDER BY 1 ON
    CONFLICT DO UPDATE … WHERE <takeable> RETURNING lock_key`` — in statements of 1,000 keys
    (sdcore sends one per start slice of 250), on as many connections as an sdcore replica holds,
    then starts a task per key won.
``sdcore-exclusive`` (3 processes)
    Each its own ``JobSchedulerService.connect(...)`` and ``Scheduler(jobs=jobs)`` with the same
    N exclusive schedules.

Every handler start is recorded with the schedule it belongs to; the parent checks that every
tick ran exactly once (union of the replicas' ledgers, and for sdcore the lease rows:
N ``SUCCESS`` rows for the instant), and reports first/p50/p99/last handler start after the
instant over all replicas.

With ``--gc-freeze`` every process (baselines included) calls ``gc.collect()`` and
``gc.freeze()`` once it is ready, before the instant — what an application with many schedules
may do after registering them (``docs/explanation/scheduling.md``): the objects alive then
(schedules, parsed expressions, connections) leave the collector's generations, so a full
collection during the burst no longer traverses them.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import statistics
import sys
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import psycopg

from sdcore.job_scheduler import JobSchedulerService
from sdcore.postgres import PoolSettings
from sdcore.scheduling import Scheduler, Tick

REPLICAS = 3
CONNECTIONS = 4  # held lease connections per sdcore replica (its default), and the baseline's
BATCH = 1_000  # keys per statement of the baseline (sdcore's largest batch call)
BARE_TABLE = """\
CREATE TABLE IF NOT EXISTS bare_lease (
    lock_key text PRIMARY KEY, owner uuid NOT NULL, status text NOT NULL,
    modified_at timestamptz NOT NULL)"""
BARE_ACQUIRE = """\
INSERT INTO bare_lease AS t (lock_key, owner, status, modified_at)
SELECT k, %s::uuid, 'RUNNING', clock_timestamp() FROM unnest(%s::text[]) AS k ORDER BY 1
ON CONFLICT (lock_key) DO UPDATE
SET owner = EXCLUDED.owner, status = 'RUNNING', modified_at = clock_timestamp()
WHERE t.status = 'FAIL' OR t.modified_at < clock_timestamp() - interval '5 minutes'
RETURNING lock_key"""


def _cron_at(instant: float) -> str:
    at = datetime.fromtimestamp(instant, UTC)
    return f"{at.second} {at.minute} {at.hour} * * *"


def _emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


async def _until(instant: float) -> None:
    await asyncio.sleep(max(0.0, instant - time.time()))


def _ready(at: float, freeze: bool) -> None:
    """Report readiness (first freezing the heap if asked)."""
    if freeze:
        gc.collect()
        gc.freeze()
    _emit(event="ready", late=time.time() > at - 1)


async def _bare_tasks(count: int, at: float, freeze: bool) -> None:
    lags: list[tuple[int, float]] = []

    async def handler(index: int) -> None:
        lags.append((index, time.time() - at))

    _ready(at, freeze)
    await _until(at)
    tasks = [asyncio.create_task(handler(i)) for i in range(count)]
    await asyncio.wait(tasks)
    _emit(event="done", lags=lags)


async def _sdcore(count: int, at: float, dsn: str | None, seconds: float, freeze: bool) -> None:
    lags: list[tuple[int, float]] = []

    def make(index: int) -> Any:
        async def handler(tick: Tick) -> None:
            lags.append((index, time.time() - at))

        return handler

    async def run(scheduler: Scheduler) -> None:
        for i in range(count):
            scheduler.add_cron(f"digest-{i:05d}", _cron_at(at), make(i))
        async with scheduler:
            _ready(at, freeze)
            await _until(at + seconds)

    if dsn is None:
        await run(Scheduler())
    else:
        async with JobSchedulerService.connect(
            dsn, pool=PoolSettings(max_size=CONNECTIONS + 1), max_connections=CONNECTIONS
        ) as jobs:
            await run(Scheduler(jobs=jobs))
    _emit(event="done", lags=lags)


async def _bare_acquire(count: int, at: float, dsn: str, freeze: bool) -> None:
    lags: list[tuple[int, float]] = []
    keys = [f"digest-{i:05d}" for i in range(count)]
    index = {key: i for i, key in enumerate(keys)}
    conns = [
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) for _ in range(CONNECTIONS)
    ]
    free: asyncio.Queue[psycopg.AsyncConnection[Any]] = asyncio.Queue()
    for conn in conns:
        await conn.execute("SELECT 1")
        free.put_nowait(conn)
    owner = str(uuid.uuid4())
    started: list[asyncio.Task[None]] = []

    async def handler(i: int) -> None:
        lags.append((i, time.time() - at))

    async def chunk(part: list[str]) -> None:
        conn = await free.get()
        try:
            cur = await conn.execute(BARE_ACQUIRE, (owner, part))
            won = await cur.fetchall()
        finally:
            free.put_nowait(conn)
        started.extend(asyncio.create_task(handler(index[key])) for (key,) in won)

    _ready(at, freeze)
    await _until(at)
    await asyncio.gather(*(chunk(keys[i : i + BATCH]) for i in range(0, count, BATCH)))
    if started:
        await asyncio.wait(started)
    for conn in conns:
        await conn.close()
    _emit(event="done", lags=lags)


def child_main(mode: str, count: int, at: float, dsn: str | None, freeze: bool = False) -> None:
    """Subprocess entry point (``--bursts-child MODE``)."""
    if mode == "bare-tasks":
        asyncio.run(_bare_tasks(count, at, freeze))
    elif mode == "sdcore-plain":
        asyncio.run(_sdcore(count, at, None, 3.0, freeze))
    elif mode == "bare-acquire":
        assert dsn is not None
        asyncio.run(_bare_acquire(count, at, dsn, freeze))
    else:
        assert dsn is not None
        asyncio.run(_sdcore(count, at, dsn, 40.0, freeze))


async def _spawn(
    mode: str, count: int, at: float, dsn: str | None, freeze: bool
) -> asyncio.subprocess.Process:
    argv = [sys.argv[0], "--bursts-child", mode, "--schedules", str(count), "--at", repr(at)]
    if freeze:
        argv.append("--gc-freeze")
    env = None
    if dsn is not None:
        env = {**os.environ, "SDCORE_BENCH_REPLICA_DSN": dsn}
    return await asyncio.create_subprocess_exec(
        sys.executable, *argv, stdout=asyncio.subprocess.PIPE, env=env
    )


async def _case(
    mode: str, count: int, dsn: str | None, processes: int, lead: float, freeze: bool = False
) -> dict[str, Any]:
    at = float(int(time.time() + lead) + 1)
    spawned = [await _spawn(mode, count, at, dsn, freeze) for _ in range(processes)]
    outputs = [await process.communicate() for process in spawned]
    lags: list[float] = []
    ran: Counter[int] = Counter()
    late = False
    for process, (out, _) in zip(spawned, outputs, strict=True):
        if process.returncode != 0:
            raise RuntimeError(f"{mode} process exited with {process.returncode}")
        for line in out.decode().splitlines():
            event = json.loads(line)
            if event["event"] == "ready":
                late = late or event["late"]
            elif event["event"] == "done":
                for index, lag in event["lags"]:
                    ran[index] += 1
                    lags.append(lag * 1000)
    lags.sort()
    once = len(ran) == count and set(ran.values()) == {1}
    result: dict[str, Any] = {
        "mode": mode,
        "at": at,
        "ran": len(ran),
        "exactly_once": once,
        "twice": sum(1 for n in ran.values() if n > 1),
        "never": count - len(ran),
        "late_start": late,
    }
    if lags:
        result.update(
            first_ms=lags[0],
            p50_ms=statistics.median(lags),
            p99_ms=lags[min(len(lags) - 1, round(0.99 * len(lags) + 0.5) - 1)],
            last_ms=lags[-1],
        )
    return result


def _lease_rows(dsn: str, at: float) -> dict[str, int]:
    run_key = datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT status, count(*) FROM job_scheduler WHERE run_key = %s GROUP BY status",
            (run_key,),
        ).fetchall()
    return {str(status): int(n) for status, n in rows}


async def run_bursts(
    dsn: str, count: int, rounds: int, freeze: bool = False
) -> list[dict[str, Any]]:
    """Run ``rounds`` interleaved rounds of the four cases; return one result per case and round."""
    async with JobSchedulerService.connect(dsn) as jobs:
        await jobs.ensure_schema()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(BARE_TABLE)
    results = []
    for round_ in range(1, rounds + 1):
        # The same lead (spawn to instant) for a case and its baseline: a process that idles
        # longer starts its burst slower on this kind of VM (about half again as slow after a
        # 10 s idle as after 2 s), so both idle alike.
        for mode, processes, lead in (
            ("bare-tasks", 1, 10.0),
            ("sdcore-plain", 1, 10.0),
            ("bare-acquire", REPLICAS, 20.0),
            ("sdcore-exclusive", REPLICAS, 20.0),
        ):
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("TRUNCATE job_scheduler, bare_lease")
            print(f"bursts round {round_}: {mode} x{processes}, {count} schedules ...", flush=True)
            result = await _case(mode, count, dsn, processes, lead, freeze)
            result["round"] = round_
            if mode == "sdcore-exclusive":
                rows = _lease_rows(dsn, result["at"])
                result["lease_rows"] = rows
                result["exactly_once"] = result["exactly_once"] and rows == {"SUCCESS": count}
            results.append(result)
            print("  " + json.dumps(result), flush=True)
    return results


def report(results: list[dict[str, Any]], count: int) -> None:
    """Print median (min–max) per case over the rounds, and the targets."""
    print(f"\nBursts: {count} schedules due at one instant (handler start after the instant, ms)")
    print(f"{'case':<22}{'first':>18}{'p50':>18}{'p99':>18}{'last':>18}  exactly once")
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        by_mode.setdefault(result["mode"], []).append(result)
    for mode, runs in by_mode.items():
        cells = []
        for field in ("first_ms", "p50_ms", "p99_ms", "last_ms"):
            values = [r[field] for r in runs if field in r]
            cells.append(
                f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"
                if values
                else "n/a"
            )
        once = all(r["exactly_once"] for r in runs)
        late = any(r["late_start"] for r in runs)
        print(
            f"{mode:<22}"
            + "".join(f"{c:>18}" for c in cells)
            + f"  {'yes' if once else 'NO'}{' (a process started late)' if late else ''}"
        )

    def last(mode: str) -> list[float]:
        return [r["last_ms"] for r in by_mode.get(mode, []) if "last_ms" in r]

    for mode, base, target in (
        ("sdcore-plain", "bare-tasks", 100.0),
        ("sdcore-exclusive", "bare-acquire", 1000.0),
    ):
        ours, theirs = last(mode), last(base)
        if ours and theirs:
            ratio = statistics.median(ours) / max(statistics.median(theirs), 1e-9)
            met = max(ours) <= target
            print(
                f"{mode}: last handler {statistics.median(ours):.1f} ms (median of "
                f"{len(ours)}), {ratio:.2f}x the {base} baseline; target <= {target:.0f} ms "
                f"in every round: {'met' if met else 'MISSED'}"
            )
