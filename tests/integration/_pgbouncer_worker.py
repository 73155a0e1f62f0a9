"""One contender of the PgBouncer test: ``python -m tests.integration._pgbouncer_worker``.

Connects (``JobSchedulerService.connect``), prints ``{"event": "ready"}``, waits for a line on
stdin, then calls ``run_exclusive`` once for each of ``--runs`` run keys of one job code, in order,
like every other contender. Prints one JSON line at the end: the keys whose callable ran here,
how many were not acquired, and every error (type and text).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any

from sdcore.job_scheduler import JobExecutionLease, JobSchedulerService
from sdcore.postgres import PoolSettings


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(prog="python -m tests.integration._pgbouncer_worker")
    p.add_argument("--dsn", required=True)
    p.add_argument("--code", required=True)
    p.add_argument("--runs", type=int, required=True)
    p.add_argument("--transaction-pooling", action="store_true")
    p.add_argument("--work-ms", type=int, default=3)
    return p.parse_args(argv)


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    """Contend for every run key; return what happened."""
    ran: list[str] = []
    errors: list[str] = []
    not_acquired = 0
    async with JobSchedulerService.connect(
        args.dsn, pool=PoolSettings(max_size=2, transaction_pooling=args.transaction_pooling)
    ) as jobs:
        print(json.dumps({"event": "ready"}), flush=True)  # noqa: T201
        await asyncio.to_thread(sys.stdin.readline)
        for index in range(args.runs):
            run_key = f"run-{index:04d}"

            async def work(lease: JobExecutionLease, run_key: str = run_key) -> None:
                ran.append(run_key)
                await asyncio.sleep(args.work_ms / 1000)

            try:
                outcome = await jobs.run_exclusive(
                    {"code": args.code, "run_key": run_key, "lease_ms": 30_000}, work
                )
            except Exception as exc:  # counted and reported; the test asserts none
                errors.append(f"{type(exc).__name__}: {exc}"[:500])
                continue
            if not outcome.acquired:
                not_acquired += 1
    return {"event": "done", "ran": ran, "not_acquired": not_acquired, "errors": errors}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    result = asyncio.run(amain(parse(argv)))
    print(json.dumps(result), flush=True)  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())
