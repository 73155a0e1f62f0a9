"""A replica for the PostgreSQL cluster walk (tests/acceptance/test_cluster_walk.py): ``sdcore run``
of a Runtime with two per-second exclusive schedules and a stored-schedule handler.

Each handler run writes a ``start`` row to ``walk_events`` (schedule, run key, attempt, fencing
token, pid, database clock) and, when it ends, a ``done``, ``failed`` or ``cancelled`` row. Whether
a run fails or is slow is a function of (``SDCORE_WALK_SEED``, schedule, run key, attempt)
(``_walk_plan.fate``), so the test knows it without asking the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from typing import Any

from sdcore.postgres import PoolSettings
from sdcore.runtime import Runtime
from sdcore.scheduling import Tick
from tests.acceptance._walk_plan import (
    CODE,
    LEASE_MS,
    RETRY_BACKOFF_MS,
    SEED,
    STORED_HANDLER,
    PlannedFailure,
    fate,
)

runtime = Runtime(
    database_url=os.environ["SDCORE_WALK_DSN"], pool=PoolSettings(max_size=6), grace_period_ms=1_500
)


async def _record(tick: Tick, phase: str, args: dict[str, Any] | None) -> None:
    fence = None if tick.lease is None else tick.lease.fencing_token
    async with runtime.pool.connection() as conn:
        await conn.execute(
            "INSERT INTO walk_events (schedule, run_key, attempt, pid, phase, fence, args)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s::jsonb)",
            (
                tick.schedule,
                tick.run_key,
                tick.attempt,
                os.getpid(),
                phase,
                fence,
                json.dumps(args),
            ),
        )


async def _work(tick: Tick, args: dict[str, Any] | None = None) -> None:
    await _record(tick, "start", args)
    outcome, seconds = fate(SEED, tick.schedule, tick.run_key or "", tick.attempt)
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        # Best effort (a stopping replica may no longer reach its pool); the cancellation goes on.
        with contextlib.suppress(Exception):
            await asyncio.shield(_record(tick, "cancelled", args))
        raise
    if outcome == "fail":
        await _record(tick, "failed", args)
        raise PlannedFailure(f"{tick.schedule} {tick.run_key} attempt {tick.attempt} fails")
    await _record(tick, "done", args)


@runtime.scheduler.interval(CODE["beat"][0], name="beat", lease_ms=LEASE_MS)
async def beat(tick: Tick) -> None:
    """A per-second exclusive schedule without retries."""
    await _work(tick)


@runtime.scheduler.interval(
    CODE["flaky"][0],
    name="flaky",
    lease_ms=LEASE_MS,
    retries=CODE["flaky"][1],
    retry_backoff_ms=RETRY_BACKOFF_MS,
)
async def flaky(tick: Tick) -> None:
    """A per-second exclusive schedule with two retries."""
    await _work(tick)


@runtime.scheduler.handler(STORED_HANDLER)
async def work(tick: Tick, args: dict[str, Any]) -> None:
    """The handler of the stored schedules the walk creates."""
    await _work(tick, args)
