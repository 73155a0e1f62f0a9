"""Running one tick: the lease and its attempt budget, the cluster overlap guard, retries, logs.

Nothing here raises into the timer loop except ``CancelledError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from sdcore._internal.telemetry import (
    FAILURE,
    LOST_LEASE,
    NOOP,
    SUCCESS,
    RunScope,
    Telemetry,
)
from sdcore.job_scheduler import (
    AttemptAcquireResult,
    BaseJobScheduler,
    JobAcquireOptions,
    JobExecutionLease,
    JobSchedulerError,
    JobSchedulerStatus,
    JobSchedulerType,
    LostJobLeaseError,
)
from sdcore.scheduling._batch import TickAcquirer
from sdcore.scheduling._guard import TickOutcome, run_guarded
from sdcore.scheduling._policy import CatchUp, Overlap, RunPolicy, current_path
from sdcore.scheduling._triggers import ScheduleKind, Tick

__all__ = [
    "CatchUp",
    "Deadline",
    "Handler",
    "Overlap",
    "RunPolicy",
    "TickOutcome",
    "TickRunner",
    "utcnow",
]

Handler = Callable[[Tick], Awaitable[Any] | Any]
# The control gate's answer when this process cannot tell whether the schedule is paused (its
# view of the control plane is older than the propagation bound): no tick starts on it.
GATE_UNKNOWN = "unknown"
# When retries stop: the next tick's instant, or a function computing it on first use.
Deadline = datetime | None | Callable[[], datetime | None]


@dataclass(frozen=True, slots=True)
class FirstOffer:
    """A tick's first offer, acquired before its task started (batch start)."""

    options: JobAcquireOptions
    answer: AttemptAcquireResult | Exception
    """What ``acquire_attempt`` returned, or what the acquire raised."""


def tick_options(
    name: str, kind: ScheduleKind, policy: RunPolicy, run_key: str | None
) -> JobAcquireOptions:
    """The lease identity and timing of a tick."""
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

    telemetry: Telemetry = NOOP  # observers of ticks (sdcore.metrics, sdcore.tracing)
    # Why the tick running in this task must not start another attempt now ("paused", or
    # "unknown" when the paused state could not be read again before the given instant), or
    # None; set by the supervisor (the control plane's gate, for the paths it applies to).
    held: Callable[[str, datetime | None], Awaitable[str | None]] | None = None
    # The same gate read at once (no waiting), for a lease just won: why its handler must not
    # start ("paused", "unknown"), or None.
    admits: Callable[[str], str | None] | None = None

    def __init__(self, jobs: BaseJobScheduler | None, logger: logging.Logger) -> None:
        self.jobs = jobs
        self.log = logger
        self.acquirer = None if jobs is None else TickAcquirer(jobs, logger)
        # Exclusive ticks whose handler is executing now, or that wait out their jitter or a
        # retry backoff, by schedule (the overlap policy tells such a run from one waiting on
        # the database).
        self.in_handler = HandlerCount()

    def acquires_first(self, policy: RunPolicy) -> bool:
        """Whether a regular fire of a schedule with ``policy`` may be acquired before its task
        exists (batch start): an exclusive tick that starts with its lease (no jitter, no
        cluster overlap guard before it)."""
        return (
            self.jobs is not None
            and policy.exclusive
            and not policy.jitter_ms
            and policy.overlap is not Overlap.SKIP_CLUSTER
        )

    def runs_plain(self, policy: RunPolicy) -> bool:
        """Whether a tick with ``policy`` is one call of its handler here (:meth:`run_plain`):
        not exclusive, no retries, no jitter."""
        return (self.jobs is None or not policy.exclusive) and not (
            policy.retries or policy.jitter_ms
        )

    async def run_plain(self, name: str, handler: Handler, tick: Tick) -> TickOutcome:
        """:meth:`run` for a tick :meth:`runs_plain` accepts, in one frame (the burst path).

        Never raises except ``CancelledError``.
        """
        if self._gate_reason(name) is not None:
            return _NOT_STARTED  # paused since it was admitted
        if tick.attempt != 1:
            tick = replace(tick, attempt=1)
        telemetry = self.telemetry
        run = telemetry.tick_scope(name)
        if run is not None:
            run.path = current_path()
        telemetry.tick_started(run, tick)
        try:
            if inspect.iscoroutinefunction(handler):
                await handler(tick)
            else:
                await _call(handler, tick)
        except asyncio.CancelledError:
            telemetry.tick_finished(run, FAILURE)
            raise
        except Exception as exc:  # noqa: BLE001 - the tick failed; logged, never raised
            telemetry.tick_finished(run, FAILURE)
            self._log_error("tick failed", name, tick, exc, "tick_failed", trace=True)
            return _FAILED_ONCE
        telemetry.tick_finished(run, SUCCESS)
        return _SUCCEEDED_ONCE

    def ends_lost(self, name: str, policy: RunPolicy, tick: Tick, first: FirstOffer) -> bool:
        """Whether ``first`` (a lost first offer) is the whole of the tick on this process: the
        tick needs no task (no retry offers follow, as in :meth:`run`)."""
        answer = first.answer
        if isinstance(answer, Exception) or answer.result.acquired or policy.retries:
            return False
        if self.log.isEnabledFor(logging.DEBUG):
            self._log_not_ours(name, tick)
        return True

    def run(
        self,
        *,
        name: str,
        kind: ScheduleKind,
        handler: Handler,
        policy: RunPolicy,
        tick: Tick,
        deadline: Deadline,
        clock: Callable[[], datetime],
        record_skip: bool = True,
        first: FirstOffer | None = None,
    ) -> Coroutine[Any, Any, TickOutcome]:
        """The coroutine that runs ``tick`` within its attempt budget; it never raises except
        ``CancelledError``. (Without jitter or cluster guard it is the attempts' coroutine
        itself, not a wrapper around it.)

        Args:
            name: Schedule name.
            kind: Schedule kind.
            handler: The user's function.
            policy: Execution options.
            tick: The tick.
            deadline: Retries never start at or after this instant (the next tick), or a
                function returning it (computed once the burst it belongs to has started).
            clock: Wall clock (UTC).
            record_skip: Record the tick as skipped if the cluster overlap guard refuses it
                (a regular fire; a catch-up start stays pending instead).
            first: The answer to the first offer, acquired before this task started (batch
                start; only for ticks :meth:`acquires_first` accepts).
        """
        guarded = (
            policy.overlap is Overlap.SKIP_CLUSTER and self.jobs is not None and policy.exclusive
        )
        if not (policy.jitter_ms or guarded):
            return self._attempts(name, kind, handler, policy, tick, deadline, clock, first)
        return self._run_later(
            name, kind, handler, policy, tick, deadline, clock, record_skip, guarded=guarded
        )

    async def _run_later(
        self,
        name: str,
        kind: ScheduleKind,
        handler: Handler,
        policy: RunPolicy,
        tick: Tick,
        deadline: Deadline,
        clock: Callable[[], datetime],
        record_skip: bool,
        *,
        guarded: bool,
    ) -> TickOutcome:
        """:meth:`run` after the jitter, behind the cluster overlap guard if ``guarded``."""
        if policy.jitter_ms:
            # Waiting out its jitter, the tick is running as far as the overlap policy goes (a
            # fire meanwhile is an overlap, not a run waiting on the database).
            self.in_handler.enter(name)
            try:
                await asyncio.sleep(random.uniform(0, policy.jitter_ms) / 1000)  # noqa: S311
            finally:
                self.in_handler.leave(name)
            # Admitted before the jitter: a pause applied during it holds this tick too.
            if self.held is not None:
                limit = deadline() if callable(deadline) else deadline
                reason = await self.held(name, limit)
                if reason == GATE_UNKNOWN:
                    # Not a skip on purpose: without a row it is a missed tick, which the
                    # catch-up policy decides about once the paused state is known again.
                    self._log_held("not started after its jitter", name, tick, reason, "tick_held")
                    return TickOutcome(ran=False, succeeded=False, attempts=0)
                if reason is not None:
                    self._log_held("skipped after its jitter", name, tick, reason, "tick_held")
                    if record_skip:
                        await self.record_skipped(name, kind, policy, tick, reason)
                    return TickOutcome(ran=False, succeeded=False, attempts=0)

        if guarded:

            def body() -> Awaitable[TickOutcome]:
                return self._attempts(name, kind, handler, policy, tick, deadline, clock)

            return await run_guarded(self, name, kind, policy, tick, body, record_skip)
        return await self._attempts(name, kind, handler, policy, tick, deadline, clock)

    async def record_skipped(
        self,
        name: str,
        kind: ScheduleKind,
        policy: RunPolicy,
        tick: Tick,
        reason: str,
        *,
        outcome: str | None = None,
    ) -> None:
        """Record an exclusive tick as skipped on purpose, unless it already has a row.

        ``outcome`` (a ``skipped_*`` telemetry outcome) counts the skip: an exclusive tick's skip
        only on the replica whose row was written, so the per-replica counters add up to the
        cluster's skips (every replica fires a paused tick; a tick another replica runs is no
        skip). A tick that is not exclusive fires on every replica: each counts its own skip.
        """
        if self.jobs is None or not policy.exclusive or kind is ScheduleKind.INITIAL:
            if outcome is not None:
                self.telemetry.tick_skipped(name, outcome)
            return
        try:
            written = await self.jobs.record_skipped(
                tick_options(name, kind, policy, tick.run_key), reason
            )
        except JobSchedulerError as exc:
            self._log_error("could not record the skip", name, tick, exc, "skip_not_recorded")
            written = True  # unknown whether another replica recorded it: counted, not lost
        if written and outcome is not None:
            self.telemetry.tick_skipped(name, outcome)

    async def _attempts(
        self,
        name: str,
        kind: ScheduleKind,
        handler: Handler,
        policy: RunPolicy,
        tick: Tick,
        deadline: Deadline,
        clock: Callable[[], datetime],
        first: FirstOffer | None = None,
    ) -> TickOutcome:
        ran = False
        attempt = 0
        # Local tries: each is an attempt *offer*; the row's budget decides whether it runs.
        for local in range(1, 2 * policy.retries + 2):
            ran_now = False
            run = self.telemetry.tick_scope(name)
            if run is not None:
                run.path = current_path()
            try:
                offer = tick if local == tick.attempt else replace(tick, attempt=local)
                # A lease just won waits at most this long for a paused state it cannot read: half
                # its lease, and never past the next tick.
                limit = deadline() if callable(deadline) else deadline
                wait_until = clock() + timedelta(milliseconds=policy.lease_ms / 2)
                if limit is not None and limit < wait_until:
                    wait_until = limit
                attempt, executed = await self._attempt(
                    name,
                    kind,
                    handler,
                    policy,
                    offer,
                    run,
                    first if local == 1 else None,
                    wait_until,
                )
            except asyncio.CancelledError:
                self.telemetry.tick_finished(run, FAILURE)
                raise
            except _Gated:
                break  # given back unstarted; the resume's catch-up policy decides about it
            except LostJobLeaseError as exc:
                self.telemetry.tick_finished(run, LOST_LEASE)
                # Another replica may own the tick now; whatever it does is the tick's outcome.
                self._log_error("lease lost during the run", name, tick, exc, "tick_lease_lost")
                return TickOutcome(ran=True, succeeded=False, attempts=attempt)
            except _HandlerFailed as failed:
                self.telemetry.tick_finished(run, FAILURE)
                attempt = failed.attempt
                current = replace(tick, attempt=attempt)
                self._log_error(
                    "tick failed", name, current, failed.error, "tick_failed", trace=True
                )
                ran = ran_now = True
                executed = None
            except JobSchedulerError as exc:
                # Database down…: logged; the loop goes on, catch-up decides later.
                self.telemetry.tick_finished(run, FAILURE)
                self._log_error("tick not run here", name, tick, exc, "tick_not_run")
                executed = None
            except Exception as exc:  # noqa: BLE001 - a job scheduler's bug, not the handler's
                # Raised by the lease calls themselves (a custom job scheduler that raises
                # something other than JobSchedulerError): as a database error, with its trace.
                self.telemetry.tick_finished(run, FAILURE)
                self._log_error("tick not run here", name, tick, exc, "tick_not_run", trace=True)
                executed = None
            if executed:
                self.telemetry.tick_finished(run, SUCCESS)
                return TickOutcome(ran=True, succeeded=True, attempts=attempt)
            if policy.retries == 0 or local > 2 * policy.retries:
                break
            failed_here = executed is None and ran_now
            wait = await self._retry_wait(name, kind, policy, tick, attempt, failed_here)
            if wait is None:
                break
            limit = deadline() if callable(deadline) else deadline
            if limit is not None and clock() + timedelta(seconds=wait) >= limit:
                self.log.log(
                    logging.INFO if ran else logging.DEBUG,
                    "schedule %r run %r: no retry, the next tick is due first",
                    name,
                    tick.run_key,
                    extra={"action": "retry_skipped", "schedule": name, "run_key": tick.run_key},
                )
                break
            # Waiting out its backoff, the run is still a run of the schedule here (not one that
            # waits on the database): a fire meanwhile is an overlap, as during its handler.
            self.in_handler.enter(name)
            try:
                await asyncio.sleep(wait)
            finally:
                self.in_handler.leave(name)
            # Each retry is a new start: a pause applied since the last attempt ends the tick
            # here (its row keeps the attempts left; resume's catch-up decides about it). A
            # process that slept through the backoff reads the paused state again first.
            reason = None if self.held is None else await self.held(name, limit)
            if reason is not None:
                self._log_held("no retry", name, tick, reason, "retry_held")
                break
        return TickOutcome(ran=ran, succeeded=False, attempts=attempt)

    def _log_held(self, what: str, name: str, tick: Tick, reason: str, action: str) -> None:
        self.log.info(
            "schedule %r run %r: %s, %s",
            name,
            tick.run_key,
            what,
            "its paused state could not be read again in time"
            if reason == GATE_UNKNOWN
            else f"the schedule is {reason}",
            extra={"action": action, "schedule": name, "run_key": tick.run_key, "reason": reason},
        )

    async def _retry_wait(
        self,
        name: str,
        kind: ScheduleKind,
        policy: RunPolicy,
        tick: Tick,
        attempt: int,
        failed_here: bool,
    ) -> float | None:
        """Seconds until the next offer, or ``None`` when the tick needs nothing more from us.

        The row's budget decides who may run the next attempt; this only decides when to ask.
        Replicas offer it when the backoff ends by the database clock; the replica whose attempt
        just failed asks a little later, so that another replica usually runs the retry (a tick
        failing because of one bad replica gets completed by a good one).
        """
        if self.jobs is None or not policy.exclusive:
            return policy.backoff_s(attempt) if 0 < attempt <= policy.retries else None
        key = tick_options(name, kind, policy, tick.run_key).lock_key
        try:
            record = (await self.jobs.tick_records([key])).get(key)
        except JobSchedulerError:
            return policy.backoff_s(max(attempt, 1))
        if record is None:
            return policy.backoff_s(1)
        if record.status is JobSchedulerStatus.SUCCESS:
            return None
        if record.status is JobSchedulerStatus.RUNNING:
            return policy.backoff_s(max(record.attempts, 1))
        if record.released or record.given_back:
            return 0.0
        if record.attempts >= policy.retries + 1:
            return None
        backoff = policy.backoff_s(record.attempts) if record.attempts else 0.0
        wait = max(0.0, backoff - record.age_ms / 1000) + 0.01
        if failed_here:
            wait += min(backoff / 4, 0.5) + 0.05
        return wait

    async def _attempt(
        self,
        name: str,
        kind: ScheduleKind,
        handler: Handler,
        policy: RunPolicy,
        tick: Tick,
        run: RunScope | None = None,
        first: FirstOffer | None = None,
        wait_until: datetime | None = None,
    ) -> tuple[int, bool]:
        """Offer one attempt. Returns ``(attempt, ran_and_succeeded)``; ``False``: not ours.

        ``wait_until``: how long a lease just won may wait for a paused state this replica
        cannot read now (``None``: it does not wait).

        Raises:
            _HandlerFailed: The handler raised (the row is ``FAIL``).
        """
        if self.jobs is None or not policy.exclusive:
            self._unless_gated(name, tick)
            self.telemetry.tick_started(run, tick)
            try:
                if inspect.iscoroutinefunction(handler):
                    await handler(tick)  # no frame of its own: the burst path of plain ticks
                else:
                    await _call(handler, tick)
            except Exception as exc:
                raise _HandlerFailed(tick.attempt, exc) from exc
            return tick.attempt, True
        options = tick_options(name, kind, policy, tick.run_key) if first is None else first.options
        bound = _Bound(handler, tick, run, self.telemetry, self.in_handler)
        threaded = not inspect.iscoroutinefunction(handler)
        call = bound.run_sync if threaded else bound.run_async
        if first is None:
            assert self.acquirer is not None  # noqa: S101 - set with jobs
            acquired = await self.acquirer.acquire(options, policy.budget)
        elif isinstance(first.answer, Exception):
            # Every tick of a failed batch call holds this one exception. Raised as it is, each
            # tick's raise would add its frames to the traceback all of them share: a burst of N
            # ticks grows it to 2N frames, keeps every tick's frames alive, and an error that
            # ends the tasks prints all of it once per task. Each raise starts afresh (the
            # database error it wraps keeps its own traceback as ``__cause__``).
            raise first.answer.with_traceback(None)
        else:
            acquired = first.answer
        if acquired.result.acquired and self.admits is not None:
            # The gate admitted the tick before its acquire, which may have waited (a slow or
            # locked database, a suspended process): a pause this
            # replica applied meanwhile must hold the tick, as it holds a retry.
            reason = self.admits(name)
            if reason == GATE_UNKNOWN and self.held is not None and wait_until is not None:
                # A view gone stale under load (a burst keeps the loop from its poll) is read
                # again within a poll interval: the lease is held meanwhile, since every other
                # replica that asks for this tick has asked already, and a tick given back now
                # would wait for catch-up (or, with catch-up off, never run).
                reason = await self.held(name, wait_until)
            if reason is not None:
                await self._give_back(name, tick, acquired.result.lease, reason)
                return 0, False
        if threaded and acquired.result.acquired:
            # From the lease won, not from the thread's start: a worker thread may wait for a
            # free executor slot, and a fire meanwhile is an overlap of the schedule with itself,
            # not a tick that waits on the database.
            bound.hold()
        try:
            outcome = await self.jobs.run_acquired_attempt(options, acquired, call)
        except (asyncio.CancelledError, JobSchedulerError):
            raise
        except Exception as exc:
            raise _HandlerFailed(bound.attempt, exc) from exc
        finally:
            bound.release()  # the thread never started, or the run ended without waiting for it
        if not outcome.acquired:
            if self.log.isEnabledFor(logging.DEBUG):
                self._log_not_ours(name, tick)
            return 0, False
        return bound.attempt, True

    async def _give_back(
        self, name: str, tick: Tick, lease: JobExecutionLease, reason: str
    ) -> None:
        """Give a lease just won back unstarted (the row is reopened: catch-up and resume see it
        as a tick that never ran)."""
        assert self.jobs is not None  # noqa: S101 - only exclusive ticks hold a lease
        text = "paused state unknown" if reason == GATE_UNKNOWN else reason
        self._log_held("won but not started", name, tick, reason, "tick_held")
        try:
            await self.jobs.give_back(lease, text)
        except JobSchedulerError as exc:
            # The lease expires by itself; the tick is then a missed one.
            self._log_error("could not give the tick back", name, tick, exc, "give_back_failed")

    def _unless_gated(self, name: str, tick: Tick) -> None:
        """Do not start a tick that holds no lease (a schedule run on every replica) if the gate
        now says no: a pause this replica applied since the tick was admitted.

        Raises:
            _Gated: Not started; the tick makes no further offer here.
        """
        reason = self._gate_reason(name)
        if reason is not None:
            self._log_held("admitted but not started", name, tick, reason, "tick_held")
            raise _Gated

    def _gate_reason(self, name: str) -> str | None:
        """Why the gate says no to this tick now (``None``: it may start); see ``admits``."""
        return None if self.admits is None else self.admits(name)

    def _log_not_ours(self, name: str, tick: Tick) -> None:
        self.log.debug(
            "schedule %r run %r: owned, done or out of attempts elsewhere",
            name,
            tick.run_key,
            extra={"action": "tick_skipped", "schedule": name, "run_key": tick.run_key},
        )

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


class HandlerCount:
    """How many handlers of each schedule execute now (a tick waiting out its jitter or a retry
    backoff counts as one); updated and read on the loop only."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def enter(self, name: str) -> None:
        self._counts[name] = self._counts.get(name, 0) + 1

    def leave(self, name: str) -> None:
        left = self._counts.get(name, 1) - 1
        if left:
            self._counts[name] = left
        else:
            self._counts.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._counts


class _Bound:
    """A tick's handler, called with the tick bound to the lease and attempt it runs under.

    It counts in ``busy`` while it executes. An async handler enters and leaves around its
    call. A plain function is held on the loop before its worker thread is asked to start
    (:meth:`hold`) and released on the loop once it returns (:meth:`release`, idempotent):
    the count only ever changes on the loop.
    """

    __slots__ = ("attempt", "busy", "handler", "holding", "loop", "run", "telemetry", "tick")

    def __init__(
        self,
        handler: Handler,
        tick: Tick,
        run: RunScope | None,
        telemetry: Telemetry,
        busy: HandlerCount,
    ) -> None:
        self.handler = handler
        self.tick = tick
        self.run = run
        self.telemetry = telemetry
        self.busy = busy
        self.attempt = 0  # the attempt number, once the lease is won
        self.holding = False
        self.loop: asyncio.AbstractEventLoop | None = None

    def _bind(self, lease: JobExecutionLease, attempt: int) -> Tick:
        self.attempt = attempt
        tick = self.tick
        bound = Tick(
            schedule=tick.schedule,
            scheduled_at=tick.scheduled_at,
            local_time=tick.local_time,
            run_key=tick.run_key,
            lease=lease,
            attempt=attempt,
        )
        self.telemetry.tick_started(self.run, bound)
        return bound

    async def run_async(self, lease: JobExecutionLease, attempt: int) -> Any:
        name = self.tick.schedule
        self.busy.enter(name)
        try:
            return await self.handler(self._bind(lease, attempt))
        finally:
            self.busy.leave(name)

    def hold(self) -> None:
        """Count the plain function as executing from now (on the loop)."""
        self.loop = asyncio.get_running_loop()
        self.holding = True
        self.busy.enter(self.tick.schedule)

    def release(self) -> None:
        """Stop counting it, once (on the loop)."""
        if self.holding:
            self.holding = False
            self.busy.leave(self.tick.schedule)

    def run_sync(self, lease: JobExecutionLease, attempt: int) -> Any:
        # Run in a worker thread by run_acquired_attempt, which, if the lease is lost, waits for
        # the thread (it cannot be stopped) before releasing the row.
        try:
            return self.handler(self._bind(lease, attempt))
        finally:
            loop = self.loop
            if loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop has closed meanwhile
                    loop.call_soon_threadsafe(self.release)


_SUCCEEDED_ONCE = TickOutcome(ran=True, succeeded=True, attempts=1)
_FAILED_ONCE = TickOutcome(ran=True, succeeded=False, attempts=1)
_NOT_STARTED = TickOutcome(ran=False, succeeded=False, attempts=0)


class _Gated(Exception):
    """The tick's lease was given back unstarted: its schedule's gate said no."""


class _HandlerFailed(Exception):
    def __init__(self, attempt: int, error: BaseException) -> None:
        self.attempt = attempt
        self.error = error
        super().__init__(str(error))


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
