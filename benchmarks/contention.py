"""A contended tick: N replicas race for one run key; what do the losers cost, on the server?

Every tick, N clients (each on its own connection, started together behind a barrier) acquire
the same run key; exactly one wins and completes it. Workloads, alternating tick by tick:

``acquire``
    ``JobSchedulerService.acquire`` through the public API, one service per client.
``tick``
    ``JobSchedulerService.acquire_attempt``: what the scheduler sends for an exclusive tick
    (the attempt budget of ``lease_ticks.sql``).
``floor``
    The cheapest statement that decides a race at all, on bare psycopg (fresh keys only):
    ``INSERT … ON CONFLICT (lock_key) DO NOTHING RETURNING id`` (a loser waits for the winner's
    unique-index entry, then does nothing: no row lock, no WAL) — a lower bound no lease that can
    also take over expired rows can beat.

Scenarios: ``fresh`` (a new key every tick: the race is decided on the unique index) and
``reclaim`` (the key's row is ``FAIL`` before the tick: every contender sees a takeable row, one
takes it over).

Measured on a PostgreSQL of the benchmark's own (``--own-server``, the default: started with
``tests/_servers.py``, ``fsync=on``, ``shared_preload_libraries=pg_stat_statements`` and every
statement's duration logged), so that the figures are the server's, not the client's queueing:

- **server time per tick**: the summed execution time of all N acquires of a tick, from the
  statement log (``log_min_duration_statement = 0``; the commit's WAL flush is not part of it)
  and, as a cross-check, ``pg_stat_statements.total_exec_time`` / ticks;
- **server p50 / p99 per acquire** over all N × ticks acquires (N − 1 of every N are losers);
- **WAL records per acquire** (``pg_stat_statements.wal_records`` / calls): 0 for a loser that
  wrote nothing;
- the client-side summed time per tick and loser p50 / p99 (on a 2-core machine they
  include the client's own queueing: all N clients share one event loop).

Targets: server time per tick at 30 replicas ≤ 5× that at 3; loser p99 ≤ 5 ms. Current figures:
docs/benchmarks.md#a-contended-tick-what-the-losers-cost.

Usage::

    python benchmarks/contention.py [--replicas 3,10,30] [--ticks 200] [--scenarios fresh,reclaim]
                                    [--no-own-server --database-url URL]
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _harness import base_parser, machine, scratch_database, summary

from sdcore.job_scheduler import AttemptBudget, JobAcquireOptions, JobSchedulerService, lock_key
from sdcore.postgres import PoolSettings

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
# A FAIL row for the reclaim scenario, as a failed first attempt leaves it.
SEED_FAIL = """
INSERT INTO job_scheduler (lock_key, idempotency_key, code, type, run_key, status, owner_token,
                           fencing_token, lease_ms, attempts)
VALUES (%s, %s, 'contended', 'SCHEDULE', %s, 'FAIL', gen_random_uuid(),
        nextval('job_scheduler_fencing_seq'), 60000, 1)
"""
CODE = "contended"
LEASE_MS = 60_000
BUDGET = AttemptBudget(max_attempts=3, backoff_ms=0)
OWN_SERVER = {
    "fsync": "on",
    "synchronous_commit": "on",
    "shared_buffers": "128MB",
    "max_connections": "150",
    "shared_preload_libraries": "'pg_stat_statements'",
    "pg_stat_statements.track_utility": "off",
    "log_min_duration_statement": "0",
    "log_line_prefix": "'%a|'",
}
_DURATION = re.compile(r"^(bench-[a-z]+)\|LOG:  duration: ([0-9.]+) ms  execute [^:]*: ?(.*)$")


class Result:
    """Per workload: client-side summed time per tick and every loser's client latency (ms)."""

    def __init__(self) -> None:
        self.tick_sums: list[float] = []
        self.losers: list[float] = []
        self.ticks = 0


def _record(times: list[tuple[float, bool]], result: Result) -> None:
    winners = [t for t, won in times if won]
    if len(winners) != 1:
        raise RuntimeError(f"{len(winners)} winners in one tick")
    result.ticks += 1
    result.tick_sums.append(sum(t for t, _ in times))
    result.losers.extend(t for t, won in times if not won)


async def _service_tick(
    services: Sequence[JobSchedulerService], run_key: str, result: Result, *, tick: bool
) -> None:
    barrier = asyncio.Barrier(len(services))
    times: list[tuple[float, bool]] = []
    options = JobAcquireOptions(code=CODE, run_key=run_key, lease_ms=LEASE_MS)

    async def one(service: JobSchedulerService) -> None:
        await barrier.wait()
        start = time.perf_counter()
        if tick:
            outcome = (await service.acquire_attempt(options, BUDGET)).result
        else:
            outcome = await service.acquire(options)
        times.append(((time.perf_counter() - start) * 1000, outcome.acquired))
        if outcome.acquired:
            await service.complete(outcome.lease)

    await asyncio.gather(*(one(s) for s in services))
    _record(times, result)


async def _floor_tick(
    conns: Sequence[psycopg.AsyncConnection[Any]], run_key: str, result: Result
) -> None:
    barrier = asyncio.Barrier(len(conns))
    times: list[tuple[float, bool]] = []

    async def one(conn: psycopg.AsyncConnection[Any]) -> None:
        await barrier.wait()
        start = time.perf_counter()
        cur = await conn.execute(FLOOR, (run_key, str(uuid.uuid4())))
        won = await cur.fetchone() is not None
        times.append(((time.perf_counter() - start) * 1000, won))

    await asyncio.gather(*(one(c) for c in conns))
    _record(times, result)


async def _measure(
    dsn: str, replicas: int, ticks: int, scenario: str, on_measured: Any
) -> dict[str, Result]:
    """Run ``ticks`` ticks of every workload; ``on_measured()`` marks the end of the warm-up."""
    names = ["acquire", "tick"] + (["floor"] if scenario == "fresh" else [])
    results = {name: Result() for name in names}
    opened: list[Any] = []
    services: dict[str, list[JobSchedulerService]] = {"acquire": [], "tick": []}
    conns: list[psycopg.AsyncConnection[Any]] = []
    setup = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    try:
        for name in ("acquire", "tick"):
            for _ in range(replicas):
                cm = JobSchedulerService.connect(
                    dsn, pool=PoolSettings(min_size=1, max_size=2, application_name=f"bench-{name}")
                )
                services[name].append(await cm.__aenter__())
                opened.append(cm)
        if "floor" in names:
            for _ in range(replicas):
                conns.append(
                    await psycopg.AsyncConnection.connect(
                        dsn, autocommit=True, application_name="bench-floor"
                    )
                )

        async def one_tick(name: str, i: int, result: Result) -> None:
            run_key = f"{scenario}-{replicas}-{name}-{i}-{uuid.uuid4().hex[:8]}"
            if scenario == "reclaim":
                key = lock_key(CODE, run_key)
                await setup.execute(SEED_FAIL, (key, f"idem-{key}", run_key))
            if name == "floor":
                await _floor_tick(conns, run_key, result)
            else:
                await _service_tick(services[name], run_key, result, tick=name == "tick")

        for i in range(6):  # warm: connections configured, statements prepared (psycopg: 5)
            for name in names:
                await one_tick(name, -1 - i, Result())
        await on_measured()
        for i in range(ticks):
            order = names if i % 2 == 0 else names[::-1]
            for name in order:
                await one_tick(name, i, results[name])
    finally:
        for cm in opened:
            await cm.__aexit__(None, None, None)
        for conn in conns:
            await conn.close()
        await setup.close()
    return results


@contextmanager
def _server(args: Any) -> Iterator[tuple[str, Path | None]]:
    """The server URL, and its log file when the server is our own."""
    if not args.own_server:
        yield args.database_url, None
        return
    from tests._servers import own_postgres

    with own_postgres(OWN_SERVER) as server:
        yield server.dsn, server.datadir / "server.log"


def _server_durations(log: Path, offset: int) -> dict[str, list[float]]:
    """Execution times (ms) of the acquires in the log since ``offset``, by workload."""
    found: dict[str, list[float]] = defaultdict(list)
    with log.open("rb") as handle:
        handle.seek(offset)
        for raw in handle:
            match = _DURATION.match(raw.decode("utf-8", "replace").rstrip("\n"))
            if match is None or match.group(3).startswith("UPDATE"):
                continue  # not an execute, or the winner's complete
            found[match.group(1).removeprefix("bench-")].append(float(match.group(2)))
    return found


def _statements(conn: psycopg.Connection[Any]) -> dict[str, tuple[int, float, int]]:
    """``{workload: (calls, total_exec_time ms, wal_records)}`` from pg_stat_statements."""
    rows = conn.execute(
        "SELECT query, calls, total_exec_time, wal_records FROM pg_stat_statements"
        " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
    ).fetchall()
    out: dict[str, tuple[int, float, int]] = {}
    for query, calls, total, wal in rows:
        if "floor_jobs" in query and "INSERT" in query:
            name = "floor"
        elif "WITH v (lock_key" in query and "max_attempts" in query:
            name = "tick"
        elif "WITH v (lock_key" in query and "unnest" not in query:
            name = "acquire"
        else:
            continue
        old = out.get(name, (0, 0.0, 0))
        out[name] = (old[0] + int(calls), old[1] + float(total), old[2] + int(wal))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("contended tick: the losers' cost, on the server")
    parser.add_argument("--replicas", default="3,10,30", help="comma-separated replica counts")
    parser.add_argument("--ticks", type=int, default=200, help="ticks per replica count")
    parser.add_argument("--scenarios", default="fresh,reclaim", help="fresh, reclaim or both")
    parser.add_argument(
        "--own-server",
        action=__import__("argparse").BooleanOptionalAction,
        default=True,
        help="start a PostgreSQL of our own with pg_stat_statements (default); with"
        " --no-own-server, use --database-url and report client-side figures only",
    )
    args = parser.parse_args(argv)
    counts = [int(part) for part in args.replicas.split(",")]
    scenarios = [part.strip() for part in args.scenarios.split(",") if part.strip()]
    with _server(args) as (url, log), scratch_database(url, "sdcore_bench_contention") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            print(machine(conn))
            conn.execute(FLOOR_DDL)
            if log is not None:
                conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                print(f"own server: {' '.join(f'{k}={v}' for k, v in OWN_SERVER.items())}")
        asyncio.run(_schema(dsn))
        per_tick: dict[tuple[str, str, int], float] = {}
        p99s: dict[tuple[str, str, int], float] = {}
        with psycopg.connect(dsn, autocommit=True) as stats:
            for scenario in scenarios:
                for replicas in counts:
                    offset = 0

                    async def measured() -> None:
                        nonlocal offset
                        if log is not None:
                            stats.execute("SELECT pg_stat_statements_reset()")
                            offset = log.stat().st_size

                    results = asyncio.run(_measure(dsn, replicas, args.ticks, scenario, measured))
                    durations = _server_durations(log, offset) if log is not None else {}
                    statements = _statements(stats) if log is not None else {}
                    for name, result in results.items():
                        client, losers = summary(result.tick_sums), summary(result.losers)
                        line = (
                            f"{scenario:>7} {name:>7} {replicas:>3} replicas, {result.ticks} ticks,"
                            f" one winner each | client: summed/tick p50 {client['p50']:.2f} ms,"
                            f" loser p50/p99 {losers['p50']:.2f}/{losers['p99']:.2f} ms"
                        )
                        if name in durations:
                            server = summary(durations[name])
                            total = sum(durations[name]) / result.ticks
                            calls, exec_ms, wal = statements.get(name, (0, 0.0, 0))
                            per_tick[scenario, name, replicas] = total
                            p99s[scenario, name, replicas] = server["p99"]
                            line += (
                                f" | server: {total:.2f} ms/tick"
                                f" (pg_stat_statements {exec_ms / result.ticks:.2f}),"
                                f" per acquire p50/p99 {server['p50']:.3f}/{server['p99']:.3f} ms,"
                                f" WAL records/acquire {wal / calls if calls else float('nan'):.2f}"
                            )
                        print(line, flush=True)
        if per_tick and len(counts) >= 2:
            low, high = counts[0], counts[-1]
            for scenario in scenarios:
                for name in ("acquire", "tick", "floor"):
                    if (scenario, name, high) not in per_tick:
                        continue
                    growth = per_tick[scenario, name, high] / per_tick[scenario, name, low]
                    p99 = max(p99s[scenario, name, n] for n in counts)
                    print(
                        f"{scenario} {name}: server time per tick {high}/{low} replicas"
                        f" {growth:.1f}x (target ≤ 5x: {'MET' if growth <= 5 else 'NOT MET'});"
                        f" worst server p99 per acquire {p99:.2f} ms"
                        f" (target ≤ 5 ms: {'MET' if p99 <= 5 else 'NOT MET'})"
                    )
    return 0


async def _schema(dsn: str) -> None:
    async with JobSchedulerService.connect(dsn, pool=PoolSettings(max_size=1)) as jobs:
        await jobs.ensure_schema()


if __name__ == "__main__":
    sys.exit(main())
