"""A scheduler replica for the acceptance tests: ``python -m tests.acceptance._replica``.

One process = one ``JobSchedulerService`` (its own pool) + one ``Scheduler`` with one schedule.
The handler writes a row to the test's ``ledger`` table through its own psycopg connection
(``run_key, replica_id, fencing_token, pid, started_at = clock_timestamp()``, later
``finished_at`` and ``outcome``), then optionally sleeps (``--sleep-ms``) and fails (``--fail``).

Stdout carries JSON lines only (logs go to stderr):

- ``{"event": "ready", ...}`` once connected, with this process's wall clock next to the
  database's ``clock_timestamp()`` (``offset_s`` = wall - db: how far faketime shifted us);
- ``{"event": "started", "entered": ..., ...}`` once ``async with scheduler`` is entered
  (``entered`` is the scheduler clock just before, i.e. the instant catch-up counts back from);
- ``{"event": "ran", "run_key": ...}`` when the handler starts (after its ledger row);
- ``{"event": "log", "action": ..., "run_key": ...}`` for the scheduler's structured log records
  (``tick_skipped`` is how a replica that lost a tick reports the key it computed);
- ``{"event": "stopped"}`` after a graceful exit.

The process runs until SIGTERM/SIGINT, end of stdin (the test died) or ``--seconds``.
``--start-at`` (epoch seconds, by this process's wall clock) delays entering the scheduler, so
that several replicas start at one chosen instant. ``--clock-offset-ms`` shifts the scheduler's
clock (``Scheduler(clock=...)``): a negative offset makes this replica fire late.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from sdcore.job_scheduler import JobSchedulerService
from sdcore.postgres import PoolSettings
from sdcore.scheduling import CatchUp, Overlap, ScheduleOptions, Scheduler, Tick

Json = dict[str, Any]
_OUT = threading.Lock()

INSERT = """\
INSERT INTO ledger (schedule, run_key, replica_id, fencing_token, attempt, pid, scheduled_at,
                    app_now, started_at)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, clock_timestamp())
RETURNING id"""
FINISH = "UPDATE ledger SET finished_at = clock_timestamp(), outcome = %s WHERE id = %s"


def emit(obj: Json) -> None:
    """Write one JSON line to stdout and flush it (thread-safe)."""
    line = json.dumps(obj, default=str) + "\n"
    with _OUT:
        sys.stdout.write(line)
        sys.stdout.flush()


class ReplicaFailure(RuntimeError):
    """The failure ``--fail`` asks the handler for."""


class EventHandler(logging.Handler):
    """Forwards the scheduler's structured records (those with an ``action``) to stdout."""

    def emit(self, record: logging.LogRecord) -> None:
        action = getattr(record, "action", None)
        if action is None:
            return
        run_key = getattr(record, "run_key", None)
        args = record.args
        if run_key is None and isinstance(args, tuple) and len(args) >= 2:
            run_key = args[1]  # "schedule %r run %r: ..." records without a run_key extra
        emit(
            {
                "event": "log",
                "action": action,
                "schedule": getattr(record, "schedule", None),
                "run_key": run_key,
                "level": record.levelname,
                "message": record.getMessage()[:300],
            }
        )


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(prog="python -m tests.acceptance._replica")
    p.add_argument("--dsn", required=True)
    p.add_argument("--replica-id", type=int, required=True)
    p.add_argument("--name", required=True, help="schedule name (job code)")
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument("--cron", help="cron expression (5 or 6 fields)")
    kind.add_argument("--interval-ms", type=int)
    p.add_argument("--time-zone", default="UTC")
    p.add_argument("--overlap", default="skip", choices=[o.value for o in Overlap])
    p.add_argument("--catch-up", default="off", choices=[c.value for c in CatchUp])
    p.add_argument("--catch-up-window-ms", type=int)
    p.add_argument("--retries", type=int)
    p.add_argument("--retry-backoff-ms", type=int)
    p.add_argument("--lease-ms", type=int, help="lease of each tick")
    p.add_argument("--grace-period-ms", type=int, default=10_000)
    p.add_argument("--sleep-ms", type=int, default=0, help="handler sleep after its ledger row")
    p.add_argument("--fail", action="store_true", help="the handler raises after its ledger row")
    p.add_argument("--seconds", type=float, default=90.0, help="run budget (safety net)")
    p.add_argument("--start-at", type=float, help="enter the scheduler at this epoch time")
    p.add_argument("--clock-offset-ms", type=int, default=0, help="shift the scheduler clock")
    return p.parse_args(argv)


def schedule_options(args: argparse.Namespace) -> ScheduleOptions:
    """The schedule's options from the command line (only those given)."""
    options: ScheduleOptions = {
        "overlap": Overlap(args.overlap),
        "catch_up": CatchUp(args.catch_up),
    }
    if args.catch_up_window_ms is not None:
        options["catch_up_window_ms"] = args.catch_up_window_ms
    if args.retries is not None:
        options["retries"] = args.retries
    if args.retry_backoff_ms is not None:
        options["retry_backoff_ms"] = args.retry_backoff_ms
    if args.lease_ms is not None:
        options["lease_ms"] = args.lease_ms
    return options


async def db_clock(conn: psycopg.AsyncConnection[Any]) -> Json:
    """This process's wall clock next to the database's ``clock_timestamp()``."""
    wall_before = time.time()
    cur = await conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8")
    row = await cur.fetchone()
    wall_after = time.time()
    assert row is not None
    wall = (wall_before + wall_after) / 2
    return {
        "wall": wall,
        "db": float(row[0]),
        "offset_s": wall - float(row[0]),
        "wall_iso": datetime.now(UTC).isoformat(),
    }


def make_handler(
    args: argparse.Namespace,
    ledger: psycopg.AsyncConnection[Any],
    clock: Callable[[], datetime],
) -> Callable[[Tick], Awaitable[None]]:
    """The schedule's handler: ledger row, optional sleep, optional failure, finish mark."""
    pid = os.getpid()

    async def handler(tick: Tick) -> None:
        fencing = None if tick.lease is None else tick.lease.fencing_token
        cur = await ledger.execute(
            INSERT,
            (
                tick.schedule,
                tick.run_key,
                args.replica_id,
                fencing,
                tick.attempt,
                pid,
                tick.scheduled_at,
                clock(),
            ),
        )
        row = await cur.fetchone()
        assert row is not None
        emit(
            {
                "event": "ran",
                "run_key": tick.run_key,
                "fencing_token": fencing,
                "attempt": tick.attempt,
                "ledger_id": row[0],
            }
        )
        outcome = "ok"
        try:
            if args.sleep_ms:
                await asyncio.sleep(args.sleep_ms / 1000)
            if args.fail:
                outcome = "failed"
                raise ReplicaFailure(f"replica {args.replica_id} fails {tick.run_key} on purpose")
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            await ledger.execute(FINISH, (outcome, row[0]))

    return handler


def watch_stdin(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """Stop when stdin reaches end of file (the test process is gone or closed the pipe)."""

    def run() -> None:
        try:
            while sys.stdin.readline():
                pass
        except (OSError, ValueError):
            pass
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=run, name="stdin-watch", daemon=True).start()


async def wait_or_stop(stop: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds`` unless ``stop`` is set first."""
    if seconds <= 0:
        return
    try:
        async with asyncio.timeout(seconds):
            await stop.wait()
    except TimeoutError:
        pass


async def amain(args: argparse.Namespace) -> int:
    """Run one replica until asked to stop."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watch_stdin(loop, stop)
    budget_end = time.monotonic() + args.seconds
    offset = timedelta(milliseconds=args.clock_offset_ms)

    def clock() -> datetime:
        return datetime.now(UTC) + offset

    app = f"replica-{args.replica_id}-{os.getpid()}"
    async with JobSchedulerService.connect(
        args.dsn, pool=PoolSettings(max_size=4, application_name=app)
    ) as jobs:
        await jobs.ensure_schema()
        async with await psycopg.AsyncConnection.connect(
            args.dsn, autocommit=True, application_name=f"{app}-ledger"
        ) as ledger:
            scheduler = Scheduler(
                jobs=jobs,
                time_zone=args.time_zone,
                grace_period_ms=args.grace_period_ms,
                clock=clock,
            )
            handler = make_handler(args, ledger, clock)
            options = schedule_options(args)
            if args.cron is not None:
                scheduler.add_cron(args.name, args.cron, handler, **options)
            else:
                scheduler.add_interval(args.name, args.interval_ms, handler, **options)
            emit(
                {
                    "event": "ready",
                    "replica_id": args.replica_id,
                    "pid": os.getpid(),
                    "tz_env": os.environ.get("TZ"),
                    **(await db_clock(ledger)),
                }
            )
            if args.start_at is not None:
                await wait_or_stop(stop, args.start_at - time.time())
            if stop.is_set():
                emit({"event": "stopped", "ran_scheduler": False})
                return 0
            entered = clock()
            async with scheduler:
                emit(
                    {
                        "event": "started",
                        "replica_id": args.replica_id,
                        "pid": os.getpid(),
                        "entered": entered.timestamp(),
                        "entered_iso": entered.isoformat(),
                        "after": clock().timestamp(),
                    }
                )
                await wait_or_stop(stop, budget_end - time.monotonic())
                emit({"event": "stopping", "signalled": stop.is_set()})
    emit({"event": "stopped", "ran_scheduler": True})
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    args = parse(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"%(asctime)s r{args.replica_id} %(name)s %(levelname)s %(message)s",
    )
    events = EventHandler(level=logging.DEBUG)
    for name in ("sdcore.scheduling", "sdcore.job_scheduler"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        logger.addHandler(events)
    for handler in logging.getLogger().handlers:
        handler.setLevel(logging.INFO)  # debug records go to stdout events only
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
