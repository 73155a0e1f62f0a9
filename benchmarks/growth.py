"""A big lease table: prune rate, lease cycle latency and index sizes at 1M / 10M finished rows.

Two identical tables are filled with ``--rows`` finished runs each (90 % SUCCESS, 10 % FAIL,
modified over the last 30 days in insertion order, as a real table grows), then:

``cycle``
    ``acquire`` + ``complete`` of fresh runs through ``JobSchedulerService`` on the full table and
    on an empty table of the same shape, alternating in slices (p50 / p99 per cycle): what the
    size costs the hot path.
``prune``
    ``LeaseAdmin.prune(older_than=7 days)`` (about 77 % of the rows) on one table, and on the other
    the minimal batched delete that does the same job —
    ``DELETE … WHERE id IN (SELECT id … WHERE status = $1 AND modified_at < $2 LIMIT n)`` per
    status, until a batch comes back short, on a ``(status, modified_at)`` index of its own —
    each timed to the end (``--order`` picks which first). sdcore's table has no such index since
    migration ``lease/0004`` (it made ``complete`` a non-HOT update); its prune walks
    ``created_at``.

Sizes of the table and of each index are printed before and after. The script exits 0 whatever
the figures and says whether the target (prune ≥ 20,000 rows/s sustained) was met.

Usage::

    python benchmarks/growth.py [--database-url URL] [--rows 1000000] [--cycles 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import base_parser, machine, scratch_database, spread, summary

from sdcore.job_scheduler import JobSchedulerService, LeaseAdmin
from sdcore.postgres import PoolSettings

FULL, BASELINE, EMPTY = "job_scheduler", "baseline_jobs", "empty_jobs"
CHUNK = 500_000
PRUNE_AGE = timedelta(days=7)
BATCH = 1_000
TARGET_ROWS_PER_S = 20_000

_FILL = """
INSERT INTO {table} (lock_key, idempotency_key, code, name, type, run_key, status, owner_token,
                     fencing_token, data, created_at, modified_at)
SELECT 'v2:' || md5(%(tag)s || s::text) || md5(s::text), 'v2:' || md5(s::text || %(tag)s),
       'job-' || (s %% 200), NULL, 'SCHEDULE', lpad(s::text, 12, '0'),
       CASE WHEN s %% 10 = 0 THEN 'FAIL' ELSE 'SUCCESS' END, gen_random_uuid(), 1,
       '{{"ok": true}}', ts, ts
FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS s,
     LATERAL (SELECT now() - interval '30 days'
                     + (s::float8 / %(rows)s::bigint) * interval '30 days' AS ts) AS t
"""

_MINIMAL_PRUNE = """
DELETE FROM {table} WHERE id IN (
    SELECT id FROM {table} WHERE status = %(status)s AND modified_at < %(cutoff)s LIMIT %(batch)s
)"""


def _sizes(conn: psycopg.Connection[Any], table: str) -> dict[str, int]:
    rows = conn.execute(
        "SELECT c.relname, pg_relation_size(c.oid) FROM pg_class c"
        " WHERE c.oid = %s::regclass"
        " OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = %s::regclass)"
        " ORDER BY 1",
        (table, table),
    ).fetchall()
    return {str(name): int(size) for name, size in rows}


def _fill(conn: psycopg.Connection[Any], table: str, rows: int) -> None:
    statement = sql.SQL(_FILL).format(table=sql.Identifier(table))
    for lo in range(1, rows + 1, CHUNK):
        hi = min(rows, lo + CHUNK - 1)
        conn.execute(statement, {"tag": table, "lo": lo, "hi": hi, "rows": rows})
        print(f"  {table}: {hi:,} rows", flush=True)


async def _cycles(dsn: str, cycles: int, slice_cycles: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {FULL: [], EMPTY: []}
    async with (
        JobSchedulerService.connect(dsn, pool=PoolSettings(max_size=1)) as full,
        JobSchedulerService.connect(dsn, pool=PoolSettings(max_size=1), table=EMPTY) as empty,
    ):
        services = {FULL: full, EMPTY: empty}
        done = 0
        n = 0
        while done < cycles:
            for name in (FULL, EMPTY) if n % 2 == 0 else (EMPTY, FULL):
                service = services[name]
                for i in range(slice_cycles):
                    start = time.perf_counter()
                    result = await service.acquire(
                        {"code": "growth", "run_key": f"{name}-{n}-{i}", "lease_ms": 60_000}
                    )
                    assert result.acquired
                    await service.complete(result.lease)
                    out[name].append((time.perf_counter() - start) * 1000)
            done += slice_cycles
            n += 1
    return out


async def _prune_sdcore(dsn: str) -> tuple[int, float]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        start = time.perf_counter()
        report = await LeaseAdmin(table=FULL).prune(conn, older_than=PRUNE_AGE, batch_size=BATCH)
        return report.deleted, time.perf_counter() - start


def _prune_minimal(dsn: str) -> tuple[int, float]:
    statement = sql.SQL(_MINIMAL_PRUNE).format(table=sql.Identifier(BASELINE))
    deleted = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        start = time.perf_counter()
        row = conn.execute("SELECT clock_timestamp() - %s::interval", (PRUNE_AGE,)).fetchone()
        assert row is not None
        for status in ("SUCCESS", "FAIL"):
            params = {"status": status, "cutoff": row[0], "batch": BATCH}
            while True:
                count = conn.execute(statement, params).rowcount
                deleted += count
                if count < BATCH:
                    break
        return deleted, time.perf_counter() - start


def _print_sizes(conn: psycopg.Connection[Any], when: str) -> None:
    for table in (FULL, BASELINE):
        sizes = _sizes(conn, table)
        shown = ", ".join(f"{name} {size / 2**20:,.0f} MiB" for name, size in sizes.items())
        print(f"  sizes {when}, {table}: {shown}")


def run(args: argparse.Namespace) -> None:
    with scratch_database(args.database_url, "sdcore_bench_growth") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            print(machine(conn))
            asyncio.run(_schema(dsn))
            print(f"filling two tables with {args.rows:,} finished rows each…", flush=True)
            started = time.perf_counter()
            for table in (FULL, BASELINE):
                _fill(conn, table, args.rows)
            conn.execute(f"VACUUM ANALYZE {FULL}")
            conn.execute(f"VACUUM ANALYZE {BASELINE}")
            print(f"  filled and vacuumed in {time.perf_counter() - started:,.0f} s")
            _print_sizes(conn, "before")

        latencies = asyncio.run(_cycles(dsn, args.cycles, args.slice_cycles))
        full, empty = summary(latencies[FULL]), summary(latencies[EMPTY])
        print(
            f"cycle (acquire + complete), ms, {args.cycles} each, interleaved:"
            f" full table p50 {full['p50']:.2f} p99 {full['p99']:.2f};"
            f" empty table p50 {empty['p50']:.2f} p99 {empty['p99']:.2f};"
            f" p50 ratio full/empty {full['p50'] / empty['p50']:.2f}"
        )

        results: dict[str, tuple[int, float]] = {}
        order: Sequence[str] = (
            ("sdcore", "minimal") if args.order == "sdcore" else ("minimal", "sdcore")
        )
        for name in order:
            if name == "sdcore":
                results[name] = asyncio.run(_prune_sdcore(dsn))
            else:
                results[name] = _prune_minimal(dsn)
            deleted, seconds = results[name]
            per_s = deleted / seconds
            print(f"prune {name}: {deleted:,} rows in {seconds:,.1f} s = {per_s:,.0f} rows/s")
        with psycopg.connect(dsn, autocommit=True) as conn:
            _print_sizes(conn, "after prune")
        rate = {name: deleted / seconds for name, (deleted, seconds) in results.items()}
        ratio = rate["sdcore"] / rate["minimal"]
        print(f"prune ratio sdcore / minimal batched delete: {spread([ratio])}")
        met = rate["sdcore"] >= TARGET_ROWS_PER_S
        print(
            f"target prune ≥ {TARGET_ROWS_PER_S:,} rows/s at {args.rows:,} rows: "
            f"{'met' if met else 'MISSED'} ({rate['sdcore']:,.0f} rows/s)"
        )


async def _schema(dsn: str) -> None:
    for table in (FULL, BASELINE, EMPTY):
        async with JobSchedulerService.connect(
            dsn, pool=PoolSettings(max_size=1), table=table
        ) as jobs:
            await jobs.ensure_schema()
    # The minimal batched delete gets the index it was written for (sdcore's table has only the
    # created_at one since migration lease/0004, which keeps complete a HOT update).
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            sql.SQL("CREATE INDEX ON {} (status, modified_at)").format(sql.Identifier(BASELINE))
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0] if __doc__ else "growth benchmark")
    parser.add_argument("--rows", type=int, default=1_000_000, help="finished rows per table")
    parser.add_argument("--cycles", type=int, default=2_000, help="lease cycles per table")
    parser.add_argument("--slice-cycles", type=int, default=100, help="cycles per slice")
    parser.add_argument("--order", choices=("sdcore", "minimal"), default="sdcore")
    args = parser.parse_args(argv)
    if args.rows < 10_000 or args.cycles < 100:
        parser.error("--rows must be ≥ 10,000 and --cycles ≥ 100")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
