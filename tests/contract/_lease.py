"""The lease contract's backends: in memory, on PostgreSQL, on a database upgraded from 0.1.0."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from sdcore.job_scheduler import (
    BaseJobScheduler,
    JobAcquired,
    JobAcquireOptions,
    JobSchedulerService,
)
from sdcore.testing import FakeClock, MemoryJobScheduler
from tests.integration.test_migrations import DDL_0_1_0, LEGACY_CODE, SEED_0_1_0

BACKENDS = ["memory", "postgres", "postgres-upgraded-from-0.1.0"]


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
