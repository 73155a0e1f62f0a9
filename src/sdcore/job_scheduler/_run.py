"""The run engine: one owned execution of ``run_exclusive`` (callable, heartbeat, deadline).

``BaseJobScheduler.run_exclusive`` acquires; a :class:`_Run` then calls the function, keeps the
lease alive with heartbeats, fires the loss at the client deadline, and records the outcome.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, cast

from sdcore._internal.errors import error_text
from sdcore._internal.threads import PLAIN_CALLS
from sdcore.job_scheduler._model import (
    LEASE_SLACK_MS,
    JobExecutionLease,
    JobSchedulerStatus,
    JobSchedulerUnavailableError,
    LostJobLeaseError,
)
from sdcore.job_scheduler._options import JobAcquireOptions

if TYPE_CHECKING:
    from sdcore.job_scheduler._base import BaseJobScheduler

T = TypeVar("T")
SUCCESS = JobSchedulerStatus.SUCCESS
FAIL = JobSchedulerStatus.FAIL

SLACK = LEASE_SLACK_MS / 1000


async def _settle(aw: Awaitable[T]) -> tuple[T, bool]:
    """Await ``aw`` to the end even if the caller is cancelled meanwhile.

    Returns:
        The result, and whether a cancellation arrived (the caller must re-raise it).
    """
    task = asyncio.ensure_future(aw)
    cancelled = False
    # What asyncio.shield does, with two objects instead of seven (a burst has thousands of
    # these in flight): a waiter of our own, woken when the task ends; a cancellation of the
    # caller cancels only the waiter.
    while not task.done():
        waiter = task.get_loop().create_future()
        task.add_done_callback(functools.partial(_wake, waiter), context=_QUIET)
        try:
            await waiter
        except asyncio.CancelledError:
            cancelled = True
    return task.result(), cancelled


# The context of callbacks that only wake a waiter (no user code, no context variable read).
_QUIET = contextvars.Context()


def _wake(waiter: asyncio.Future[None], _: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def _within(call: Awaitable[T], left: float) -> T:
    """``call``'s result if it answers within ``left`` seconds; it is abandoned otherwise (a
    lease call is bounded by the backend: it ends in the background)."""
    future = asyncio.ensure_future(call)
    done, _ = await asyncio.wait({future}, timeout=max(left, 0.0))
    if not done:
        future.add_done_callback(_consume)
        raise JobSchedulerUnavailableError(
            "the database did not answer within the slack after the client deadline"
        )
    return future.result()


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
        # The heartbeat: planned (a timer until the first is due), then a task of its own.
        self.beat_handle: asyncio.TimerHandle | None = None
        self.beat: asyncio.Task[None] | None = None
        self.acquired = time.monotonic()
        self.attempt: int | None = None  # passed to the callable after the lease (run_attempt)
        self.cancellable = False
        self.cancel_requested = False
        # Why the last heartbeat did not confirm the lease (named in the loss at the deadline).
        self.beat_problem: str | None = None
        # The run's context (a copy), for its deadline timer and heartbeat: one per run.
        self.context = contextvars.copy_context()

    @property
    def log_extra(self) -> dict[str, Any]:
        """The run's identity, for the ``extra`` of its log records."""
        lease = self.lease
        return {
            "job_id": lease.id,
            "job_code": self.options.code,
            "run_key": self.options.run_key,
            "idempotency_key": lease.idempotency_key,
            "fencing_token": lease.fencing_token,
        }

    async def execute(self, fn: Callable[..., Awaitable[T] | T], attempt: int | None = None) -> T:
        """Run ``fn(lease)`` (``fn(lease, attempt)`` when ``attempt`` is given) under the lease.

        One frame for the whole run (a burst has thousands in flight): the telemetry of the
        lease around the call, its heartbeat and deadline, and the outcome's record.
        """
        self.attempt = attempt
        telemetry = self.service.telemetry
        telemetry.lease_acquired(self.options.code)
        lost = False
        try:
            if self.options.heartbeat_ms > 0:
                self._plan_heartbeat()
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
                await self._stop()
                ours = self.cancel_requested and self.task.uncancel() == 0
                if ours:
                    await self._finalize(FAIL, {"error": "lease lost; run cancelled"})
                    raise self._lost_error() from exc
                self.state.mark_lost("run cancelled")
                await self._finalize(FAIL, {"error": "cancelled"})
                raise
            except BaseException as exc:
                await self._stop()
                if self.cancel_requested:
                    self.task.uncancel()
                recorded = await self._finalize(FAIL, {"error": error_text(exc)})
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
            await self._stop()
            if self.cancel_requested:
                self.task.uncancel()
            # The callable may have completed the run itself, in its own transaction
            # (complete_in + outbox): that is success, not a loss.
            if (
                not await self._finalize(SUCCESS, None)
                and await self._owned_status() is not JobSchedulerStatus.SUCCESS
            ):
                raise self._lost_error()
            return result
        except LostJobLeaseError:
            lost = True
            raise
        finally:
            telemetry.lease_released(self.options.code, lost)

    def _arm(self, delay: float) -> None:
        if delay != float("inf"):
            self.timer = self.loop.call_later(
                max(delay, 0.0), self._on_deadline, context=self.context
            )

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

    def _slack_left(self) -> float | None:
        """What is left of the slack after the client deadline, once that deadline has passed
        (``None`` before it).

        The outcome path has one bound: the client deadline plus ``LEASE_SLACK_MS``. A lease
        call sent before the deadline is bounded there by the backend (its time left plus the
        slack); one sent after it would get a fresh slack of its own, so the thread wait, the
        finalize and the read-back share what remains of the first.
        """
        now = time.monotonic()
        deadline = self.state.deadline
        return None if now < deadline else deadline + SLACK - now

    async def _owned_status(self) -> JobSchedulerStatus | None:
        left = self._slack_left()
        if left is not None and left <= 0:
            return None  # no answer can come back in time: the run is not reported as ours
        call: Awaitable[JobSchedulerStatus | None] = self.service.status_of(self.lease)
        try:
            status, cancelled = await _settle(call if left is None else _within(call, left))
        except JobSchedulerUnavailableError:
            return None
        if cancelled:
            self.task.cancel()
        return status

    def _lost_error(self) -> LostJobLeaseError:
        return LostJobLeaseError(self.lease.id, self.state.reason or "ownership was lost")

    async def _call(self, fn: Callable[..., Awaitable[T] | T]) -> T:
        args = (self.lease,) if self.attempt is None else (self.lease, self.attempt)
        if inspect.iscoroutinefunction(fn):
            self.cancellable = True
            return cast("T", await fn(*args))
        ctx = contextvars.copy_context()
        future = self.loop.run_in_executor(
            PLAIN_CALLS.get(), functools.partial(ctx.run, self._start_plain, fn, *args)
        )
        self.cancellable = True
        try:
            result = await asyncio.shield(future)
        except asyncio.CancelledError:
            # A thread cannot be stopped: tell it through the lease and wait, so that the row is
            # not released to another replica while this one still works. After a loss the row
            # is no longer ours to protect: wait for the thread only until the slack is used up.
            self.cancellable = False
            self.state.mark_lost("run cancelled")
            future.add_done_callback(_consume)  # the cancellation is the outcome, not its error
            if self.cancel_requested:
                limit = max(self.state.deadline + SLACK - time.monotonic(), 0.0)
                (done, _), _ = await _settle(asyncio.wait({future}, timeout=limit))
                if not done:
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

    def _start_plain(self, fn: Callable[..., T], *args: Any) -> T:
        """Call the plain ``fn`` in its worker thread, unless the lease was lost or the run
        cancelled while it waited for a free thread (a full pool): it never starts on a lease
        that no longer holds."""
        self.lease.raise_if_lost()
        return fn(*args)

    def _plan_heartbeat(self) -> None:
        """Start the heartbeat task when the first heartbeat is due: a run that ends before
        (most ticks of a burst) never has one."""
        due = self._first_beat()
        self.beat_handle = self.loop.call_later(
            max(0.0, due - time.monotonic()), self._beat_now, context=self.context
        )

    def _beat_now(self) -> None:
        self.beat_handle = None
        self.beat = asyncio.create_task(
            self._heartbeat(), name=f"sdcore-heartbeat:{self.options.code}", context=self.context
        )

    def _first_beat(self) -> float:
        """When the first heartbeat is due (``time.monotonic()``): an interval after the lease
        was last confirmed."""
        state = self.state
        confirmed = state.deadline - state.valid
        if confirmed != confirmed or confirmed == float("-inf"):  # no client deadline known
            confirmed = self.acquired
        return confirmed + self.options.heartbeat_ms / 1000

    async def _stop(self) -> None:
        if self.beat_handle is not None:
            self.beat_handle.cancel()
            self.beat_handle = None
        beat, self.beat = self.beat, None
        if beat is None:
            return
        # The heartbeat never awaits a database call directly (see _heartbeat), so it ends at
        # once even when a statement hangs.
        beat.cancel()
        _, cancelled = await _settle(asyncio.wait({beat}))
        if cancelled:
            # Re-deliver the caller's cancellation after the heartbeat is gone.
            self.task.cancel()

    async def _finalize(self, status: JobSchedulerStatus, data: Mapping[str, Any] | None) -> bool:
        """Record the outcome; retry while the database is unreachable and the lease may hold."""
        # The PostgreSQL service hands back a future of its batched finalize: awaited to the
        # end without a task of its own (see _settle).
        delay = 0.05
        while True:
            left = self._slack_left()
            try:
                if left is not None and left <= 0:
                    raise JobSchedulerUnavailableError("no time left after the client deadline")
                call = self.service.finalize_soon(self.lease, status, data)
                ok, cancelled = await _settle(call if left is None else _within(call, left))
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
        due = self._first_beat()
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
                self.service.telemetry.heartbeat_failed(self.options.code)
                self._lose("the database did not answer the heartbeat within the lease")
                return
            try:
                ok = call.result()
            except (JobSchedulerUnavailableError, TimeoutError) as exc:
                self.service.telemetry.heartbeat_failed(self.options.code)
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
                self.service.telemetry.heartbeat_failed(self.options.code)
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
