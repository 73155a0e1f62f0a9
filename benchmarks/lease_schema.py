"""What parts of the lease table's schema cost the lease cycle: sdcore's SQL on copies of its table.

``benchmarks/lease.py`` compares sdcore with a minimal hand-written lease; this script says how
much of the gap each part of the *schema* takes, by running sdcore's own rendered ``acquire``
(a fresh key) and ``finalize`` through the bare loop of ``lease.py`` on variants of the table,
interleaved in 0.5 s slices over the same connections (as ``lease.py`` does):

``sdcore``
    the table as the migrations leave it (five indexes, six ``CHECK`` constraints);
``no-running-idx``
    the same without ``running_idx`` (migration ``lease/0006``, the partial index of ``RUNNING``
    rows that serves the operators' listing): ``complete`` becomes a HOT update again;
``no-running-idx-no-checks``
    … and without the ``CHECK`` constraints (PostgreSQL 15 compiles every ``CHECK`` expression
    of the table once per statement, whichever columns the statement sets);
``minimal``
    the minimal lease of ``lease.py`` (its own table and statements), for scale.

It prints, per client count, each variant's cycles/s (median of the rounds) and its ratio to
``sdcore`` and to ``minimal`` (median and range of the per-round ratios). A benchmark, not a test:
it exits 0 whatever the figures. Before every round the tables are truncated and, when the role
may, a ``CHECKPOINT`` taken.

Usage::

    python benchmarks/lease_schema.py [--seconds 5] [--rounds 3] [--clients 1,4]
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import base_parser, machine, scratch_database, spread
from lease import (
    MINIMAL_DDL,
    MINIMAL_TABLE,
    Cycle,
    _bare_cycles,
    _minimal_cycles,
    _timed_slice,
    _untimed,
)

from sdcore.job_scheduler import JobSchedulerService
from sdcore.job_scheduler._sql import LeaseStatements
from sdcore.postgres import PoolSettings

# variant -> its table (a copy of sdcore's, made by the migrations, then cut down)
TABLES = {
    "sdcore": "lease_full",
    "no-running-idx": "lease_norun",
    "no-running-idx-no-checks": "lease_nochecks",
}
VARIANTS = (*TABLES, "minimal")
SLICE_S = 0.5


async def _schema(dsn: str) -> None:
    for table in TABLES.values():
        async with JobSchedulerService.connect(
            dsn, pool=PoolSettings(max_size=2), table=table
        ) as jobs:
            await jobs.ensure_schema()
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(MINIMAL_DDL.encode())
        for table in (TABLES["no-running-idx"], TABLES["no-running-idx-no-checks"]):
            await conn.execute(
                sql.SQL("DROP INDEX {}").format(sql.Identifier(f"{table}_running_idx"))
            )
        nochecks = TABLES["no-running-idx-no-checks"]
        cur = await conn.execute(
            "SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'c'",
            (nochecks,),
        )
        for (name,) in await cur.fetchall():
            await conn.execute(
                sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(
                    sql.Identifier(nochecks), sql.Identifier(name)
                )
            )


def _reset(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in (*TABLES.values(), MINIMAL_TABLE):
            conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(table)))
        with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
            conn.execute("CHECKPOINT")


async def _round(dsn: str, clients: int, seconds: float) -> dict[str, float]:
    conns = [await psycopg.AsyncConnection.connect(dsn, autocommit=True) for _ in range(clients)]
    try:
        cycles: dict[str, list[Cycle]] = {
            name: _bare_cycles(conns, LeaseStatements.render(sql.Identifier(table)), "v2")
            for name, table in TABLES.items()
        }
        cycles["minimal"] = _minimal_cycles(conns, "v2")
        counters = {name: [0] * clients for name in VARIANTS}
        done = {name: [0, 0.0] for name in VARIANTS}  # cycles, seconds
        for name in VARIANTS:
            await _untimed(cycles[name], counters[name], 10)  # past psycopg's prepare threshold
        order = list(VARIANTS)
        while min(elapsed for _, elapsed in done.values()) < seconds:
            for name in order:
                part = await _timed_slice(cycles[name], counters[name], SLICE_S)
                done[name][0] += part.cycles
                done[name][1] += part.elapsed
            order.reverse()  # ABCDDCBA: a linear drift cancels out
        return {name: n / elapsed for name, (n, elapsed) in done.items()}
    finally:
        for conn in conns:
            await conn.close()


def _report(clients: int, rounds: Sequence[dict[str, float]]) -> None:
    print(f"\n{clients} client(s), {len(rounds)} rounds:")
    print(f"  {'variant':<26} {'cycles/s':>9}  {'÷ sdcore':<18} {'÷ minimal':<18}")
    for name in VARIANTS:
        rate = statistics.median(r[name] for r in rounds)
        to_sdcore = [r[name] / r["sdcore"] for r in rounds]
        to_minimal = [r[name] / r["minimal"] for r in rounds]
        print(f"  {name:<26} {rate:>9,.0f}  {spread(to_sdcore):<18} {spread(to_minimal):<18}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("sdcore's lease SQL on variants of its table, against the minimal lease")
    parser.add_argument("--seconds", type=float, default=5.0, help="per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", default="1,4", help="comma-separated client counts")
    args = parser.parse_args(argv)
    try:
        client_counts = [int(c) for c in args.clients.split(",")]
    except ValueError:
        parser.error(f"--clients must be comma-separated integers, got {args.clients!r}")
    if args.seconds <= 0 or args.rounds < 1 or min(client_counts) < 1:
        parser.error("--seconds must be > 0, --rounds >= 1 and every client count >= 1")
    with scratch_database(args.database_url, "sdcore_schema") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            print(machine(conn))
        asyncio.run(_schema(dsn))
        for clients in client_counts:
            rounds: list[dict[str, float]] = []
            for index in range(args.rounds):
                _reset(dsn)
                rates = asyncio.run(_round(dsn, clients, args.seconds))
                shown = ", ".join(f"{name} {rate:,.0f}" for name, rate in rates.items())
                print(f"round {index + 1}, {clients} client(s): {shown} cycles/s", flush=True)
                rounds.append(rates)
            _report(clients, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
