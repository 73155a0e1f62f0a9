"""The schedule store contract's implementations: memory, and PostgreSQL on a fresh database."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from psycopg_pool import AsyncConnectionPool

from sdcore.job_scheduler import BaseJobScheduler, JobSchedulerService
from sdcore.postgres import derived_name
from sdcore.scheduling import PostgresScheduleStore
from sdcore.scheduling._control import (
    ActionKind,
    Declared,
    Replica,
    RunStart,
    ScheduleStore,
    Write,
    fingerprint,
    policy_options,
)
from sdcore.scheduling._policy import build_policy
from sdcore.testing import FakeClock, MemoryJobScheduler, MemoryScheduleStore

SCHEDULE_STORES = ["memory", "postgres"]
TABLE = "sdcore_schedules"
TICK_AT = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)


def replica(host: str = "replica", pid: int = 1, handlers: tuple[str, ...] = ()) -> Replica:
    """A new replica (its own id)."""
    return Replica(replica_id=str(uuid.uuid4()), host=host, pid=pid, handlers=handlers)


def declared(name: str, every_ms: int = 60_000) -> Declared:
    """A code-declared interval schedule, as a replica syncs it."""
    options = policy_options(build_policy(name, {}, has_jobs=True, default_lease_ms=300_000))
    expression = str(every_ms)
    return Declared(
        name=name,
        kind="interval",
        expression=expression,
        time_zone="UTC",
        options=options,
        fingerprint=fingerprint("interval", expression, "UTC", options),
    )


def stored(
    name: str,
    action: ActionKind = ActionKind.CREATE,
    *,
    every_ms: int = 60_000,
    expected_revision: int | None = None,
    args: dict[str, Any] | None = None,
) -> Write:
    """A create (or, given ``expected_revision``, an update) of a stored schedule."""
    return Write(
        name=name,
        action=action,
        actor="ops",
        reason=None,
        stored=declared(name, every_ms),
        handler="digest",
        args=args or {},
        expected_revision=expected_revision,
    )


def control(
    name: str,
    action: ActionKind,
    *,
    request_id: str | None = None,
    actor: str = "ops",
    reason: str | None = None,
    params: dict[str, Any] | None = None,
) -> Write:
    """A write that changes no definition: pause, resume, remove, trigger, backfill."""
    return Write(
        name=name,
        action=action,
        actor=actor,
        reason=reason,
        params=params or {},
        request_id=request_id,
    )


def run_start(
    run_key: str,
    token: int | None,
    schedule: str = "report",
    *,
    attempt: int = 1,
    source: str = "tick",
) -> RunStart:
    """A run start of ``schedule``'s tick ``run_key`` under fencing token ``token``."""
    return RunStart(
        schedule=schedule,
        run_key=run_key,
        source=source,
        scheduled_at=TICK_AT,
        attempt=attempt,
        fencing_token=token,
        replica=replica(pid=token or 0),
    )


@dataclass
class Schedules:
    """One implementation of the schedule store port, with the test's back doors into it."""

    name: str
    store: ScheduleStore
    jobs: BaseJobScheduler
    """The lease backend whose rows ``release_failed`` and ``succeeded_before`` read."""
    age: Callable[[int], Awaitable[None]]
    """Let ``ms`` pass for every replica (the memory clock moves; PostgreSQL's rows move back)."""
    now: Callable[[], Awaitable[datetime]]
    """The store's clock now, strictly after everything recorded so far."""


async def memory_schedules() -> Schedules:
    clock = FakeClock(datetime.now(UTC))
    jobs = MemoryJobScheduler(clock=clock)
    store = MemoryScheduleStore(jobs, clock=clock)

    async def age(ms: int) -> None:
        clock.advance(ms=ms)

    async def now() -> datetime:
        return clock.advance(ms=1)

    return Schedules("memory", store, jobs, age, now)


async def postgres_schedules(dsn: str) -> AsyncIterator[Schedules]:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn, min_size=1, max_size=4, kwargs={"autocommit": True}, open=False
    )
    await pool.open(wait=True)
    try:
        jobs = JobSchedulerService(pool, max_connections=1)
        store = PostgresScheduleStore(pool, table=TABLE)
        replicas = derived_name(TABLE, "replicas")

        async def age(ms: int) -> None:
            async with pool.connection() as conn:
                await conn.execute(
                    f"UPDATE {replicas} SET last_seen = last_seen - %(d)s * interval '1 ms',"
                    " started_at = started_at - %(d)s * interval '1 ms'",
                    {"d": ms},
                )

        async def now() -> datetime:
            async with pool.connection() as conn:
                cur = await conn.execute("SELECT clock_timestamp()")
                row = await cur.fetchone()
            assert row is not None
            instant: datetime = row[0]
            return instant

        yield Schedules("postgres", store, jobs, age, now)
        await jobs.close()
    finally:
        await pool.close()
