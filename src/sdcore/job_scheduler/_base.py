"""``run_exclusive`` and the contract shared by every backend (PostgreSQL, in-memory)."""

from __future__ import annotations

import abc
import asyncio
import contextvars
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar, cast, overload

from sdcore.job_scheduler._attempts import AttemptBudget, TickRecord
from sdcore.job_scheduler._model import (
    JobAcquireResult,
    JobExecutionLease,
    JobLease,
    JobSchedulerStatus,
    JobSchedulerUnavailableError,
    LostJobLeaseError,
    RunExclusiveResult,
)
from sdcore.job_scheduler._options import JobAcquireOptions, coerce_options

T = TypeVar("T")

RELEASED_DATA: Mapping[str, Any] = {"released": True}
MAX_ERROR_TEXT = 4096


def error_text(exc: BaseException) -> str:
    """Return a bounded, jsonb-safe text of an exception (type and message)."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the failure
        message = "<unprintable message>"
    text = f"{type(exc).__qualname__}: {message}" if message else type(exc).__qualname__
    text = text.replace("\x00", "\\x00")
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > MAX_ERROR_TEXT:
        text = text[: MAX_ERROR_TEXT - 1] + "…"
    return text


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

        Args:
            options: Identity and timing of the run.
            fn: The work.

        Returns:
            ``acquired=False`` (``fn`` not called) or ``acquired=True`` with ``fn``'s result.

        Raises:
            InvalidJobIdentityOptionsError: Bad identity, before any SQL.
            InvalidJobLeaseOptionsError: Bad timing, before any SQL.
            LostJobLeaseError: Ownership was lost before the outcome was recorded.
            JobSchedulerUnavailableError: The database could not be reached to acquire.
            BaseException: Whatever ``fn`` raised (after the row was marked ``FAIL``).
        """
        opts = coerce_options(options)
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        outcome = await self.acquire(opts)
        if not outcome.acquired:
            return RunExclusiveResult(acquired=False, result=None)
        run = _Run(self, opts, outcome.lease, sent_at)
        return RunExclusiveResult(acquired=True, result=await run.execute(fn))

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
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        outcome, attempt = await self.acquire_attempt(options, budget)
        if not outcome.acquired:
            return RunExclusiveResult(acquired=False, result=None)
        call: Callable[[JobExecutionLease], Any]
        if inspect.iscoroutinefunction(fn):

            async def call(lease: JobExecutionLease) -> Any:
                return await fn(lease, attempt)

        else:

            def call(lease: JobExecutionLease) -> Any:
                return fn(lease, attempt)

        run = _Run(self, options, outcome.lease, sent_at)
        return RunExclusiveResult(acquired=True, result=await run.execute(call))


class _Run:
    """One owned execution: the callable, its heartbeat and its finalize."""

    def __init__(
        self,
        service: BaseJobScheduler,
        options: JobAcquireOptions,
        lease: JobExecutionLease,
        sent_at: float,
    ) -> None:
        self.service = service
        self.options = options
        self.lease = lease
        self.loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None  # noqa: S101 - run_exclusive is always awaited in a task
        self.task = task
        # Conservative: the database wrote modified_at after we sent the statement.
        self.confirmed_at = sent_at
        self.cancellable = False
        self.cancel_requested = False
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
        try:
            try:
                result = await self._call(fn)
            finally:
                # No await between fn's end and here: the heartbeat cannot cancel us any more.
                self.cancellable = False
        except asyncio.CancelledError as exc:
            await self._stop(beat)
            ours = self.cancel_requested and self.task.uncancel() == 0
            if ours:
                await self._finalize(self.service.fail, {"error": "lease lost; run cancelled"})
                raise self._lost_error() from exc
            self.lease._state.mark_lost("run cancelled")
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

    async def _owned_status(self) -> JobSchedulerStatus | None:
        try:
            status, cancelled = await _settle(self.service.status_of(self.lease))
        except JobSchedulerUnavailableError:
            return None
        if cancelled:
            self.task.cancel()
        return status

    def _lost_error(self) -> LostJobLeaseError:
        return LostJobLeaseError(self.lease.id, self.lease._state.reason or "ownership was lost")

    async def _call(self, fn: Callable[[JobExecutionLease], Awaitable[T] | T]) -> T:
        if inspect.iscoroutinefunction(fn):
            self.cancellable = True
            return cast("T", await fn(self.lease))
        ctx = contextvars.copy_context()
        future = self.loop.run_in_executor(None, functools.partial(ctx.run, fn, self.lease))
        try:
            result = await asyncio.shield(future)
        except asyncio.CancelledError:
            # A thread cannot be stopped: tell it through the lease and wait, so that the row is
            # not released to another replica while this one still works.
            self.lease._state.mark_lost("run cancelled")
            await _settle(asyncio.wait({future}))
            raise
        if inspect.isawaitable(result):
            if self.lease._state.lost:
                if inspect.iscoroutine(result):
                    result.close()
                raise self._lost_error()
            self.cancellable = True
            return cast("T", await result)
        return result

    async def _stop(self, beat: asyncio.Task[None] | None) -> None:
        if beat is None:
            return
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
        deadline = self.confirmed_at + self.options.lease_ms / 1000
        delay = 0.05
        while True:
            try:
                ok, cancelled = await _settle(method(self.lease, data))
            except JobSchedulerUnavailableError as exc:
                if self.loop.time() + delay >= deadline:
                    self.lease._state.mark_lost(
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
                self.lease._state.mark_lost(
                    self.lease._state.reason or "the row was reclaimed or released"
                )
            return ok

    async def _heartbeat(self) -> None:
        interval = self.options.heartbeat_ms / 1000
        lease_s = self.options.lease_ms / 1000
        timeout = max(interval, 0.2)
        due = self.confirmed_at + interval
        while True:
            await asyncio.sleep(max(0.0, due - self.loop.time()))
            sent = self.loop.time()
            lag = sent - due
            if lag > interval:
                self.service._log.warning(
                    "job %r run %r: heartbeat %.3f s late (event loop blocked?)",
                    self.options.code,
                    self.options.run_key,
                    lag,
                    extra={"action": "heartbeat_late", **self.log_extra},
                )
            try:
                async with asyncio.timeout(timeout):
                    ok = await self.service.heartbeat(self.lease)
            except (JobSchedulerUnavailableError, TimeoutError) as exc:
                if self.loop.time() - self.confirmed_at >= lease_s:
                    self._lose("the database was unreachable for longer than the lease")
                    return
                self.service._log.warning(
                    "job %r run %r: heartbeat failed, retrying: %s",
                    self.options.code,
                    self.options.run_key,
                    exc or type(exc).__name__,
                    extra={"action": "heartbeat_error", **self.log_extra},
                )
                due = self.loop.time() + min(interval, 1.0)
                continue
            except Exception as exc:  # noqa: BLE001 - never "Task exception was never retrieved"
                self.service._log.exception(
                    "job %r run %r: heartbeat error",
                    self.options.code,
                    self.options.run_key,
                    extra={"action": "heartbeat_error", **self.log_extra},
                )
                if self.loop.time() - self.confirmed_at >= lease_s:
                    self._lose(f"heartbeat kept failing: {error_text(exc)[:200]}")
                    return
                due = self.loop.time() + min(interval, 1.0)
                continue
            if not ok:
                self._lose("the heartbeat was refused: the row was reclaimed or released")
                return
            self.confirmed_at = sent
            due = sent + interval

    def _lose(self, reason: str) -> None:
        self.lease._state.mark_lost(reason)
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
