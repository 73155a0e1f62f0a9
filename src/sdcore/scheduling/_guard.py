"""The cluster-wide overlap guard (``overlap="skip_cluster"``): a second lease per schedule.

A tick of such a schedule first takes the lease ``(schedule, "overlap-guard")``, runs while it
holds it (heartbeating it), and releases it afterwards; a replica that cannot take it skips the
tick as an overlap.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sdcore._internal.telemetry import SKIPPED_OVERLAP
from sdcore.job_scheduler import JobAcquireOptions, JobSchedulerError
from sdcore.scheduling._policy import RunPolicy
from sdcore.scheduling._triggers import ScheduleKind, Tick

if TYPE_CHECKING:
    from sdcore.scheduling._runner import TickRunner

OVERLAP_GUARD_RUN_KEY = "overlap-guard"


@dataclass(frozen=True, slots=True, kw_only=True)
class TickOutcome:
    """What happened to a tick on this process (for logs, tests and the demo)."""

    ran: bool
    succeeded: bool
    attempts: int


async def run_guarded(
    runner: TickRunner,
    name: str,
    kind: ScheduleKind,
    policy: RunPolicy,
    tick: Tick,
    body: Callable[[], Awaitable[TickOutcome]],
    record_skip: bool,
) -> TickOutcome:
    """Cluster-wide overlap guard: a second lease per schedule, released after the run.

    The guard is a lease like any other: when its heartbeat is refused (the row was taken
    over or released) or cannot be confirmed within its lease, the run is cancelled.
    """
    assert runner.jobs is not None  # noqa: S101
    jobs = runner.jobs
    options = JobAcquireOptions(
        code=name,
        run_key=OVERLAP_GUARD_RUN_KEY,
        lease_ms=policy.lease_ms,
        heartbeat_ms=policy.heartbeat_ms,
    )
    loop = asyncio.get_running_loop()
    sent = loop.time()
    assert runner.acquirer is not None  # noqa: S101 - set with jobs
    guard = await runner.acquirer.acquire_plain(options)
    if not guard.acquired:
        runner.log.info(
            "schedule %r run %r: skipped, a previous run is still running in the cluster",
            name,
            tick.run_key,
            extra={"action": "tick_overlap_skipped", "schedule": name, "run_key": tick.run_key},
        )
        if record_skip:
            await runner.record_skipped(
                name, kind, policy, tick, "overlap", outcome=SKIPPED_OVERLAP
            )
        return TickOutcome(ran=False, succeeded=False, attempts=0)
    lease = guard.lease
    work = asyncio.ensure_future(body())
    lost: list[str] = []

    async def keep_alive() -> None:
        confirmed = sent
        interval = (options.heartbeat_ms or options.lease_ms // 3) / 1000
        while True:
            await asyncio.sleep(interval)
            beat = loop.time()
            try:
                async with asyncio.timeout(max(interval, 0.2)):
                    ok = await jobs.heartbeat(lease)
            except (JobSchedulerError, TimeoutError) as exc:
                runner.log.warning("schedule %r: overlap guard heartbeat failed: %s", name, exc)
                if loop.time() - confirmed < options.lease_ms / 1000:
                    continue
                ok = False
            if not ok:
                lost.append("the overlap guard's lease was lost")
                runner.log.warning(
                    "schedule %r run %r: overlap guard lost; cancelling the run",
                    name,
                    tick.run_key,
                    extra={"action": "guard_lost", "schedule": name, "run_key": tick.run_key},
                )
                work.cancel()
                return
            confirmed = beat

    beat_task = asyncio.create_task(keep_alive(), name=f"sdcore-overlap-guard:{name}")
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        if not lost:
            work.cancel()
            await asyncio.wait({work})
            raise
        return TickOutcome(ran=True, succeeded=False, attempts=0)
    finally:
        beat_task.cancel()
        await asyncio.wait({beat_task})
        if not lost:
            try:
                await asyncio.shield(jobs.release(lease))
            except JobSchedulerError:
                runner.log.warning("schedule %r: could not release the overlap guard", name)
