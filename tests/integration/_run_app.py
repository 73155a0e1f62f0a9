"""An application module for the ``sdcore run`` tests: a Runtime with a per-second schedule."""

from __future__ import annotations

import os

from sdcore.postgres import PoolSettings
from sdcore.runtime import Runtime
from sdcore.scheduling import Tick

runtime = Runtime(
    database_url=os.environ["SDCORE_RUN_TEST_DSN"],
    redis_url=os.environ.get("SDCORE_RUN_TEST_REDIS") or None,
    pool=PoolSettings(max_size=4),
    grace_period_ms=3_000,
)


@runtime.scheduler.interval(1_000, name="heartbeat-row")
async def beat(tick: Tick) -> None:
    """One row per tick (the lease row is the record)."""


# Built without a scheduler: the command line cannot turn it on.
no_scheduling = Runtime(
    database_url=os.environ["SDCORE_RUN_TEST_DSN"],
    pool=PoolSettings(max_size=4),
    scheduling=None,
    relay=None,
    grace_period_ms=3_000,
)


@no_scheduling.scheduler.interval(1_000, name="heartbeat-row")
async def beat_never(tick: Tick) -> None:
    """Declared on a Runtime built with ``scheduling=None``: never fires."""


def factory() -> Runtime:
    """A factory, as some applications expose."""
    return runtime


broken_factory_calls = 0


def broken_factory() -> Runtime:
    """A factory that fails, with a password in its message."""
    raise RuntimeError("cannot reach postgresql://app:hunter2@db/app")


not_a_runtime = 42
