"""The lease contract's backends: in memory, on PostgreSQL, on a database upgraded from 0.1.0."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from sdcore import sync
from sdcore.job_scheduler import (
    AttemptAcquireResult,
    AttemptBudget,
    BaseJobScheduler,
    JobAcquired,
    JobAcquireOptions,
    JobAcquireResult,
    JobExecutionLease,
    JobLease,
    JobSchedulerService,
    JobSchedulerStatus,
    RunExclusiveResult,
    TickRecord,
)
from sdcore.job_scheduler._base import RELEASED_DATA
from sdcore.testing import FakeClock, MemoryJobScheduler
from tests.integration.test_migrations import DDL_0_1_0, LEGACY_CODE, SEED_0_1_0

BACKENDS = ["memory", "postgres", "postgres-upgraded-from-0.1.0", "postgres-sync"]

# Contract tests that do not apply to the blocking facade, with the reason; the behaviour each
# stands for is checked for sync code in tests/integration/test_sync_lease.py.
NOT_FOR_SYNC = {
    "test_run_exclusive_awaits_an_awaitable_returned_by_a_plain_callable": (
        "the blocking run_exclusive refuses an awaitable result"
    ),
    "test_cancellation_marks_fail_and_propagates": "a blocking call has no asyncio cancellation",
    "test_cancelling_a_thread_run_waits_for_the_thread_and_signals_it": (
        "a blocking call has no asyncio cancellation (KeyboardInterrupt is its interrupt)"
    ),
    "test_loss_seen_by_the_heartbeat_cancels_an_async_function": (
        "no async function runs under the blocking run_exclusive"
    ),
}


@dataclass
class Backend:
    """One implementation of the lease port, with the test's back doors into its rows."""

    name: str
    service: BaseJobScheduler
    age: Callable[[str, int], Awaitable[None]]
    read: Callable[[str], Awaitable[dict[str, Any]]]
    count: Callable[[], Awaitable[int]]
    # The largest fencing token the table held before the test: tokens come from one sequence
    # per table, so a new key's first token is above it (1 in an empty table).
    base: int = 0


async def memory_backend() -> Backend:
    clock = FakeClock()
    service = MemoryJobScheduler(clock=clock)

    async def age(job_id: str, ms: int) -> None:
        clock.advance(ms=ms)

    async def read(job_id: str) -> dict[str, Any]:
        row = service.get(job_id)
        assert row is not None
        return {
            "status": row.status.value,
            "owner_token": row.owner_token,
            "fencing_token": row.fencing_token,
            "data": row.data,
            "code": row.code,
            "run_key": row.run_key,
            "name": row.name,
            "idempotency_key": row.idempotency_key,
        }

    async def count() -> int:
        return len(service.rows())

    return Backend("memory", service, age, read, count)


def _opts(**kwargs: Any) -> JobAcquireOptions:
    kwargs.setdefault("code", "contract")
    kwargs.setdefault("run_key", "2026-07-20T03:00:00Z")
    return JobAcquireOptions(**kwargs)


async def _acquire(backend: Backend, **kwargs: Any) -> JobAcquired:
    result = await backend.service.acquire(_opts(**kwargs))
    assert result.acquired
    return result


async def postgres_backend(dsn: str, *, upgraded: bool) -> AsyncIterator[Backend]:
    """A JobSchedulerService on ``dsn`` (on the 0.1.0 tables with rows if ``upgraded``)."""
    if upgraded:
        # The 0.1.0 tables with unrelated rows; ensure_schema() below migrates them in place.
        with psycopg.connect(dsn, autocommit=True) as setup:
            setup.execute(DDL_0_1_0.read_bytes())
            setup.execute(SEED_0_1_0)
    async with JobSchedulerService.connect(dsn) as service:
        await service.ensure_schema()
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:

            async def age(job_id: str, ms: int) -> None:
                await conn.execute(
                    "UPDATE job_scheduler SET modified_at = modified_at - %s * interval '1 ms'"
                    " WHERE id = %s",
                    (ms, job_id),
                )

            async def read(job_id: str) -> dict[str, Any]:
                cur = await conn.execute(
                    "SELECT status, owner_token::text, fencing_token, data, code, run_key, name,"
                    " idempotency_key FROM job_scheduler WHERE id = %s",
                    (job_id,),
                )
                row = await cur.fetchone()
                assert row is not None
                keys = ("status", "owner_token", "fencing_token", "data", "code", "run_key")
                return dict(zip((*keys, "name", "idempotency_key"), row, strict=True))

            async def count() -> int:
                cur = await conn.execute(
                    "SELECT count(*) FROM job_scheduler WHERE code <> %s", (LEGACY_CODE,)
                )
                row = await cur.fetchone()
                assert row is not None
                return int(row[0])

            cur = await conn.execute("SELECT coalesce(max(fencing_token), 0) FROM job_scheduler")
            top = await cur.fetchone()
            assert top is not None
            yield Backend("postgres", service, age, read, count, base=int(top[0]))


class SyncFacade(BaseJobScheduler):
    """The blocking ``sdcore.sync.JobSchedulerService`` seen through the async port.

    Each call runs the blocking method in a worker thread (a blocking call from the test's
    loop is refused). An ``async`` function given to ``run_exclusive`` becomes a plain one that
    runs it on the test's loop and blocks until it ends: the facade runs plain functions only.
    """

    def __init__(self, jobs: sync.JobSchedulerService) -> None:
        super().__init__()
        self.jobs = jobs

    async def acquire(self, options: JobAcquireOptions | Mapping[str, Any]) -> JobAcquireResult:
        return await asyncio.to_thread(self.jobs.acquire, options)

    async def acquire_many(
        self, options: Sequence[JobAcquireOptions | Mapping[str, Any]]
    ) -> list[JobAcquireResult]:
        return await asyncio.to_thread(self.jobs.acquire_many, options)

    async def heartbeat(self, lease: JobLease) -> bool:
        return await asyncio.to_thread(self.jobs.heartbeat, lease)

    async def complete(self, lease: JobLease, data: Mapping[str, Any] | None = None) -> bool:
        return await asyncio.to_thread(self.jobs.complete, lease, data)

    async def fail(self, lease: JobLease, data: Mapping[str, Any] | None = None) -> bool:
        return await asyncio.to_thread(self.jobs.fail, lease, data)

    async def release(
        self, lease: JobLease, data: Mapping[str, Any] | None = RELEASED_DATA
    ) -> bool:
        return await asyncio.to_thread(self.jobs.release, lease, data)

    async def give_back(self, lease: JobLease, reason: str) -> bool:
        return await asyncio.to_thread(self.jobs.give_back, lease, reason)

    async def statuses(self, lock_keys: Sequence[str]) -> dict[str, JobSchedulerStatus]:
        return await asyncio.to_thread(self.jobs.statuses, lock_keys)

    async def status_of(self, lease: JobLease) -> JobSchedulerStatus | None:
        return await asyncio.to_thread(self.jobs.status_of, lease)

    async def run_exclusive(
        self,
        options: JobAcquireOptions | Mapping[str, Any],
        fn: Callable[[JobExecutionLease], Any],
    ) -> RunExclusiveResult[Any]:
        if inspect.iscoroutinefunction(fn):
            loop, work = asyncio.get_running_loop(), fn

            def fn(lease: JobExecutionLease) -> Any:
                return asyncio.run_coroutine_threadsafe(work(lease), loop).result()

        return await asyncio.to_thread(self.jobs.run_exclusive, options, fn)

    # The tick operations are the scheduler's, not the facade's: the tests that set up rows
    # with them reach the async service on the facade's portal.
    async def acquire_attempt(
        self, options: JobAcquireOptions, budget: AttemptBudget
    ) -> AttemptAcquireResult:
        inner = self.jobs._service
        return await asyncio.to_thread(
            self.jobs.portal.call, inner.acquire_attempt, options, budget
        )

    async def tick_records(self, lock_keys: Sequence[str]) -> dict[str, TickRecord]:
        inner = self.jobs._service
        return await asyncio.to_thread(self.jobs.portal.call, inner.tick_records, lock_keys)

    async def first_seen(self, code: str) -> datetime | None:
        inner = self.jobs._service
        return await asyncio.to_thread(self.jobs.portal.call, inner.first_seen, code)

    async def first_seen_many(self, codes: Sequence[str]) -> dict[str, datetime]:
        inner = self.jobs._service
        return await asyncio.to_thread(self.jobs.portal.call, inner.first_seen_many, codes)


async def sync_backend(dsn: str) -> AsyncIterator[Backend]:
    """The PostgreSQL backend driven through ``sdcore.sync.JobSchedulerService``."""
    connected = sync.JobSchedulerService.connect(dsn)
    jobs = await asyncio.to_thread(connected.__enter__)
    try:
        await asyncio.to_thread(jobs.ensure_schema)
        async for value in postgres_backend(dsn, upgraded=False):
            value.name = "postgres-sync"
            value.service = SyncFacade(jobs)
            yield value
    finally:
        await asyncio.to_thread(connected.__exit__, None, None, None)
