"""One demo replica: the same per-second schedule as every other replica; a ledger of its runs.

Run by ``sdcore demo`` as ``python -m sdcore.demo._replica``; stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys

import psycopg
from psycopg import sql

from sdcore.job_scheduler import JobSchedulerService
from sdcore.postgres import redact_text
from sdcore.scheduling import Scheduler, Tick

SCHEDULE = "demo-tick"


async def replica(dsn: str, number: int, table: str, ledger: str, catch_up_ms: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    insert = sql.SQL(
        "INSERT INTO {} (run_key, replica, pid, fencing_token) VALUES (%s, %s, %s, %s)"
    ).format(sql.Identifier(ledger))
    async with (
        JobSchedulerService.connect(
            dsn, table=table, max_size=2, application_name=f"sdcore-demo-{number}"
        ) as jobs,
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn,
    ):
        scheduler = Scheduler(jobs=jobs, lease_ms=2_000, grace_period_ms=2_000)

        async def tick(t: Tick) -> None:
            fencing = t.lease.fencing_token if t.lease is not None else 0
            await conn.execute(insert, (t.run_key, number, os.getpid(), fencing))

        scheduler.add_cron(
            SCHEDULE,
            "* * * * * *",
            tick,
            catch_up="all" if catch_up_ms else "off",
            catch_up_window_ms=max(catch_up_ms, 1),
        )
        async with scheduler:
            print(json.dumps({"ready": number, "pid": os.getpid()}), flush=True)
            await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(prog="sdcore-demo-replica")
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--table", required=True)
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--catch-up-ms", type=int, default=0)
    args = parser.parse_args()
    try:
        asyncio.run(replica(args.dsn, args.replica, args.table, args.ledger, args.catch_up_ms))
    except Exception as exc:  # noqa: BLE001 - one line to the parent, no traceback noise
        message = redact_text(f"{type(exc).__name__}: {exc}", args.dsn)
        print(json.dumps({"error": message}), flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
