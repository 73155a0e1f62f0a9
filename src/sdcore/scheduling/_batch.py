"""Batch start: the tick acquires asked for in one turn of the event loop go out together.

When thousands of exclusive schedules are due at one instant ("every customer's digest at
08:00"), the timer loop starts all their ticks in one turn of the event loop. Each tick asks
:class:`TickAcquirer` for its lease; the requests of that turn are collected and sent as
``jobs.acquire_attempts(...)`` calls of at most ``batch_size`` keys each, which
``JobSchedulerService`` answers with one statement per call (each key still won by exactly one
replica, with the tick's attempt budget). A job scheduler without a batch statement answers
through the default of :class:`~sdcore.job_scheduler.BaseJobScheduler`, one key at a time.

Every key is won or lost exactly as by a single ``acquire_attempt``: batching changes how many
statements carry the keys, not what any key's outcome can be.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from sdcore.job_scheduler import (
    AttemptAcquireResult,
    AttemptBudget,
    BaseJobScheduler,
    JobAcquireOptions,
    JobAcquireResult,
    JobSchedulerError,
)

__all__ = ["DEFAULT_BATCH_SIZE", "TickAcquirer"]

DEFAULT_BATCH_SIZE = 1_000


@dataclass(frozen=True, slots=True)
class _Request:
    """One lease request waiting for its call: a tick's (with its attempt budget) or a plain
    lease's (``budget`` ``None``), and the future its caller awaits."""

    options: JobAcquireOptions
    budget: AttemptBudget | None
    future: asyncio.Future[AttemptAcquireResult]


class TickAcquirer:
    """Collects the lease requests of one loop turn into batch calls.

    Tick leases (with their attempt budget) go to ``jobs.acquire_attempts``; plain leases (the
    cluster overlap guard of ``overlap="skip_cluster"``) to ``jobs.acquire_many``, or one
    ``acquire`` each when the job scheduler has no ``acquire_many``.

    Args:
        jobs: The lease service.
        logger: The scheduler's logger.
        batch_size: Most keys per call (one statement on PostgreSQL).
    """

    def __init__(
        self, jobs: BaseJobScheduler, logger: logging.Logger, batch_size: int = DEFAULT_BATCH_SIZE
    ) -> None:
        self._jobs = jobs
        self._log = logger
        self._size = batch_size
        self._pending: list[_Request] = []
        self._tasks: set[asyncio.Task[Any]] = set()

    async def acquire(
        self, options: JobAcquireOptions, budget: AttemptBudget
    ) -> AttemptAcquireResult:
        """Acquire one tick's lease with the other requests of this loop turn.

        Raises:
            JobSchedulerError: As ``acquire_attempt`` (the whole call failed).
        """
        return await self._queue(options, budget)

    async def acquire_each(
        self,
        items: list[tuple[JobAcquireOptions, AttemptBudget]],
    ) -> list[AttemptAcquireResult | Exception]:
        """Acquire many ticks' leases with the other requests of this loop turn, in one await.

        The batch start's path: the answers come back in ``items``' order, each a result or the
        exception its call raised, without a coroutine per tick. Cancelled, every lease the
        calls in flight win for these items is given back (as for :meth:`acquire`).

        Args:
            items: Each tick's lease options and attempt budget.
        """
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[AttemptAcquireResult]] = [loop.create_future() for _ in items]
        if items and not self._pending:
            loop.call_soon(self.flush)
        self._pending.extend(
            _Request(options, budget, future)
            for (options, budget), future in zip(items, futures, strict=True)
        )
        answers: list[AttemptAcquireResult | Exception] = []
        try:
            for future in futures:
                try:
                    answers.append(await future)
                except Exception as exc:  # noqa: BLE001 - the tick's own offer raises it
                    answers.append(exc)
        except asyncio.CancelledError:
            for future in futures:
                future.cancel()
            raise
        return answers

    async def acquire_plain(self, options: JobAcquireOptions) -> JobAcquireResult:
        """Acquire a plain lease (``acquire`` semantics) with the other requests of this turn.

        Raises:
            JobSchedulerError: As ``acquire`` (the whole call failed).
        """
        return (await self._queue(options, None)).result

    async def _queue(
        self, options: JobAcquireOptions, budget: AttemptBudget | None
    ) -> AttemptAcquireResult:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[AttemptAcquireResult] = loop.create_future()
        if not self._pending:
            loop.call_soon(self.flush)
        self._pending.append(_Request(options, budget, future))
        # Cancelled while the call is in flight, the future is cancelled with us and the call
        # goes on: a lease it wins for this caller is given back (see _send).
        return await future

    async def quiet(self, at_most_s: float) -> None:
        """Return once no request is queued or in flight, or after ``at_most_s`` seconds.

        Writes that no handler waits for (the run history) wait for this before they go out: in
        a burst the database and the event loop then serve the acquires, which each handler's
        start waits for, first.
        """
        loop = asyncio.get_running_loop()
        until = loop.time() + at_most_s
        while self._tasks or self._pending:
            left = until - loop.time()
            if left <= 0:
                return
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=left)
            else:
                await asyncio.sleep(0)  # queued this turn: flushed at the next

    def flush(self) -> bool:
        """Send every queued request now (the timer loop calls this after each slice).

        Returns:
            Whether any request was sent.
        """
        pending = [request for request in self._pending if not request.future.done()]
        self._pending = []
        if not pending:
            return False
        # Sorted by key, so that replicas cut the same burst into the same calls (no deadlock is
        # possible either way: each statement locks and inserts in key order).
        pending.sort(key=lambda request: request.options.lock_key)
        ticks = [request for request in pending if request.budget is not None]
        plain = [request for request in pending if request.budget is None]
        self._cut(ticks)
        self._cut(plain)
        return True

    def _cut(self, pending: list[_Request]) -> None:
        while pending:
            call: list[_Request] = []
            keys: set[str] = set()
            rest: list[_Request] = []
            for request in pending:
                key = request.options.lock_key
                if len(call) >= self._size or key in keys:
                    rest.append(request)  # a repeated key waits for the next call
                else:
                    keys.add(key)
                    call.append(request)
            pending = rest
            task = asyncio.create_task(self._send(call), name="sdcore-tick-acquire")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, call: list[_Request]) -> None:
        """Send one call and answer its futures."""
        try:
            results = await self._call(call)
        except asyncio.CancelledError:
            for request in call:
                request.future.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - each tick's own acquire raises it
            for request in call:
                if not request.future.done():
                    request.future.set_exception(exc)
            return
        for request, result in zip(call, results, strict=True):
            if request.future.done():
                self._give_back_result(result)
            else:
                request.future.set_result(result)

    async def _call(self, call: list[_Request]) -> list[AttemptAcquireResult]:
        jobs = self._jobs
        if call[0].budget is not None:
            return await jobs.acquire_attempts(
                [(r.options, r.budget) for r in call if r.budget is not None]
            )
        many = getattr(jobs, "acquire_many", None)
        if many is not None:
            return [
                AttemptAcquireResult(result=result, attempt=0)
                for result in await many([r.options for r in call])
            ]
        return [AttemptAcquireResult(result=await jobs.acquire(r.options), attempt=0) for r in call]

    def _give_back_result(self, result: AttemptAcquireResult) -> None:
        outcome = result.result
        if not outcome.acquired:
            return
        task = asyncio.create_task(self._release(outcome), name="sdcore-tick-acquire-give-back")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, outcome: JobAcquireResult) -> None:
        assert outcome.acquired  # noqa: S101 - checked by the caller
        try:
            await self._jobs.give_back(outcome.lease, "cancelled")
        except JobSchedulerError as exc:
            self._log.warning(
                "could not give back a tick lease won after its run was cancelled (it expires "
                "with its lease): %s",
                exc,
                extra={"action": "acquire_give_back_failed"},
            )

    async def aclose(self) -> None:
        """Wait for the calls in flight (and the leases they give back)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))
