"""One demo replica: the same per-second schedule as every other replica; a ledger of its runs.

Run by ``sdcore demo`` as ``python -m sdcore.demo._replica``, with the database URL in the
environment variable ``SDCORE_DEMO_DSN`` (never on the command line, where ``ps`` shows it to
every local user; ``--dsn`` exists for trying a replica by hand). Stops on SIGTERM/SIGINT, and
when its stdin reaches end-of-file: the demo never writes to it, so EOF means the demo is gone
(even by ``kill -9``) and no replica outlives it.

Each run takes :data:`WORK_S` seconds between its ``started`` and its ``done`` ledger row, so
that a SIGKILL can land in the middle of one: the lease then expires and another replica's
catch-up sweep takes the tick over with the next fencing token.

The schedule allows overlap (``overlap="allow"``): every second is its own logical run, and the
demo judges each one. Under the default ``overlap="skip"``, the replica that takes the killed
tick over (0.6 s of work, starting about 2 s after the kill) is often still running it when the
next second is due, while the killed replica is still starting again: the lone free candidate
skips that second on purpose and records it as skipped, and the verdict would count it missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from datetime import UTC, datetime

from psycopg import sql

from sdcore.postgres import PoolSettings, redact_text
from sdcore.runtime import Runtime
from sdcore.scheduling import Tick

SCHEDULE = "demo-tick"
DSN_ENV = "SDCORE_DEMO_DSN"
WORK_S = 0.6
LEASE_MS = 2_000
# How far back a replica (its start-up catch-up and its periodic sweep) looks for ticks left
# RUNNING by a dead owner or never started. Ticks before the demo began are skipped by the handler.
CATCH_UP_WINDOW_MS = 20_000
EXIT_DEADLINE_S = 5.0
GRACE_MS = 2_000
# The job scheduler holds at most half of the pool; the ledger writes use the rest.
POOL_SIZE = 3


async def replica(dsn: str, number: int, table: str, ledger: str, epoch: datetime) -> None:
    """Run the schedule until SIGTERM, SIGINT or EOF on stdin."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)

    def watch_stdin() -> None:
        try:
            sys.stdin.buffer.read()
        finally:
            loop.call_soon_threadsafe(stop.set)
        # The demo is gone, and with it (embedded) the server: a shutdown that waits on a dead
        # server must not keep this process around.
        time.sleep(EXIT_DEADLINE_S)
        os._exit(1)

    threading.Thread(target=watch_stdin, name="parent-watch", daemon=True).start()
    insert = sql.SQL(
        "INSERT INTO {} (run_key, replica, pid, fencing_token, phase) VALUES (%s, %s, %s, %s, %s)"
    ).format(sql.Identifier(ledger))
    # The same composition root as every other entry point; the demo's tables are its own, so
    # no migration runs and no control plane records the demo schedule in the database.
    runtime = Runtime(
        database_url=dsn,
        lease_table=table,
        ensure_schema=False,
        pool=PoolSettings(max_size=POOL_SIZE, application_name=f"sdcore-demo-{number}"),
        control=None,
        grace_period_ms=GRACE_MS,
        logger_name="sdcore.demo",
    )

    async def tick(t: Tick) -> None:
        if t.scheduled_at < epoch:
            return  # before this demo: nothing to show
        fencing = t.lease.fencing_token if t.lease is not None else 0
        row = (t.run_key, number, os.getpid(), fencing)
        async with runtime.pool.connection() as conn:
            await conn.execute(insert, (*row, "started"))
        print(json.dumps({"started": t.run_key, "fencing_token": fencing}), flush=True)
        await asyncio.sleep(WORK_S)  # the work; a SIGKILL now leaves the lease RUNNING
        async with runtime.pool.connection() as conn:
            await conn.execute(insert, (*row, "done"))

    runtime.scheduler.add_cron(
        SCHEDULE,
        "* * * * * *",
        tick,
        catch_up="all",
        catch_up_window_ms=CATCH_UP_WINDOW_MS,
        lease_ms=LEASE_MS,
        overlap="allow",  # a takeover of an old second never makes this replica skip a new one
    )
    async with runtime:
        print(json.dumps({"ready": number, "pid": os.getpid()}), flush=True)
        await stop.wait()


def main() -> None:
    """Entry point: ``python -m sdcore.demo._replica --replica N --table T --ledger L …``."""
    parser = argparse.ArgumentParser(prog="sdcore-demo-replica")
    parser.add_argument("--dsn", help=f"database URL (default: ${DSN_ENV}; prefer the variable)")
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--table", required=True)
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--epoch", type=float, required=True, help="Unix time the demo began")
    args = parser.parse_args()
    dsn = args.dsn or os.environ.get(DSN_ENV, "")
    if not dsn:
        print(json.dumps({"error": f"no database: set {DSN_ENV}"}), flush=True)
        sys.exit(2)
    epoch = datetime.fromtimestamp(args.epoch, UTC)
    try:
        asyncio.run(replica(dsn, args.replica, args.table, args.ledger, epoch))
    except Exception as exc:  # noqa: BLE001 - one line to the parent, no traceback noise
        message = redact_text(f"{type(exc).__name__}: {exc}", dsn)
        print(json.dumps({"error": message}), flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
