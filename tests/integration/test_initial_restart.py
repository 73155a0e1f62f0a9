"""A failed ``initial()`` job is retried at the next start of a replica, with a new budget."""

from __future__ import annotations

import asyncio

import psycopg

from sdcore.job_scheduler import JobSchedulerService
from sdcore.scheduling import Scheduler, Tick


async def _start(dsn: str, calls: list[str], label: str, *, fail: bool, retries: int = 0) -> None:
    """One process start: a new service and Scheduler, the initial job fired once."""

    def seed(tick: Tick) -> None:
        calls.append(f"{label} (attempt {tick.attempt})")
        if fail:
            raise RuntimeError("transient")

    async with JobSchedulerService.connect(dsn) as jobs:
        scheduler = Scheduler(jobs=jobs)
        scheduler.add_initial("seed", seed, retries=retries, retry_backoff_ms=50)
        async with scheduler:
            for _ in range(100):
                await asyncio.sleep(0.05)
                if len([c for c in calls if c.startswith(label)]) >= retries + 1:
                    break
            await asyncio.sleep(0.2)


def _row(dsn: str) -> tuple[str, int]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT status, attempts FROM job_scheduler WHERE code = 'seed'")
        found = row.fetchone()
    assert found is not None
    return str(found[0]), int(found[1])


async def test_a_failed_initial_job_runs_again_at_the_next_start(schema_dsn: str) -> None:
    dsn = schema_dsn
    calls: list[str] = []
    await _start(dsn, calls, "start 1", fail=True)
    assert _row(dsn) == ("FAIL", 1)
    await _start(dsn, calls, "start 2", fail=True, retries=1)  # a whole new budget: 2 runs
    assert _row(dsn) == ("FAIL", 2)
    await _start(dsn, calls, "start 3", fail=False)
    assert calls == [
        "start 1 (attempt 1)",
        "start 2 (attempt 1)",
        "start 2 (attempt 2)",
        "start 3 (attempt 1)",
    ]
    assert _row(dsn) == ("SUCCESS", 1)
    await _start(dsn, calls, "start 4", fail=False)  # once it succeeded, never again
    assert len(calls) == 4
