"""A caller cancelled while an acquire recovers from a broken connection never leaves a
committed ``RUNNING`` row with no owner: the outcome is resolved by the caller's token and a row
it won is given back, on every acquire path (``acquire``/``run_exclusive``, ``acquire_many``,
the scheduler's ``acquire_attempt`` and ``acquire_attempts``).

A local proxy forwards the acquire (its INSERT commits), then drops the connection before the
answer; from then on every answer through the proxy is slow, and the caller is cancelled while
the recovery reads the row back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

from sdcore.job_scheduler import AttemptBudget, JobAcquireOptions, JobSchedulerService
from sdcore.postgres import PoolSettings
from tests._pgproxy import PgProxy, on_message

SLOW_S = 1.0  # every answer's delay once the first acquire's answer was dropped
OPTIONS = JobAcquireOptions(code="recover", run_key="k", lease_ms=60_000)
BUDGET = AttemptBudget(max_attempts=1, backoff_ms=60_000)


async def _run_exclusive(svc: JobSchedulerService) -> Any:
    async def never(lease: object) -> None:
        raise AssertionError("fn must not start")

    return await svc.run_exclusive(OPTIONS, never)


async def _acquire_many(svc: JobSchedulerService) -> Any:
    return await svc.acquire_many([OPTIONS])


async def _acquire_attempt(svc: JobSchedulerService) -> Any:
    return await svc.acquire_attempt(OPTIONS, BUDGET)


async def _acquire_attempts(svc: JobSchedulerService) -> Any:
    return await svc.acquire_attempts([(OPTIONS, BUDGET)])


PATHS: dict[str, Callable[[JobSchedulerService], Awaitable[Any]]] = {
    "run_exclusive": _run_exclusive,
    "acquire_many": _acquire_many,
    "acquire_attempt": _acquire_attempt,
    "acquire_attempts": _acquire_attempts,
}


@pytest.mark.parametrize("path", list(PATHS))
async def test_cancelled_during_recovery_gives_the_row_back(
    jobs: JobSchedulerService, pg_dsn: str, path: str
) -> None:
    async with (
        PgProxy(pg_dsn, slow_after_trip_s=SLOW_S) as proxy,
        JobSchedulerService.connect(
            proxy.dsn, pool=PoolSettings(max_size=2), max_connections=1
        ) as svc,
    ):
        await svc.statuses(["warm-up"])  # the held connection is open before the fault
        proxy.arm(on_message(b"INSERT INTO"))
        call = asyncio.ensure_future(PATHS[path](svc))
        await asyncio.wait_for(proxy.swallowed.wait(), 30)
        await asyncio.sleep(SLOW_S / 2)  # the recovery is reading the row back now
        assert not call.done()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, 60)
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT status, given_back FROM job_scheduler WHERE lock_key = %s",
            (OPTIONS.lock_key,),
        )
        row = await cur.fetchone()
    assert row == ("FAIL", "cancelled")  # committed, then given back: not RUNNING, no owner
    # Another replica takes the run at once (the tick acquire with the same attempt number).
    if path.startswith("acquire_attempt"):
        ticked = await jobs.acquire_attempt(OPTIONS, BUDGET)
        got = ticked.result
        assert (got.acquired, ticked.attempt) == (True, 1)
    else:
        got = await jobs.acquire(OPTIONS)
        assert got.acquired
    with contextlib.suppress(Exception):
        await jobs.complete(got.lease)  # type: ignore[union-attr]
