"""The lease cycle's statements on the server: execution time, planning, WAL, buffers, per call.

``benchmarks/lease.py`` measures cycles per second from the client; this script says where the
*server's* share of a cycle goes. On a PostgreSQL of its own (``tests/_servers.py``, ``fsync=on``,
``pg_stat_statements`` with ``track_planning``), it fills sdcore's table and the minimal lease
table of ``lease.py`` with ``--rows`` finished rows each (random ``"v2:"``-shaped lock keys, as
the library's SHA-256 keys are), takes a checkpoint, then runs ``--cycles`` lease cycles of each
workload on one connection each (prepared statements, autocommit, one durable commit per
statement), interleaved cycle by cycle:

``sdcore``
    sdcore's own rendered ``acquire`` (a fresh key: the insert branch) and ``finalize`` on bare
    psycopg, the statements ``JobSchedulerService`` sends;
``minimal``
    the minimal hand-written lease of ``benchmarks/lease.py`` (``MINIMAL_ACQUIRE`` and
    ``MINIMAL_COMPLETE``, primary key and unique lock key only).

It prints, per statement, from ``pg_stat_statements``: mean execution and planning time (µs), WAL
records, WAL bytes and full-page images, and shared buffers hit / read / dirtied per call; the
client's median round trip per statement (execution plus the commit's WAL flush plus the network);
the table's indexes with their sizes; and, with ``--explain``, ``EXPLAIN (ANALYZE, BUFFERS, WAL)``
of one more fresh acquire and finalize of sdcore (inside a rolled-back transaction).

Usage::

    python benchmarks/lease_statements.py [--rows 200000] [--cycles 2000] [--explain]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _harness import base_parser, machine, scratch_database
from lease import LEASE_MS, MINIMAL_ACQUIRE, MINIMAL_COMPLETE, MINIMAL_DDL, MINIMAL_TABLE

from sdcore.job_scheduler import JobSchedulerService
from sdcore.job_scheduler._sql import LeaseStatements
from sdcore.postgres import PoolSettings

TABLE = "job_scheduler"
OWN_SERVER = {
    "fsync": "on",
    "synchronous_commit": "on",
    "shared_buffers": "128MB",
    "shared_preload_libraries": "'pg_stat_statements'",
    "pg_stat_statements.track_utility": "off",
    "pg_stat_statements.track_planning": "on",
    "autovacuum": "off",
}
# Finished rows as the lease leaves them: SUCCESS, random v2-shaped keys, a few codes.
FILL_SDCORE = """
INSERT INTO job_scheduler (lock_key, idempotency_key, code, type, run_key, status, owner_token,
                           fencing_token, lease_ms, created_at, modified_at)
SELECT k, k, 'fill-' || (g %% 20), 'SCHEDULE', g::text, 'SUCCESS', gen_random_uuid(),
       nextval('job_scheduler_fencing_seq'), 60000, t, t
FROM generate_series(1, %(rows)s) AS g,
     LATERAL (SELECT 'v2:' || encode(sha256(g::text::bytea), 'hex') AS k,
                     clock_timestamp() - (%(rows)s - g) * interval '10 ms' AS t) AS x
"""
FILL_MINIMAL = f"""
INSERT INTO {MINIMAL_TABLE} (lock_key, status, owner_token, modified_at)
SELECT 'v2:' || encode(sha256(g::text::bytea), 'hex'), 'SUCCESS', gen_random_uuid(),
       clock_timestamp()
FROM generate_series(1, %(rows)s) AS g
"""
STATS = """
SELECT query, calls, total_exec_time, total_plan_time, wal_records, wal_bytes, wal_fpi,
       shared_blks_hit, shared_blks_read, shared_blks_dirtied
FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
"""
INDEXES = """
SELECT c.relname, pg_relation_size(c.oid), pg_size_pretty(pg_relation_size(c.oid))
FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
WHERE i.indrelid = %s::regclass ORDER BY c.relname
"""


def _key() -> str:
    return f"v2:{uuid.uuid4().hex}{uuid.uuid4().hex}"


def _classify(query: str) -> str | None:
    if MINIMAL_TABLE in query:
        return "minimal acquire" if query.lstrip().startswith("INSERT") else "minimal complete"
    if "WITH v (lock_key" in query and "max_attempts" not in query:
        return "sdcore acquire"
    if query.lstrip().startswith("UPDATE") and "data =" in query:
        return "sdcore finalize"
    return None


def _fill(dsn: str, rows: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        if rows:
            conn.execute(FILL_SDCORE, {"rows": rows})
            conn.execute(FILL_MINIMAL, {"rows": rows})
        conn.execute(f"VACUUM ANALYZE {TABLE}")
        conn.execute(f"VACUUM ANALYZE {MINIMAL_TABLE}")
        conn.execute("CHECKPOINT")


def _run(dsn: str, cycles: int) -> dict[str, list[float]]:
    statements = LeaseStatements.render(sql.Identifier(TABLE))
    client: dict[str, list[float]] = {
        name: []
        for name in ("sdcore acquire", "sdcore finalize", "minimal acquire", "minimal complete")
    }
    clock = time.perf_counter
    with (
        psycopg.connect(dsn, autocommit=True) as ours,
        psycopg.connect(dsn, autocommit=True) as theirs,
        psycopg.connect(dsn, autocommit=True) as stats,
    ):
        warm = 10  # past psycopg's prepare threshold and PostgreSQL's five custom plans
        for i in range(warm + cycles):
            key, token = _key(), str(uuid.uuid4())
            params = (key, key, "bench", None, "SCHEDULE", str(i), token, LEASE_MS)
            t0 = clock()
            row = ours.execute(statements.acquire, params).fetchone()
            t1 = clock()
            assert row is not None, "sdcore: a fresh key was not acquired"
            done = ours.execute(statements.finalize, ("SUCCESS", None, row[0], token)).rowcount
            t2 = clock()
            assert done == 1, "sdcore: not completed"
            key, token = _key(), str(uuid.uuid4())
            t3 = clock()
            row = theirs.execute(MINIMAL_ACQUIRE, (key, token, LEASE_MS)).fetchone()
            t4 = clock()
            assert row is not None, "minimal: a fresh key was not acquired"
            done = theirs.execute(MINIMAL_COMPLETE, (row[0], row[1])).rowcount
            t5 = clock()
            assert done == 1, "minimal: not completed"
            if i == warm - 1:
                stats.execute("SELECT pg_stat_statements_reset()")
                stats.execute("CHECKPOINT")
                continue
            if i >= warm:
                client["sdcore acquire"].append(t1 - t0)
                client["sdcore finalize"].append(t2 - t1)
                client["minimal acquire"].append(t4 - t3)
                client["minimal complete"].append(t5 - t4)
    return client


def _report(dsn: str, client: dict[str, list[float]], explain: bool) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        found: dict[str, tuple[Any, ...]] = {}
        for query, *numbers in conn.execute(STATS).fetchall():
            name = _classify(query)
            if name is not None:
                found[name] = tuple(numbers)
        print(
            f"\n{'statement':<17} | {'calls':>6} {'exec µs':>8} {'plan µs':>8} | {'WAL rec':>7}"
            f" {'WAL B':>6} {'FPI':>5} | {'hit':>5} {'read':>5} {'dirtied':>7}"
            f" | {'client µs p50':>13}"
        )
        for name in ("sdcore acquire", "minimal acquire", "sdcore finalize", "minimal complete"):
            if name not in found:
                print(f"{name:<17} | not in pg_stat_statements")
                continue
            calls, exec_ms, plan_ms, records, wal_bytes, fpi, hit, read, dirtied = found[name]
            n = int(calls)
            print(
                f"{name:<17} | {n:>6} {1000 * exec_ms / n:>8.1f} {1000 * plan_ms / n:>8.1f} |"
                f" {records / n:>7.2f} {float(wal_bytes) / n:>6.0f} {fpi / n:>5.2f} |"
                f" {hit / n:>5.1f} {read / n:>5.2f} {dirtied / n:>7.2f} |"
                f" {1e6 * statistics.median(client[name]):>13.0f}"
            )
        for table in (TABLE, MINIMAL_TABLE):
            rows = conn.execute(INDEXES, (table,)).fetchall()
            size = conn.execute(
                "SELECT pg_size_pretty(pg_relation_size(%s::regclass)), "
                "(SELECT count(*) FROM " + table + ")",
                (table,),
            ).fetchone()
            assert size is not None
            listed = ", ".join(f"{name} {pretty}" for name, _, pretty in rows)
            print(f"{table}: {size[1]:,} rows, heap {size[0]}; indexes: {listed}")
        if explain:
            _explain(conn)


def _explain(conn: psycopg.Connection[Any]) -> None:
    statements = LeaseStatements.render(sql.Identifier(TABLE))
    key, token = _key(), str(uuid.uuid4())
    params = (key, key, "bench", None, "SCHEDULE", "explain", token, LEASE_MS)
    options = b"EXPLAIN (ANALYZE, BUFFERS, WAL, COSTS OFF, TIMING ON) "
    with conn.transaction(force_rollback=True):
        print("\nEXPLAIN acquire (fresh key):")
        for (line,) in conn.execute(options + statements.acquire, params).fetchall():
            print("  " + line)
    with conn.transaction(force_rollback=True):
        key, token = _key(), str(uuid.uuid4())
        params = (key, key, "bench", None, "SCHEDULE", "explain", token, LEASE_MS)
        got = conn.execute(statements.acquire, params).fetchone()
        assert got is not None
        print("\nEXPLAIN finalize:")
        finalize = options + statements.finalize
        for (line,) in conn.execute(finalize, ("SUCCESS", None, got[0], token)).fetchall():
            print("  " + line)


async def _schema(dsn: str) -> None:
    async with JobSchedulerService.connect(dsn, pool=PoolSettings(max_size=2)) as jobs:
        await jobs.ensure_schema()


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("the lease cycle's statements on the server")
    parser.add_argument("--rows", type=int, default=200_000, help="finished rows per table")
    parser.add_argument("--cycles", type=int, default=2000, help="measured cycles per workload")
    parser.add_argument("--explain", action="store_true", help="print EXPLAIN ANALYZE too")
    args = parser.parse_args(argv)
    if args.rows < 0 or args.cycles < 1:
        parser.error("--rows must be >= 0 and --cycles >= 1")
    from tests._servers import own_postgres

    with own_postgres(OWN_SERVER) as server, scratch_database(server.dsn, "sdcore_stmt") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            print(machine(conn))
            print(f"own server: {' '.join(f'{k}={v}' for k, v in OWN_SERVER.items())}")
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute(MINIMAL_DDL.encode())
        asyncio.run(_schema(dsn))
        started = time.monotonic()
        _fill(dsn, args.rows)
        print(f"filled {args.rows:,} finished rows per table in {time.monotonic() - started:.1f} s")
        client = _run(dsn, args.cycles)
        _report(dsn, client, args.explain)
    return 0


if __name__ == "__main__":
    sys.exit(main())
