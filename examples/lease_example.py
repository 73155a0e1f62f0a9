"""Run one logical job on exactly one of several replicas.

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/postgres python examples/lease_example.py

Start it in several terminals at once: for each tick of the minute, one process prints
"ran", the others "skipped".
"""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime

from sdcore.job_scheduler import JobExecutionLease, JobSchedulerService, bullmq_job_id


async def sync_orders(lease: JobExecutionLease) -> int:
    # Side effects carry the stable idempotency key (and the fencing token for direct writes).
    print(f"  working; job id for BullMQ would be {bullmq_job_id(lease.idempotency_key)}")
    await asyncio.sleep(1)
    return 42


async def main() -> None:
    dsn = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    async with JobSchedulerService.connect(dsn) as jobs:
        await jobs.ensure_schema()
        tick = datetime.now(UTC).replace(second=0, microsecond=0)
        outcome = await jobs.run_exclusive(
            {
                "code": "sync-orders",
                "name": "Sync orders from ERP",
                "run_key": tick.strftime("%Y-%m-%dT%H:%M:%SZ"),
                "lease_ms": 60_000,
            },
            sync_orders,
        )
        print("ran" if outcome.acquired else "skipped", outcome)


if __name__ == "__main__":
    asyncio.run(main())
