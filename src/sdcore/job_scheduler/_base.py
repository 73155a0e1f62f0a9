"""``run_exclusive`` and the contract shared by every backend (PostgreSQL, in-memory)."""

from __future__ import annotations

import abc
import asyncio
import contextvars
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar, cast, overload

from sdcore._internal.errors import error_text
from sdcore.job_scheduler._attempts import AttemptBudget, TickRecord
from sdcore.job_scheduler._model import (
    LEASE_SLACK_MS,
    JobAcquireResult,
    JobExecutionLease,
    JobLease,
    JobSchedulerStatus,
    JobSchedulerUnavailableError,
    LostJobLeaseError,
    RunExclusiveResult,
)
from sdcore.job_scheduler._options import JobAcquireOptions, coerce_batch, coerce_options

T = TypeVar("T")

RELEASED_DATA: Mapping[str, Any] = {"released": True}
SLACK = LEASE_SLACK_MS / 1000


async def _settle(aw: Awaitable[T]) -> tuple[T, bool]:
    """Await ``aw`` to the end even if the caller is cancelled meanwhile.

    Returns:
        The result, and whether a cancellation arrived (the caller must re-raise it).
    """
    task = asyncio.ensure_future(aw)
    cancelled = False
    while True:
        try:
            return await asyncio.shield(task), cancelled
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True


class BaseJobScheduler(abc.ABC):
    """The job scheduler contract; subclasses provide the four lease statements.

    Args:
        logger_name: Name of the logger used for run and heartbeat events.
    """

    def __init__(self, *, logger_name: str = "sdcore.job_scheduler") -> None:
        self._log = logging.getLogger(logger_name)

    @abc.abstractmethod
    async def acquire(self, options: JobAcquireOptions | Mapping[str, Any]) -> JobAcquireResult:
        """Try to become the owner of one logical run (see the contract)."""

    async def acquire_many(
        self, options: Sequence[JobAcquireOptions | Mapping[str, Any]]
    ) -> list[JobAcquireResult]:
        """``acquire`` for many runs: one result per item, in the input order.

        Every item is validated (and two items for one run refused) before any is acquired.
        This default acquires the items one after another; ``JobSchedulerService`` sends one
        statement for all of them.
        """
        return [await self.acquire(opts) for opts in coerce_batch(options)]

    @abc.abstractmethod
    async def heartbeat(self, lease: JobLease) -> bool:
        """Extend the lease by the database clock; ``False`` if ownership was lost."""

    @abc.abstractmethod
    async def complete(self, lease: JobLease, data: Mapping[str, Any] | None = None) -> bool:
        """Mark the run ``SUCCESS``; ``False`` if ownership was lost."""

    @abc.abstractmethod
    async def fail(self, lease: JobLease, data: Mapping[str, Any] | None = None) -> bool:
        """Mark the run ``FAIL`` so another replica may take it at once; ``False`` if lost."""

    @abc.abstractmethod
    async def statuses(self, lock_keys: Sequence[str]) -> dict[str, JobSchedulerStatus]:
        """Return the status of each run that has a row, by ``lock_key`` (missing: no row)."""

    @abc.abstractmethod
    async def status_of(self, lease: JobLease) -> JobSchedulerStatus | None:
        """Return the run's status if the row still carries this lease's token, else ``None``."""

    async def release(
        self, lease: JobLease, data: Mapping[str, Any] | None = RELEASED_DATA
    ) -> bool:
        """``fail`` with ``{"released": True}`` by default: the next ``acquire`` may take the row.

        Args:
            lease: The capability returned by ``acquire``.
            data: JSON object stored on the row.

        Returns:
            ``True`` if this owner released the row, ``False`` if ownership was already lost.
        """
        return await self.fail(lease, data)

    @overload
    async def run_exclusive(
        self,
        options: JobAcquireOptions | Mapping[str, Any],
        fn: Callable[[JobExecutionLease], Awaitable[T]],
    ) -> RunExclusiveResult[T]: ...

    @overload
    async def run_exclusive(
        self,
        options: JobAcquireOptions | Mapping[str, Any],
        fn: Callable[[JobExecutionLease], T],
    ) -> RunExclusiveResult[T]: ...

    async def run_exclusive(
        self,
        options: JobAcquireOptions | Mapping[str, Any],
        fn: Callable[[JobExecutionLease], Any],
    ) -> RunExclusiveResult[Any]:
        """Run ``fn`` on this replica only if it wins the run's lease.

        ``fn`` receives the :class:`JobExecutionLease`. An ``async`` function is awaited (and
        cancelled if ownership is lost); a plain function runs in a worker thread, and an
        awaitable it returns is awaited. While ``fn`` runs, a heartbeat extends the lease every
        ``heartbeat_ms``.

        ``fn`` starts only on a lease the database confirmed with at least half of it left (see
        :meth:`acquire`). From then on the lease holds on the client until its *client
        deadline*: when the last successful acquire or heartbeat was sent, plus ``lease_ms``
        less :data:`~sdcore.job_scheduler.LEASE_CLOCK_MARGIN`. A timer of its own fires at the
        deadline, whether or not a database call is hanging: an async ``fn`` is cancelled, a
        thread sees :attr:`~JobExecutionLease.is_held` turn ``False`` (and is waited for at most
        :data:`~sdcore.job_scheduler.LEASE_SLACK_MS` before ``run_exclusive`` raises without
        it). Heartbeats and the finalize are bounded by the lease's time left, so
        ``run_exclusive`` returns or raises at most ``LEASE_SLACK_MS`` after the client deadline
        (plus the time an async ``fn`` takes to unwind), and never reports success for a
        completion whose answer did not come back.

        Args:
            options: Identity and timing of the run.
            fn: The work.

        Returns:
            ``acquired=False`` (``fn`` not called) or ``acquired=True`` with ``fn``'s result.

        Raises:
            InvalidJobIdentityOptionsError: Bad identity, before any SQL.
            InvalidJobLeaseOptionsError: Bad timing, before any SQL.
            LostJobLeaseError: Ownership was lost (or ran out on the client) before the outcome
                was recorded.
            JobSchedulerUnavailableError: The database could not be reached to acquire.
            BaseException: Whatever ``fn`` raised (after the row was marked ``FAIL``).
        """
        opts = coerce_options(options)
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        outcome = await self.acquire(opts)
        if not outcome.acquired:
            return RunExclusiveResult(acquired=False, result=None)
        lease = outcome.lease
        if lease.time_left <= 0:
            # A backend that does not keep client deadlines cannot hand us an expired lease, but
            # one that answered too late must not start fn.
            await self._give_back(lease)
            return RunExclusiveResult(acquired=False, result=None)
        run = _Run(self, opts, lease)
        return RunExclusiveResult(acquired=True, result=await run.execute(fn))

    async def _give_back(self, lease: JobExecutionLease) -> None:
        task = asyncio.ensure_future(self.fail(lease, {"error": "acquire answered too late"}))
        done, _ = await asyncio.wait({task}, timeout=SLACK)
        if not done:
            task.add_done_callback(_consume)
        elif not task.cancelled() and task.exception() is not None:
            self._log.warning("could not give back a late lease: %s", task.exception())

    # --- scheduler tick operations (used by sdcore.scheduling; statements in _attempts.py) ---
    # The plain lease above keeps the seed's behaviour (a FAIL row is taken at once). These
    # operations add a per-tick attempt budget; a backend that lacks them cannot run schedules.

    async def acquire_attempt(
        self, options: JobAcquireOptions, budget: AttemptBudget
    ) -> tuple[JobAcquireResult, int]:
        """``acquire`` within an attempt budget (see :mod:`sdcore.job_scheduler._attempts`).

        Returns:
            The acquire result and the row's attempt number (0 when not acquired).
        """
        raise NotImplementedError(f"{type(self).__name__} has no attempt budget (acquire_attempt)")

    async def record_skipped(self, options: JobAcquireOptions, reason: str) -> bool:
        """Record a tick as skipped (a ``FAIL`` row, 0 attempts) unless it already has a row."""
        raise NotImplementedError(f"{type(self).__name__} cannot record skipped ticks")

    async def tick_records(self, lock_keys: Sequence[str]) -> dict[str, TickRecord]:
        """Return status, attempts and skip/release marks of each tick that has a row."""
        raise NotImplementedError(f"{type(self).__name__} cannot read tick records")

    async def first_seen(self, code: str) -> datetime | None:
        """Return when the first row of ``code`` still in the table was created, if any."""
        raise NotImplementedError(f"{type(self).__name__} cannot tell when a schedule first ran")

    async def run_attempt(
        self,
        options: JobAcquireOptions,
        fn: Callable[[JobExecutionLease, int], Any],
        budget: AttemptBudget,
    ) -> RunExclusiveResult[Any]:
        """``run_exclusive`` acquiring with :meth:`acquire_attempt`; ``fn`` gets the attempt too.

        Args:
            options: Identity and timing of the tick.
            fn: ``fn(lease, attempt)``: async (awaited) or plain (run in a worker thread).
            budget: The tick's attempt budget.

        Returns:
            ``acquired=False`` (``fn`` not called) or ``acquired=True`` with ``fn``'s result.
        """
        acquired = await self.acquire_attempt(options, budget)
        return await self.run_acquired_attempt(options, acquired, fn)

    async def acquire_attempts(
        self, items: Sequence[tuple[JobAcquireOptions, AttemptBudget]]
    ) -> list[tuple[JobAcquireResult, int]]:
        """:meth:`acquire_attempt` for many ticks: one result per item, in the order given.

        This default answers the items one after the other; ``JobSchedulerService`` answers
        them in one statement (the burst of ticks due at one instant). Each item is won, or
        not, exactly as by :meth:`acquire_attempt`. The lock keys must be distinct.

        Raises:
            ValueError: Two items for one lock key (before any SQL).
        """
        if len({options.lock_key for options, _ in items}) != len(items):
            raise ValueError("acquire_attempts: two items for one lock key")
        return [await self.acquire_attempt(options, budget) for options, budget in items]

    async def run_acquired_attempt(
        self,
        options: JobAcquireOptions,
        acquired: tuple[JobAcquireResult, int],
        fn: Callable[[JobExecutionLease, int], Any],
    ) -> RunExclusiveResult[Any]:
        """The run half of :meth:`run_attempt`, for an ``acquire_attempt(s)`` result.

        Args:
            options: The options the lease was acquired with.
            acquired: ``(result, attempt)`` as :meth:`acquire_attempt` returned it.
            fn: ``fn(lease, attempt)``: async (awaited) or plain (run in a worker thread).

        Returns:
            ``acquired=False`` (``fn`` not called) or ``acquired=True`` with ``fn``'s result.
        """
        outcome, attempt = acquired
        if not outcome.acquired:
            return RunExclusiveResult(acquired=False, result=None)
        if outcome.lease.time_left <= 0:
            await self._give_back(outcome.lease)
            return RunExclusiveResult(acquired=False, result=None)
        call: Callable[[JobExecutionLease], Any]
        if inspect.iscoroutinefunction(fn):

            async def call(lease: JobExecutionLease) -> Any:
                return await fn(lease, attempt)

        else:

            def call(lease: JobExecutionLease) -> Any:
                return fn(lease, attempt)

        run = _Run(self, options, outcome.lease)
        return RunExclusiveResult(acquired=True, result=await run.execute(call))


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve an abandoned call's outcome, so asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


class _Run:
    """One owned execution: the callable, its heartbeat, its deadline timer and its finalize."""

    def __init__(
        self,
        service: BaseJobScheduler,
        options: JobAcquireOptions,
        lease: JobExecutionLease,
    ) -> None:
        self.service = service
        self.options = options
        self.lease = lease
        self.state = lease._state
        self.loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None  # noqa: S101 - run_exclusive is always awaited in a task
        self.task = task
        self.timer: asyncio.TimerHandle | None = None
        self.cancellable = False
        self.cancel_requested = False
        # Why the last heartbeat did not confirm the lease (named in the loss at the deadline).
        self.beat_problem: str | None = None
        self.log_extra = {
            "job_id": lease.id,
            "job_code": options.code,
            "run_key": options.run_key,
            "idempotency_key": lease.idempotency_key,
            "fencing_token": lease.fencing_token,
        }

    async def execute(self, fn: Callable[[JobExecutionLease], Awaitable[T] | T]) -> T:
        beat = None
        if self.options.heartbeat_ms > 0:
            beat = asyncio.create_task(
                self._heartbeat(), name=f"sdcore-heartbeat:{self.options.code}"
            )
        self._arm(self.state.time_left())
        try:
            try:
                result = await self._call(fn)
            finally:
                # No await between fn's end and here: the heartbeat and the deadline timer
                # cannot cancel us any more.
                self.cancellable = False
                self._disarm()
        except asyncio.CancelledError as exc:
            await self._stop(beat)
            ours = self.cancel_requested and self.task.uncancel() == 0
            if ours:
                await self._finalize(self.service.fail, {"error": "lease lost; run cancelled"})
                raise self._lost_error() from exc
            self.state.mark_lost("run cancelled")
            await self._finalize(self.service.fail, {"error": "cancelled"})
            raise
        except BaseException as exc:
            await self._stop(beat)
            if self.cancel_requested:
                self.task.uncancel()
            recorded = await self._finalize(self.service.fail, {"error": error_text(exc)})
            self.service._log.warning(
                "job %r run %r failed: %s",
                self.options.code,
                self.options.run_key,
                error_text(exc)[:300],
                extra={"action": "run_failed", **self.log_extra},
            )
            if not recorded:
                raise self._lost_error() from exc
            raise
        await self._stop(beat)
        if self.cancel_requested:
            self.task.uncancel()
        # The callable may have completed the run itself, in its own transaction
        # (complete_in + outbox): that is success, not a loss.
        if (
            not await self._finalize(self.service.complete, None)
            and await self._owned_status() is not JobSchedulerStatus.SUCCESS
        ):
            raise self._lost_error()
        return result

    def _arm(self, delay: float) -> None:
        if delay != float("inf"):
            self.timer = self.loop.call_later(max(delay, 0.0), self._on_deadline)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _on_deadline(self) -> None:
        # Fired by the event loop at the client deadline, whatever the database calls are doing.
        self.timer = None
        left = self.state.time_left()
        if left > 0:  # a heartbeat moved the deadline meanwhile
            self._arm(left)
            return
        self._lose(
            f"the lease ran out on the client: {self.beat_problem}"
            if self.beat_problem
            else "the lease ran out on the client: no heartbeat confirmed it in time"
        )

    async def _owned_status(self) -> JobSchedulerStatus | None:
        try:
            status, cancelled = await _settle(self.service.status_of(self.lease))
        except JobSchedulerUnavailableError:
            return None
        if cancelled:
            self.task.cancel()
        return status

    def _lost_error(self) -> LostJobLeaseError:
        return LostJobLeaseError(self.lease.id, self.state.reason or "ownership was lost")

    async def _call(self, fn: Callable[[JobExecutionLease], Awaitable[T] | T]) -> T:
        if inspect.iscoroutinefunction(fn):
            self.cancellable = True
            return cast("T", await fn(self.lease))
        ctx = contextvars.copy_context()
        future = self.loop.run_in_executor(None, functools.partial(ctx.run, fn, self.lease))
        self.cancellable = True
        try:
            result = await asyncio.shield(future)
        except asyncio.CancelledError:
            # A thread cannot be stopped: tell it through the lease and wait, so that the row is
            # not released to another replica while this one still works. After a loss the row
            # is no longer ours to protect: wait for the thread only until the slack is used up.
            self.cancellable = False
            self.state.mark_lost("run cancelled")
            if self.cancel_requested:
                limit = max(self.state.time_left(), 0.0) + SLACK
                (done, _), _ = await _settle(asyncio.wait({future}, timeout=limit))
                if not done:
                    future.add_done_callback(_consume)
                    self.service._log.error(
                        "job %r run %r: the lease was lost and the thread still runs "
                        "(it should check lease.is_held)",
                        self.options.code,
                        self.options.run_key,
                        extra={"action": "thread_abandoned", **self.log_extra},
                    )
            else:
                await _settle(asyncio.wait({future}))
            raise
        self.cancellable = False
        if inspect.isawaitable(result):
            if self.state.lost:
                if inspect.iscoroutine(result):
                    result.close()
                raise self._lost_error()
            self.cancellable = True
            return cast("T", await result)
        return result

    async def _stop(self, beat: asyncio.Task[None] | None) -> None:
        if beat is None:
            return
        # The heartbeat never awaits a database call directly (see _heartbeat), so it ends at
        # once even when a statement hangs.
        beat.cancel()
        _, cancelled = await _settle(asyncio.wait({beat}))
        if cancelled:
            # Re-deliver the caller's cancellation after the heartbeat is gone.
            self.task.cancel()

    async def _finalize(
        self,
        method: Callable[[JobLease, Mapping[str, Any] | None], Awaitable[bool]],
        data: Mapping[str, Any] | None,
    ) -> bool:
        """Record the outcome; retry while the database is unreachable and the lease may hold."""
        delay = 0.05
        while True:
            try:
                ok, cancelled = await _settle(method(self.lease, data))
            except JobSchedulerUnavailableError as exc:
                if time.monotonic() + delay >= self.state.deadline:
                    self.state.mark_lost(
                        "the outcome could not be recorded before the lease expired"
                    )
                    self.service._log.error(
                        "job %r run %r: could not record the outcome: %s",
                        self.options.code,
                        self.options.run_key,
                        exc,
                        extra={"action": "finalize_failed", **self.log_extra},
                    )
                    return False
                self.service._log.warning(
                    "job %r run %r: finalize failed, retrying: %s",
                    self.options.code,
                    self.options.run_key,
                    exc,
                    extra={"action": "finalize_retry", **self.log_extra},
                )
                _, cancelled = await _settle(asyncio.sleep(delay))
                delay = min(delay * 2, 2.0)
                if cancelled:
                    self.task.cancel()
                continue
            if cancelled:
                self.task.cancel()
            if not ok:
                self.state.mark_lost(self.state.reason or "the row was reclaimed or released")
            return ok

    async def _heartbeat(self) -> None:
        interval = self.options.heartbeat_ms / 1000
        state = self.state
        confirmed = state.deadline - state.valid
        if confirmed != confirmed or confirmed == float("-inf"):  # no client deadline known
            confirmed = time.monotonic()
        due = confirmed + interval
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            sent = time.monotonic()
            lag = sent - due
            if lag > interval:
                self.service._log.warning(
                    "job %r run %r: heartbeat %.3f s late (event loop blocked?)",
                    self.options.code,
                    self.options.run_key,
                    lag,
                    extra={"action": "heartbeat_late", **self.log_extra},
                )
            # The call runs in a task of its own and is never cancelled from here: cancelling
            # a psycopg statement waits for the server (~10 s when the network is cut). The
            # backend bounds the statement; the deadline timer fires the loss meanwhile.
            call = asyncio.ensure_future(self.service.heartbeat(self.lease))
            self.beat_problem = "the database did not answer the heartbeat"
            try:
                done, _ = await asyncio.wait({call}, timeout=max(state.time_left(), 0.0))
            except asyncio.CancelledError:
                call.add_done_callback(_consume)
                raise
            if not done:
                call.add_done_callback(_consume)
                self._lose("the database did not answer the heartbeat within the lease")
                return
            try:
                ok = call.result()
            except (JobSchedulerUnavailableError, TimeoutError) as exc:
                self.beat_problem = "the database was unreachable for longer than the lease"
                if state.time_left() <= 0:
                    self._lose("the database was unreachable for longer than the lease")
                    return
                self.service._log.warning(
                    "job %r run %r: heartbeat failed, retrying: %s",
                    self.options.code,
                    self.options.run_key,
                    exc or type(exc).__name__,
                    extra={"action": "heartbeat_error", **self.log_extra},
                )
                due = time.monotonic() + min(interval, 1.0)
                continue
            except Exception as exc:  # noqa: BLE001 - never "Task exception was never retrieved"
                self.service._log.exception(
                    "job %r run %r: heartbeat error",
                    self.options.code,
                    self.options.run_key,
                    extra={"action": "heartbeat_error", **self.log_extra},
                )
                self.beat_problem = f"heartbeat kept failing: {error_text(exc)[:200]}"
                if state.time_left() <= 0:
                    self._lose(self.beat_problem)
                    return
                due = time.monotonic() + min(interval, 1.0)
                continue
            if not ok:
                self._lose("the heartbeat was refused: the row was reclaimed or released")
                return
            state.confirm(sent)
            self.beat_problem = None
            due = sent + interval

    def _lose(self, reason: str) -> None:
        if self.state.lost:
            return
        self.state.mark_lost(reason)
        self.service._log.warning(
            "job %r run %r: lease lost: %s",
            self.options.code,
            self.options.run_key,
            reason,
            extra={"action": "lease_lost", **self.log_extra},
        )
        if self.cancellable and not self.cancel_requested:
            self.cancel_requested = True
            self.task.cancel(msg="sdcore: job lease lost")
