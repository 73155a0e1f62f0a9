"""``RunHistory``: every run of a controlled scheduler recorded in the store (start, end, error).

The control plane wraps each handler with :meth:`RunHistory.wrap`. A run's ``source`` is how its
tick started (:func:`~sdcore.scheduling._policy.current_path`, set by the supervisor for the
tick's task): ``trigger``, ``backfill``, or ``tick`` for every other path. History never fails
a run: a write that fails is logged and the run goes on.

The writes are group-committed: the starts requested in one turn of the event loop, or while
:data:`IN_FLIGHT` start statements are already out, leave together as one ``runs_started`` statement
(at most :data:`MAX_ITEMS` rows), and the ends likewise as one ``runs_finished``. A burst of 10,000
ticks thus costs tens of statements instead of 20,000 (``docs/benchmarks.md#control-plane``). A lone
run waits one loop turn, no timer. A handler does not wait for its start row (it is queued just
before the handler's first line); its end row waits for the start row's id.

No handler waits for a history row, and in a burst every handler waits for its tick's acquire:
a statement waits (at most :data:`YIELD_S`) until the scheduler has no acquire queued or in
flight (:attr:`RunHistory.quiet`), and then takes every row queued by then. A run's end row still
follows its start row, and a successful run's lease outcome its end row. A replica killed while
rows wait loses them, as one killed while their statement was out did.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sdcore._internal.errors import error_text
from sdcore.scheduling._control import (
    TRIGGER_PREFIX,
    Replica,
    RunFinish,
    RunStart,
    ScheduleStore,
)
from sdcore.scheduling._policy import StartPath, current_path
from sdcore.scheduling._runner import Handler
from sdcore.scheduling._triggers import Tick

__all__ = ["IN_FLIGHT", "MAX_ITEMS", "YIELD_S", "RunHistory"]

IN_FLIGHT = 2  # statements of each kind (starts, ends) at once
MAX_ITEMS = 1_000  # rows per statement
YIELD_S = 1.0  # how long a statement waits for the scheduler's acquires, at most
_RECORD_TIMEOUT_S = 5.0
_NAMED = 10  # schedules named in the log line of a failed statement
_SOURCES = {StartPath.TRIGGER: "trigger", StartPath.BACKFILL: "backfill"}

T = TypeVar("T")
R = TypeVar("R")


def run_source(tick: Tick) -> str:
    """The history ``source`` of the run of ``tick`` in this task."""
    if tick.run_key is not None and tick.run_key.startswith(TRIGGER_PREFIX):
        return "trigger"
    return _SOURCES.get(current_path(), "tick")


def _refused(exc: Exception) -> bool:
    """Whether the server refused the statement (nothing was written): a SQLSTATE that is
    neither a broken connection (class 08) nor an operator's intervention (class 57)."""
    state = getattr(exc, "sqlstate", None)
    return isinstance(state, str) and not state.startswith(("08", "57"))


@dataclass(slots=True)
class _Row(Generic[T, R]):
    """A row waiting for its statement, and the future of its result."""

    row: T
    schedule: str
    future: asyncio.Future[R | None]
    kept: bool  # written even if the future is cancelled first (see _Group.submit)


class _Group(Generic[T, R]):
    """The rows of one kind waiting for a statement (a group commit).

    Args:
        what: What the rows record, for the log (``start``, ``end``).
        write: Writes rows in one statement; one result per row, in order.
        log: The logger.
        orphan: Called with a row and its result when the row was written after its caller
            stopped waiting (cancelled).
        before: Awaited before each statement takes its rows.
        in_flight: Statements at once.
        max_items: Rows per statement.
    """

    def __init__(
        self,
        what: str,
        write: Callable[[list[T]], Awaitable[Sequence[R]]],
        log: logging.Logger,
        *,
        orphan: Callable[[T, R], None] | None = None,
        before: Callable[[], Awaitable[None]] | None = None,
        in_flight: int = IN_FLIGHT,
        max_items: int = MAX_ITEMS,
    ) -> None:
        self._what = what
        self._write = write
        self._log = log
        self._orphan = orphan
        self._before = before
        self._in_flight = max(1, in_flight)
        self._max_items = max(1, max_items)
        self._queue: list[_Row[T, R]] = []
        self._running = 0
        self._scheduled = False
        self._taking = False  # a statement waits to take rows: the queue is its until then
        self._tasks: set[asyncio.Task[None]] = set()

    def submit(self, row: T, schedule: str, *, kept: bool = False) -> asyncio.Future[R | None]:
        """Queue ``row`` (of ``schedule``); the future of its result, ``None`` if not written.

        Cancelling the future before the row is sent leaves the row out, unless ``kept``: a kept
        row is written all the same (its caller may await the future without a shield), and
        its result goes to ``orphan``.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R | None] = loop.create_future()
        self._queue.append(_Row(row, schedule, future, kept))
        if not self._scheduled and self._running < self._in_flight:
            self._scheduled = True
            loop.call_soon(self._pump)
        return future

    def _pump(self) -> None:
        self._scheduled = False
        if self._running < self._in_flight and self._queue and not self._taking:
            self._taking = True
            self._running += 1
            task = asyncio.create_task(self._next(), name=f"sdcore-history-{self._what}")
            self._tasks.add(task)
            task.add_done_callback(self._sent)

    async def _next(self) -> None:
        """One statement: the rows queued once ``before`` returns; what it leaves goes to the
        next statement, which starts waiting at once."""
        try:
            if self._before is not None:
                await self._before()
        finally:
            self._taking = False
        waiting = [entry for entry in self._queue if entry.kept or not entry.future.done()]
        batch, self._queue = waiting[: self._max_items], waiting[self._max_items :]
        if self._queue:
            self._pump()
        if batch:
            await self._send(batch)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._running -= 1
        if self._queue and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._pump)

    async def _send(self, batch: list[_Row[T, R]]) -> None:
        try:
            results = await self._write([entry.row for entry in batch])
        except asyncio.CancelledError:
            for entry in batch:
                entry.future.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - history must never fail a run
            if len(batch) > 1 and _refused(exc):
                # One row the server refuses must not lose the others: halve until it is alone.
                half = len(batch) // 2
                await self._send(batch[:half])
                await self._send(batch[half:])
                return
            names = sorted({entry.schedule for entry in batch})
            shown = ", ".join(repr(n) for n in names[:_NAMED])
            more = f" and {len(names) - _NAMED} more" if len(names) > _NAMED else ""
            self._log.warning(
                "run history: %d run %s(s) not recorded (schedule %s%s): %s",
                len(batch),
                self._what,
                shown,
                more,
                exc,
                extra={"action": "run_history_failed", "schedules": names},
            )
            for entry in batch:
                if not entry.future.done():
                    entry.future.set_result(None)
            return
        for entry, result in zip(batch, results, strict=True):
            if not entry.future.done():
                entry.future.set_result(result)
            elif self._orphan is not None:
                self._orphan(entry.row, result)

    async def drain(self) -> None:
        """Wait for the statements in flight and the rows queued."""
        while self._tasks or self._queue:
            if self._tasks:
                await asyncio.wait(set(self._tasks))
            else:
                await asyncio.sleep(0)


def _status(exc: BaseException | None) -> str:
    return "SUCCESS" if exc is None else "FAIL"


def _error(exc: BaseException | None) -> str | None:
    if exc is None:
        return None
    return "cancelled" if isinstance(exc, asyncio.CancelledError) else error_text(exc)


class RunHistory:
    """Records runs for one replica.

    Args:
        store: The control plane's store.
        replica: This replica (replaced when the control plane starts).
        logger: The control plane's logger.
        in_flight: Statements of each kind at once.
        max_items: Rows per statement.

    Attributes:
        quiet: Returns once the scheduler has no acquire queued or in flight, or after the
            seconds it is given (set by the control plane; ``None``: statements go at once).
    """

    quiet: Callable[[float], Awaitable[None]] | None = None

    def __init__(
        self,
        store: ScheduleStore,
        replica: Replica,
        logger: logging.Logger,
        *,
        in_flight: int = IN_FLIGHT,
        max_items: int = MAX_ITEMS,
    ) -> None:
        self.store = store
        self.replica = replica
        self._log = logger
        self.loop: asyncio.AbstractEventLoop | None = None
        self._starts: _Group[RunStart, int] = _Group(
            "start",
            self._start_rows,
            logger,
            orphan=self._abandon,
            before=self._yield,
            in_flight=in_flight,
            max_items=max_items,
        )
        self._ends: _Group[RunFinish, None] = _Group(
            "end",
            self._finish_rows,
            logger,
            before=self._yield,
            in_flight=in_flight,
            max_items=max_items,
        )

    async def _yield(self) -> None:
        quiet = self.quiet
        if quiet is None:
            return
        try:
            await quiet(YIELD_S)
        except Exception:  # noqa: BLE001 - the rows go out all the same
            self._log.debug("run history: the wait for the acquires failed", exc_info=True)

    def wrap(self, name: str, handler: Handler) -> Handler:
        """``handler`` recording every run in the history (start, end, error)."""
        history = self
        if inspect.iscoroutinefunction(handler):

            async def recorded(tick: Tick) -> Any:
                # The start row is queued, not awaited: nothing may come between the gate's
                # last look (the runner's, just before) and the handler's first line.
                start = history.start(tick, run_source(tick), kept=True)
                try:
                    result = await handler(tick)
                except BaseException as exc:
                    history.finish_when_started(tick.schedule, start, exc)
                    raise
                try:
                    run_id = await start
                except asyncio.CancelledError as exc:  # the run is cancelled: so is its record
                    if not start.cancelled():  # written before the cancellation reached us
                        history.finish_when_started(tick.schedule, start, exc)
                    # Else a kept row: written all the same, then closed as cancelled (_abandon),
                    # unless its statement is cancelled too (the loop shuts down).
                    raise
                await history.finished(tick.schedule, run_id, None, _lease_id(tick))
                return result

            return recorded

        def recorded_sync(tick: Tick) -> Any:
            # Runs in a worker thread (the runner's to_thread, which carries the tick's context);
            # the writes go through the loop.
            loop = history.loop
            start = (
                None
                if loop is None
                else asyncio.run_coroutine_threadsafe(history.started(tick, run_source(tick)), loop)
            )

            def run_id() -> int | None:
                if start is None:
                    return None
                try:
                    return start.result(_RECORD_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - history must never fail a run
                    start.cancel()
                    return None

            try:
                result = handler(tick)
            except BaseException as exc:
                history._from_thread(
                    history.finished(tick.schedule, run_id(), exc, _lease_id(tick))
                )
                raise
            history._from_thread(history.finished(tick.schedule, run_id(), None, _lease_id(tick)))
            return result

        return recorded_sync

    def _from_thread(self, coro: Any) -> Any:
        loop = self.loop
        if loop is None:
            coro.close()
            return None
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(_RECORD_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - history must never fail a run
            # A start still queued is left out; one written meanwhile is closed (_abandon).
            future.cancel()
            return None

    async def started(self, tick: Tick, source: str) -> int | None:
        """Record the start of a run; its history id, or ``None`` if not recorded."""
        return await self.start(tick, source)

    def start(self, tick: Tick, source: str, *, kept: bool = False) -> asyncio.Future[int | None]:
        """Queue the start of a run; the future of its history id (``None``: not recorded).

        Cancelling the future leaves the row out if it is not sent yet; a ``kept`` row (its
        handler has run, or runs) is written all the same and closed as cancelled.
        """
        lease = tick.lease
        run = RunStart(
            schedule=tick.schedule,
            run_key=tick.run_key or "initial",
            source=source,
            scheduled_at=tick.scheduled_at,
            attempt=tick.attempt,
            fencing_token=None if lease is None else lease.fencing_token,
            replica=self.replica,
        )
        return self._starts.submit(run, tick.schedule, kept=kept)

    def finish_when_started(
        self, schedule: str, start: asyncio.Future[int | None], exc: BaseException
    ) -> None:
        """Record the end of a run that raised ``exc`` once its start row is written, without
        waiting for it (the run may be cancelled: its end is recorded all the same)."""

        def written(future: asyncio.Future[int | None]) -> None:
            if future.cancelled() or future.exception() is not None:
                return
            run_id = future.result()
            if run_id is not None:
                self._ends.submit(
                    RunFinish(run_id=run_id, status=_status(exc), error=_error(exc)), schedule
                )

        if start.done():
            written(start)
        else:
            start.add_done_callback(written)

    async def finished(
        self,
        schedule: str,
        run_id: int | None,
        exc: BaseException | None,
        lease_id: str | None = None,
    ) -> None:
        """Record the end of a run of ``schedule`` (``exc``: what it raised; ``lease_id``: its
        lease row, whose fencing token tells a run taken over meanwhile)."""
        if run_id is None:
            return
        finish = RunFinish(run_id=run_id, status=_status(exc), error=_error(exc), lease_id=lease_id)
        # Kept: the end of a run cancelled meanwhile is recorded too.
        await self._ends.submit(finish, schedule, kept=True)

    async def _start_rows(self, rows: list[RunStart]) -> list[int]:
        return await self.store.runs_started(rows)

    async def _finish_rows(self, rows: list[RunFinish]) -> list[None]:
        await self.store.runs_finished(rows)
        return [None] * len(rows)

    def _abandon(self, run: RunStart, run_id: int) -> None:
        """A start written after its caller stopped waiting for its id (a thread's run gave up
        after ``_RECORD_TIMEOUT_S``, or a run was cancelled while it waited): closed as
        cancelled."""
        self._ends.submit(RunFinish(run_id=run_id, status="FAIL", error="cancelled"), run.schedule)

    async def drain(self) -> None:
        """Wait for every write requested so far."""
        await self._starts.drain()
        await self._ends.drain()


def _lease_id(tick: Tick) -> str | None:
    """The lease row of ``tick``'s run (``None``: a schedule that runs without a lease)."""
    return None if tick.lease is None else tick.lease.id
