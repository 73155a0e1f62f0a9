"""The dashboard's pages with 10,000 schedules and a million runs: server time against bare SQL.

A scratch database gets, by set-based SQL: ``--schedules`` schedules (three quarters cron on a
dozen expressions, a quarter interval schedules of distinct periods, every 50th paused, some in
Europe/Paris), three live replicas declaring all of them, ``--runs`` history runs over the last
50 hours (one in 23 failed, with an error), as many lease rows (50 RUNNING), and an outbox of
10,000 published, 500 pending and 100 dead rows.

Each round requests every page once through the ASGI app in process (httpx's ASGITransport:
the server's whole work, routing, SQL, timelines and Jinja2, without a socket) and, interleaved,
runs the same page's SQL statements directly on the same pool (the baseline). The first request
of each page is reported apart. The app's lifespan runs first, as a server runs it before it
accepts requests: it warms the calendar cache of expected ticks per hour (its time is printed).

Prints figures only; exits 0 whatever they are. Target: every page under 100 ms.

Usage::

    python benchmarks/dashboard.py [--database-url URL] [--schedules 10000] [--runs 1000000]
        [--rounds 30]
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import base_parser, machine, scratch_database, summary

from sdcore._internal.sql import queries
from sdcore.dashboard import dashboard_app
from sdcore.job_scheduler import JobSchedulerService
from sdcore.outbox import Outbox
from sdcore.scheduling import PostgresScheduleStore

CRONS = [
    "*/1 * * * *", "*/5 * * * *", "*/15 * * * *", "0 * * * *", "30 * * * *", "0 */2 * * *",
    "0 3 * * *", "15 2 * * 1-5", "*/10 * * * *", "0 0 * * 0", "*/30 * * * * *", "0 9-17 * * *",
]  # fmt: skip

GENERATE = """
INSERT INTO sdcore_schedules (name, origin, kind, expression, time_zone, options, fingerprint,
                              paused, paused_at, paused_by, created_at)
SELECT 'sched-' || lpad(i::text, 5, '0'), 'code',
       CASE WHEN i %% 4 = 0 THEN 'interval' ELSE 'cron' END,
       CASE WHEN i %% 4 = 0 THEN (60000 * (1 + i %% 97))::text
            ELSE (%(crons)s::text[])[1 + i %% %(ncrons)s] END,
       CASE WHEN i %% 7 = 0 THEN 'Europe/Paris' ELSE 'UTC' END,
       '{"exclusive": true}'::jsonb, md5(i::text), i %% 50 = 0,
       CASE WHEN i %% 50 = 0 THEN now() END, CASE WHEN i %% 50 = 0 THEN 'bench' END,
       now() - interval '3 days'
FROM generate_series(0, %(schedules)s - 1) AS i;
INSERT INTO sdcore_schedules_replicas (replica_id, host, pid)
SELECT gen_random_uuid(), 'host-' || r, 1000 + r FROM generate_series(1, 3) AS r;
INSERT INTO sdcore_schedules_declarations (schedule, replica_id, fingerprint)
SELECT s.name, r.replica_id, s.fingerprint
FROM sdcore_schedules AS s CROSS JOIN sdcore_schedules_replicas AS r;
INSERT INTO sdcore_schedules_runs (schedule, run_key, source, scheduled_at, attempt,
                                   fencing_token, replica_id, host, pid, started_at,
                                   finished_at, status, error)
SELECT 'sched-' || lpad((g %% %(schedules)s)::text, 5, '0'),
       to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'), 'tick', t, 1, g,
       gen_random_uuid(), 'host-1', 1001, t + interval '1 second', t + interval '3 seconds',
       CASE WHEN g %% 23 = 0 THEN 'FAIL' ELSE 'SUCCESS' END,
       CASE WHEN g %% 23 = 0 THEN 'TimeoutError: upstream did not answer in 30 s' END
FROM generate_series(1, %(runs)s) AS g,
     LATERAL (SELECT date_trunc('minute', now())
                     - (g / %(schedules)s) * (interval '50 hours' / (%(runs)s / %(schedules)s))
                     AS t) AS x;
INSERT INTO job_scheduler (lock_key, idempotency_key, code, type, run_key, status, owner_token,
                           fencing_token, modified_at, lease_ms)
SELECT 'k' || g, 'i' || g, 'sched-' || lpad((g %% %(schedules)s)::text, 5, '0'), 'SCHEDULE',
       'r' || g, CASE WHEN g <= 50 THEN 'RUNNING' ELSE 'SUCCESS' END, gen_random_uuid(), g,
       now() - (g %% 90) * interval '1 second', 60000
FROM generate_series(1, %(runs)s) AS g;
INSERT INTO outbox (idempotency_key, queue, name, job_id, payload, max_attempts, status,
                    published_at, last_error, message_digest)
SELECT 'o' || g, 'emails', 'welcome', 'sd2-' || g, '{}'::jsonb, 10,
       CASE WHEN g <= 100 THEN 'DEAD' WHEN g <= 600 THEN 'PENDING' ELSE 'PUBLISHED' END,
       CASE WHEN g > 600 THEN now() END,
       CASE WHEN g <= 100 THEN 'JobTooLargeError: 600 KiB over the 512 KiB limit' END,
       sha256(g::text::bytea)
FROM generate_series(1, 10600) AS g;
ANALYZE;
"""


async def _setup(pool: AsyncConnectionPool[Any], schedules: int, runs: int) -> float:
    await JobSchedulerService(pool).ensure_schema()
    await PostgresScheduleStore(pool).ensure_schema()
    await Outbox().ensure_schema(pool)
    started = time.perf_counter()
    params = {"crons": CRONS, "ncrons": len(CRONS), "schedules": schedules, "runs": runs}
    async with pool.connection() as conn:
        for statement in GENERATE.split(";\n"):
            if statement.strip():
                await conn.execute(statement, params)
    return time.perf_counter() - started


def _statements() -> dict[str, bytes]:
    names = {
        "schedules": sql.Identifier("sdcore_schedules"),
        "replicas": sql.Identifier("sdcore_schedules_replicas"),
        "declarations": sql.Identifier("sdcore_schedules_declarations"),
        "runs": sql.Identifier("sdcore_schedules_runs"),
        "lease": sql.Identifier("job_scheduler"),
    }
    found = {
        key: sql.SQL(text).format(**names).as_string(None).encode()
        for key, text in queries("dashboard").items()
    }
    found["actions_of"] = (
        sql.SQL(queries("schedules")["actions_of"])
        .format(actions=sql.Identifier("sdcore_schedules_actions"))
        .as_string(None)
        .encode()
    )
    found["lease_list"] = (
        b"SELECT id::text, code, run_key, fencing_token, clock_timestamp() - modified_at"
        b" FROM job_scheduler WHERE status = 'RUNNING' ORDER BY created_at DESC, id DESC"
        b" LIMIT 200"
    )
    found["outbox_stats"] = Outbox().sql.stats
    found["outbox_rows"] = Outbox().sql.list_rows
    return found


def _baselines(pool: AsyncConnectionPool[Any]) -> dict[str, Callable[[], Awaitable[None]]]:
    """Each page's statements, run directly (the same parameters as the page's)."""
    s = _statements()
    live = {"live_ms": 30_000}

    def window() -> dict[str, Any]:
        now = datetime.now(UTC)
        top = now.replace(minute=0, second=0, microsecond=0)
        return {"since": top - timedelta(hours=23), "until": now, "bucket_s": 3600}

    async def run(*steps: tuple[str, Any]) -> list[list[tuple[Any, ...]]]:
        out = []
        async with pool.connection() as conn:
            for key, params in steps:
                cur = await conn.execute(s[key], params)
                out.append(list(await cur.fetchall()))
        return out

    def listing(query: str | None, offset: int) -> Callable[[], Awaitable[None]]:
        async def page() -> None:
            params = {"query": query, "paused": None, "limit": 50, "offset": offset, **live}
            rows = (await run(("schedules_page", params), ("schedule_counts", params)))[0]
            await run(("tick_buckets", {"names": [r[0] for r in rows], **window()}))

        return page

    async def schedule() -> None:
        await run(
            ("schedule_one", {"name": "sched-00042", **live}),
            ("tick_buckets", {"names": ["sched-00042"], **window()}),
            ("runs_of", {"name": "sched-00042", "limit": 100}),
            ("actions_of", ("sched-00042", 20)),
        )

    async def leases() -> None:
        rows = (await run(("lease_list", {})))[0]
        await run(("lease_details", {"ids": [r[0] for r in rows]}))

    async def outbox() -> None:
        await run(("outbox_stats", {}), ("outbox_rows", (["PENDING", "DEAD"], 200)))

    return {
        "/": listing(None, 0),
        "/?page=150": listing(None, 149 * 50),
        "/?q=sched-0999": listing("sched-0999", 0),
        "/schedule?name=sched-00042": schedule,
        "/leases": leases,
        "/outbox": outbox,
    }


async def _time(call: Callable[[], Awaitable[object]]) -> float:
    started = time.perf_counter()
    await call()
    return (time.perf_counter() - started) * 1000


async def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    with scratch_database(args.database_url, "sdcore_bench_dashboard") as dsn:
        with psycopg.connect(dsn) as conn:
            print(machine(conn))
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            dsn, min_size=2, max_size=4, kwargs={"autocommit": True}, open=False
        )
        await pool.open(wait=True, timeout=30)
        async with pool:
            took = await _setup(pool, args.schedules, args.runs)
            print(f"generated {args.schedules} schedules and {args.runs} runs in {took:.1f} s")
            app = dashboard_app(pool, token="benchmark-operator-token-0123")  # noqa: S106
            baselines = _baselines(pool)
            transport = httpx.ASGITransport(app=app)
            started = time.perf_counter()
            async with (
                app.router.lifespan_context(app),
                httpx.AsyncClient(transport=transport, base_url="http://bench") as client,
            ):
                print(
                    f"start-up (calendar warm-up) {1000 * (time.perf_counter() - started):.0f} ms"
                )
                pages: dict[str, list[float]] = {p: [] for p in baselines}
                bare: dict[str, list[float]] = {p: [] for p in baselines}
                cold: dict[str, float] = {}

                async def get(path: str) -> None:
                    response = await client.get(path)
                    if response.status_code != 200:
                        raise RuntimeError(f"{path}: HTTP {response.status_code}")

                for path in baselines:
                    cold[path] = await _time(lambda path=path: get(path))  # type: ignore[misc]
                for _ in range(args.rounds):
                    for path, baseline in baselines.items():
                        pages[path].append(await _time(lambda path=path: get(path)))  # type: ignore[misc]
                        bare[path].append(await _time(baseline))
    print(f"{args.rounds} rounds; ms; page = whole server response, SQL = its statements alone")
    heads = ("cold", "p50", "p99", "SQL p50", "SQL p99", "ratio")
    print(f"{'page':30} " + " ".join(f"{h:>7}" for h in heads))
    for path in baselines:
        p, b = summary(pages[path]), summary(bare[path])
        print(
            f"{path:30} {cold[path]:7.1f} {p['p50']:7.1f} {p['p99']:7.1f} {b['p50']:7.1f}"
            f" {b['p99']:7.1f} {p['p50'] / b['p50']:7.2f}"
        )


if __name__ == "__main__":
    asyncio.run(main())
