"""A scheduler replica for the failover test: ``python -m tests.acceptance._failover_replica``.

One ``JobSchedulerService.connect`` on a multi-host DSN (``target_session_attrs=read-write``) and
one per-second cron schedule. Its ledger is stdout, not the database (a failover may lose rows;
it must not lose the evidence): JSON lines ``ready``, ``started``, ``ran`` (handler start, with
the run key, fencing token and wall time), ``done`` (handler end) and ``stopped``. Logs go to
stderr. Runs until SIGTERM, end of stdin or ``--seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from sdcore.job_scheduler import JobSchedulerService
from sdcore.postgres import PoolSettings
from sdcore.scheduling import CatchUp, Overlap, Scheduler, Tick

_OUT = threading.Lock()


def emit(obj: dict[str, Any]) -> None:
    """One JSON line on stdout, flushed."""
    with _OUT:
        sys.stdout.write(json.dumps(obj, default=str) + "\n")
        sys.stdout.flush()


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(prog="python -m tests.acceptance._failover_replica")
    p.add_argument("--dsn", required=True)
    p.add_argument("--replica-id", type=int, required=True)
    p.add_argument("--name", default="failover")
    p.add_argument("--lease-ms", type=int, default=5_000)
    p.add_argument("--work-ms", type=int, default=200)
    p.add_argument("--seconds", type=float, default=90.0)
    p.add_argument("--start-at", type=float, required=True, help="epoch time to start ticking")
    return p.parse_args(argv)


async def amain(args: argparse.Namespace) -> int:
    """Run one replica until asked to stop."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def watch_stdin() -> None:
        with contextlib.suppress(OSError, ValueError):
            while sys.stdin.readline():
                pass
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=watch_stdin, daemon=True).start()
    async with JobSchedulerService.connect(
        args.dsn,
        pool=PoolSettings(
            max_size=4, application_name=f"failover-{args.replica_id}", connect_timeout=2
        ),
    ) as jobs:
        await jobs.ensure_schema()
        scheduler = Scheduler(jobs=jobs, grace_period_ms=5_000)

        async def handler(tick: Tick) -> None:
            fencing = None if tick.lease is None else tick.lease.fencing_token
            emit(
                {
                    "event": "ran",
                    "replica_id": args.replica_id,
                    "run_key": tick.run_key,
                    "fencing_token": fencing,
                    "attempt": tick.attempt,
                    "t": time.time(),
                }
            )
            await asyncio.sleep(args.work_ms / 1000)
            emit({"event": "done", "run_key": tick.run_key, "t": time.time()})

        scheduler.add_cron(
            args.name,
            "* * * * * *",
            handler,
            lease_ms=args.lease_ms,
            retries=3,
            retry_backoff_ms=250,
            catch_up=CatchUp.ALL,
            catch_up_window_ms=15_000,
            # The test is about the lease across a failover, not the overlap policy: with the
            # default "skip", every tick that falls while the previous run's commit hangs on the
            # stalled standby is skipped by policy on every replica (their own acquire of the
            # previous tick is in flight too) and never runs — by design.
            overlap=Overlap.ALLOW,
        )
        emit({"event": "ready", "replica_id": args.replica_id})
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, args.start_at - time.time())):
                await stop.wait()
        if not stop.is_set():
            async with scheduler:
                emit({"event": "started", "replica_id": args.replica_id, "t": time.time()})
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(args.seconds):
                        await stop.wait()
    emit({"event": "stopped", "replica_id": args.replica_id, "t": time.time()})
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    args = parse(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"%(asctime)s r{args.replica_id} %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
