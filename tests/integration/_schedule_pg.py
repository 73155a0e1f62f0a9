"""Set-up shared by the control plane's PostgreSQL tests: a pool with the lease and schedule
schemas in place, and a bounded wait for a condition."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from psycopg_pool import AsyncConnectionPool

from sdcore.job_scheduler import JobSchedulerService
from sdcore.scheduling import PostgresScheduleStore


@contextlib.asynccontextmanager
async def schedule_pool(dsn: str, *, max_size: int = 8) -> AsyncIterator[AsyncConnectionPool[Any]]:
    """An open autocommit pool on ``dsn`` whose database has the lease and schedule tables."""
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn, min_size=1, max_size=max_size, kwargs={"autocommit": True}, open=False
    )
    await pool.open(wait=True)
    jobs = JobSchedulerService(pool, max_connections=2)
    await jobs.ensure_schema()
    await PostgresScheduleStore(pool).ensure_schema()
    yield pool
    await jobs.close()
    await pool.close()


async def until(predicate: Callable[[], Awaitable[bool]], timeout: float = 15.0) -> None:
    """Wait until ``predicate()`` is true; fail the test after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)
