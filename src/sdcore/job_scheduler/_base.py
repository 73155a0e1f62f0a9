"""The contract shared by every backend (PostgreSQL, in-memory), and ``run_exclusive``.

The run engine that executes a won run (heartbeat, deadline timer, finalize) is ``_run.py``.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar, overload

from sdcore._internal.telemetry import NOOP, Telemetry
from sdcore._internal.validation import non_empty_str
from sdcore.job_scheduler._attempts import (
    AttemptAcquireResult,
    AttemptBudget,
    TickRecord,
    given_back,
)
from sdcore.job_scheduler._model import (
    JobAcquireResult,
    JobExecutionLease,
    JobLease,
    JobSchedulerStatus,
    RunExclusiveResult,
)
from sdcore.job_scheduler._options import JobAcquireOptions, coerce_batch, coerce_options
from sdcore.job_scheduler._run import SLACK, _consume, _Run

T = TypeVar("T")

RELEASED_DATA: Mapping[str, Any] = {"released": True}  # release()'s default data (shown only)


class BaseJobScheduler(abc.ABC):
    """The job scheduler contract; subclasses provide the four lease statements.

    Args:
        logger_name: Name of the logger used for run and heartbeat events.
    """

    telemetry: Telemetry = NOOP  # observers of leases and heartbeats (sdcore.metrics)

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

    def finalize_soon(
        self,
        lease: JobLease,
        status: JobSchedulerStatus,
        data: Mapping[str, Any] | None = None,
    ) -> Awaitable[bool]:
        """Record the run's outcome: :meth:`complete` for ``SUCCESS``, :meth:`fail` for ``FAIL``.

        ``run_exclusive`` records every outcome through this. A backend may record it together
        with the others made meanwhile (``JobSchedulerService`` sends them in one statement)
        and return a future instead of a coroutine; either is awaited to its end.

        Returns:
            An awaitable of ``True`` if recorded, ``False`` if ownership was lost.

        Raises:
            ValueError: ``status`` is neither ``SUCCESS`` nor ``FAIL``.
        """
        if status is JobSchedulerStatus.SUCCESS:
            return self.complete(lease, data)
        if status is JobSchedulerStatus.FAIL:
            return self.fail(lease, data)
        raise ValueError(f"an outcome is SUCCESS or FAIL, got {status!r}")

    async def release(
        self, lease: JobLease, data: Mapping[str, Any] | None = RELEASED_DATA
    ) -> bool:
        """``fail`` marked *released*: the next ``acquire`` may take the row, and a scheduled
        tick's next acquire starts a new attempt budget.

        The mark is a column of its own (migration ``lease/0007``): ``data`` is stored as given
        and never read as lease state, so ``fail(lease, {"released": True})`` is an ordinary
        failure.

        Args:
            lease: The capability returned by ``acquire``.
            data: JSON object stored on the row.

        Returns:
            ``True`` if this owner released the row, ``False`` if ownership was already lost.
        """
        return await self._reopen(lease, data, released="owner")

    async def give_back(self, lease: JobLease, reason: str) -> bool:
        """``fail`` marked *given back*: the run was won but never started.

        A scheduled tick's next acquire (any replica's) takes the row at once, with the same
        attempt number: that attempt never ran. ``missed_ticks`` reports it as given back with
        ``reason``. ``data`` is ``{"given_back": reason}``, for operators reading the row only.

        Returns:
            ``True`` if this owner gave the row back, ``False`` if ownership was already lost.
        """
        non_empty_str("reason", reason)
        return await self._reopen(lease, given_back(reason), given_back=reason)

    async def _reopen(
        self,
        lease: JobLease,
        data: Mapping[str, Any] | None,
        *,
        released: str | None = None,
        given_back: str | None = None,
    ) -> bool:
        """``fail`` with a reopen mark (``released`` or ``given_back``). A backend without the
        marks records a plain failure (its tick acquire then follows the attempt budget)."""
        del released, given_back
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
        task = asyncio.ensure_future(self.give_back(lease, "acquire answered too late"))
        done, _ = await asyncio.wait({task}, timeout=SLACK)
        if not done:
            task.add_done_callback(_consume)
        elif not task.cancelled() and task.exception() is not None:
            self._log.warning("could not give back a late lease: %s", task.exception())

    # --- scheduler tick operations (used by sdcore.scheduling; statements in lease_ticks.sql) -
    # The plain lease above keeps the seed's behaviour (a FAIL row is taken at once). These
    # operations add a per-tick attempt budget; a backend that lacks them cannot run schedules.

    async def acquire_attempt(
        self, options: JobAcquireOptions, budget: AttemptBudget
    ) -> AttemptAcquireResult:
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

    async def first_seen_many(self, codes: Sequence[str]) -> dict[str, datetime]:
        """:meth:`first_seen` of each of ``codes`` that has a row (this default asks one code
        at a time; the PostgreSQL and in-memory backends answer in one call)."""
        seen: dict[str, datetime] = {}
        for code in dict.fromkeys(codes):
            first = await self.first_seen(code)
            if first is not None:
                seen[code] = first
        return seen

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
    ) -> list[AttemptAcquireResult]:
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
        acquired: AttemptAcquireResult,
        fn: Callable[[JobExecutionLease, int], Any],
    ) -> RunExclusiveResult[Any]:
        """The run half of :meth:`run_attempt`, for an ``acquire_attempt(s)`` result.

        Args:
            options: The options the lease was acquired with.
            acquired: What :meth:`acquire_attempt` returned.
            fn: ``fn(lease, attempt)``: async (awaited) or plain (run in a worker thread).

        Returns:
            ``acquired=False`` (``fn`` not called) or ``acquired=True`` with ``fn``'s result.
        """
        outcome, attempt = acquired.result, acquired.attempt
        if not outcome.acquired:
            return RunExclusiveResult(acquired=False, result=None)
        if outcome.lease.time_left <= 0:
            await self._give_back(outcome.lease)
            return RunExclusiveResult(acquired=False, result=None)
        run = _Run(self, options, outcome.lease)
        return RunExclusiveResult(acquired=True, result=await run.execute(fn, attempt))
