"""A replica for the control-plane acceptance tests: ``sdcore run`` of a Runtime with one
per-second exclusive schedule and a stored-schedule handler, each run recorded in
``control_events`` (a start row, then a done row after ``SDCORE_CONTROL_WORK_S``)."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from sdcore.postgres import PoolSettings
from sdcore.runtime import Runtime
from sdcore.scheduling import ControlSettings, Tick

runtime = Runtime(
    database_url=os.environ["SDCORE_CONTROL_DSN"],
    pool=PoolSettings(max_size=6),
    control=ControlSettings(listen=os.environ.get("SDCORE_CONTROL_LISTEN", "1") == "1"),
    grace_period_ms=2_000,
)


async def _record(tick: Tick, phase: str, args: dict[str, Any] | None) -> None:
    fence = None if tick.lease is None else tick.lease.fencing_token
    async with runtime.pool.connection() as conn:
        await conn.execute(
            "INSERT INTO control_events (schedule, run_key, pid, phase, fence, args)"
            " VALUES (%s, %s, %s, %s, %s, %s::jsonb)",
            (tick.schedule, tick.run_key, os.getpid(), phase, fence, json.dumps(args)),
        )


async def _work(tick: Tick, args: dict[str, Any] | None = None) -> None:
    await _record(tick, "start", args)
    await asyncio.sleep(float(os.environ.get("SDCORE_CONTROL_WORK_S", "0.2")))
    await _record(tick, "done", args)


@runtime.scheduler.interval(1_000, name="beat", lease_ms=2_000)
async def beat(tick: Tick) -> None:
    """The per-second exclusive schedule."""
    await _work(tick)


@runtime.scheduler.handler("digest")
async def digest(tick: Tick, args: dict[str, Any]) -> None:
    """The handler stored schedules run."""
    await _work(tick, args)
