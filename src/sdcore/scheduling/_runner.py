"""Running one tick: the lease, the overlap/retry policies, logging that never kills the loop."""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from sdcore.job_scheduler import (
    BaseJobScheduler,
    JobAcquireOptions,
    JobExecutionLease,
    JobSchedulerError,
    JobSchedulerStatus,
    JobSchedulerType,
    LostJobLeaseError,
)
from sdcore.scheduling._triggers import ScheduleKind, Tick

Handler = Callable[[Tick], Awaitable[Any] | Any]

OVERLAP_GUARD_RUN_KEY = "overlap-guard"


class Overlap(enum.StrEnum):
    """May a tick start while this schedule's previous run is still running?

    ``SKIP``: not on this process (NestJS ``waitForCompletion``); ``ALLOW``: yes;
    ``SKIP_CLUSTER``: not anywhere in the cluster (costs a guard lease per tick).
    """

    SKIP = "skip"
    ALLOW = "allow"
    SKIP_CLUSTER = "skip_cluster"


class CatchUp(enum.StrEnum):
    """What to do at start-up about ticks missed while every replica was down."""

    OFF = "off"
    LATEST = "latest"
    ALL = "all"


@dataclass(frozen=True, slots=True, kw_only=True)
class RunPolicy:
    """Per-schedule execution options (validated by the scheduler)."""

    exclusive: bool
    overlap: Overlap
    catch_up: CatchUp
    catch_up_window_ms: int
    retries: int
    retry_backoff_ms: int
    jitter_ms: int
    lease_ms: int
    heartbeat_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TickOutcome:
    """What happened to a tick on this process (for logs, tests and the demo)."""

    ran: bool
    succeeded: bool
    attempts: int


def _options(
    name: str, kind: ScheduleKind, policy: RunPolicy, run_key: str | None
) -> JobAcquireOptions:
    if kind is ScheduleKind.INITIAL:
        return JobAcquireOptions(
            code=name,
            type=JobSchedulerType.INITIAL,
            lease_ms=policy.lease_ms,
            heartbeat_ms=policy.heartbeat_ms,
        )
    return JobAcquireOptions(
        code=name, run_key=run_key, lease_ms=policy.lease_ms, heartbeat_ms=policy.heartbeat_ms
    )


class TickRunner:
    """Executes ticks of one scheduler.

    Args:
        jobs: The lease service, or ``None`` (every process runs every tick).
        logger: The scheduler's logger.
    """

    def __init__(self, jobs: BaseJobScheduler | None, logger: logging.Logger) -> None:
        self.jobs = jobs
        self.log = logger

    async def run(
        self,
        *,
        name: str,
        kind: ScheduleKind,
        handler: Handler,
        policy: RunPolicy,
        tick: Tick,
        deadline: datetime | None,
        clock: Callable[[], datetime],
    ) -> TickOutcome:
        """Run ``tick`` with its retries; never raises except ``CancelledError``.

        Args:
            name: Schedule name.
            kind: Schedule kind.
            handler: The user's function.
            policy: Execution options.
            tick: The tick.
            deadline: Retries never start at or after this instant (the next tick).
            clock: Wall clock (UTC).
        """
        if policy.jitter_ms:
            await asyncio.sleep(random.uniform(0, policy.jitter_ms) / 1000)  # noqa: S311
        if policy.overlap is Overlap.SKIP_CLUSTER and self.jobs is not None and policy.exclusive:
            return await self._guarded(
                name,
                policy,
                tick,
                self._attempts(
                    name=name,
                    kind=kind,
                    handler=handler,
                    policy=policy,
                    tick=tick,
                    deadline=deadline,
                    clock=clock,
                ),
            )
        return await self._attempts(
            name=name,
            kind=kind,
            handler=handler,
            policy=policy,
            tick=tick,
            deadline=deadline,
            clock=clock,
        )

    async def _guarded(
        self, name: str, policy: RunPolicy, tick: Tick, body: Awaitable[TickOutcome]
    ) -> TickOutcome:
        """Cluster-wide overlap guard: a second lease per schedule, released after the run."""
        assert self.jobs is not None  # noqa: S101
        jobs = self.jobs
        options = JobAcquireOptions(
            code=name,
            run_key=OVERLAP_GUARD_RUN_KEY,
            lease_ms=policy.lease_ms,
            heartbeat_ms=policy.heartbeat_ms,
        )
        try:
            guard = await jobs.acquire(options)
        except BaseException:
            if inspect.iscoroutine(body):
                body.close()
            raise
        if not guard.acquired:
            if inspect.iscoroutine(body):
                body.close()
            self.log.info(
                "schedule %r run %r: skipped, a previous run is still running in the cluster",
                name,
                tick.run_key,
                extra={"action": "tick_overlap_skipped", "schedule": name, "run_key": tick.run_key},
            )
            return TickOutcome(ran=False, succeeded=False, attempts=0)
        lease = guard.lease

        async def keep_alive() -> None:
            while options.heartbeat_ms:
                await asyncio.sleep(options.heartbeat_ms / 1000)
                try:
                    await jobs.heartbeat(lease)
                except JobSchedulerError:
                    self.log.warning("schedule %r: overlap guard heartbeat failed", name)

        beat = asyncio.create_task(keep_alive(), name=f"sdcore-overlap-guard:{name}")
        try:
            return await body
        finally:
            beat.cancel()
            await asyncio.wait({beat})
            try:
                await asyncio.shield(jobs.release(lease))
            except JobSchedulerError:
                self.log.warning("schedule %r: could not release the overlap guard", name)

    async def _attempts(
        self,
        *,
        name: str,
        kind: ScheduleKind,
        handler: Handler,
        policy: RunPolicy,
        tick: Tick,
        deadline: datetime | None,
        clock: Callable[[], datetime],
    ) -> TickOutcome:
        attempts = 0
        ran = False
        for attempt in range(1, policy.retries + 2):
            attempts = attempt
            current = replace(tick, attempt=attempt)
            try:
                executed = await self._attempt(name, kind, handler, policy, current)
            except asyncio.CancelledError:
                raise
            except LostJobLeaseError as exc:
                # Another replica may own the tick now; whatever it does is the tick's outcome.
                self._log_error("lease lost during the run", name, current, exc, "tick_lease_lost")
                return TickOutcome(ran=True, succeeded=False, attempts=attempt)
            except JobSchedulerError as exc:
                # Database down…: logged; the loop goes on, catch-up decides later.
                self._log_error("tick not run here", name, current, exc, "tick_not_run")
                executed = None
            except Exception as exc:  # noqa: BLE001 - a handler error must not kill the loop
                self._log_error("tick failed", name, current, exc, "tick_failed", trace=True)
                ran = True
                executed = None
            else:
                if executed:
                    return TickOutcome(ran=True, succeeded=True, attempts=attempt)
                if executed is False and (
                    policy.retries == 0 or await self._finished_elsewhere(name, kind, policy, tick)
                ):
                    return TickOutcome(ran=ran, succeeded=False, attempts=attempt)
            if attempt > policy.retries:
                break
            delay = policy.retry_backoff_ms * 2 ** (attempt - 1) / 1000
            if deadline is not None and clock() + timedelta(seconds=delay) >= deadline:
                self.log.log(
                    logging.INFO if ran else logging.DEBUG,
                    "schedule %r run %r: no retry, the next tick is due first",
                    name,
                    tick.run_key,
                    extra={"action": "retry_skipped", "schedule": name, "run_key": tick.run_key},
                )
                break
            await asyncio.sleep(delay)
        return TickOutcome(ran=ran, succeeded=False, attempts=attempts)

    async def _finished_elsewhere(
        self, name: str, kind: ScheduleKind, policy: RunPolicy, tick: Tick
    ) -> bool:
        """After losing the race: is the tick already done (no retry needed from here)?"""
        if self.jobs is None:
            return True
        key = _options(name, kind, policy, tick.run_key).lock_key
        try:
            status = (await self.jobs.statuses([key])).get(key)
        except JobSchedulerError:
            return False
        return status is JobSchedulerStatus.SUCCESS

    async def _attempt(
        self, name: str, kind: ScheduleKind, handler: Handler, policy: RunPolicy, tick: Tick
    ) -> bool | None:
        """Run once. ``True``: ran and succeeded; ``False``: another replica owns the tick."""
        if self.jobs is None or not policy.exclusive:
            await _call(handler, tick)
            return True
        options = _options(name, kind, policy, tick.run_key)

        def bind(lease: JobExecutionLease) -> Tick:
            return replace(tick, lease=lease)

        if inspect.iscoroutinefunction(handler):

            async def call(lease: JobExecutionLease) -> Any:
                return await handler(bind(lease))

            outcome = await self.jobs.run_exclusive(options, call)
        else:
            outcome = await self.jobs.run_exclusive(options, lambda lease: handler(bind(lease)))
        if not outcome.acquired:
            self.log.debug(
                "schedule %r run %r: owned or done by another replica",
                name,
                tick.run_key,
                extra={"action": "tick_skipped", "schedule": name, "run_key": tick.run_key},
            )
            return False
        return True

    def _log_error(
        self,
        what: str,
        name: str,
        tick: Tick,
        exc: BaseException,
        action: str,
        *,
        trace: bool = False,
    ) -> None:
        # Context "Scheduler", as NestJS logs it; identity strings with %r (log-injection safe).
        self.log.error(
            "Scheduler: schedule %r run %r (attempt %d): %s: %s: %s",
            name,
            tick.run_key,
            tick.attempt,
            what,
            type(exc).__name__,
            str(exc)[:500],
            exc_info=exc if trace else None,
            extra={
                "action": action,
                "schedule": name,
                "run_key": tick.run_key,
                "attempt": tick.attempt,
            },
        )


async def _call(handler: Handler, tick: Tick) -> Any:
    if inspect.iscoroutinefunction(handler):
        return await handler(tick)
    result = await asyncio.to_thread(handler, tick)
    if inspect.isawaitable(result):
        return await result
    return result


def utcnow() -> datetime:
    """The default wall clock (aware, UTC)."""
    return datetime.now(UTC)
