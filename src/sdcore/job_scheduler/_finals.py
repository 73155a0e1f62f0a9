"""Group commit of outcomes: the ``complete``/``fail`` calls made while others are in flight
go out together, as one ``finalize_many`` statement (``lease.sql``).

A burst of 10,000 exclusive ticks finishes thousands of runs within milliseconds; one statement
each would queue them behind each other on the service's few connections (and keep every
finished run's objects alive meanwhile). Here at most as many finalize statements run at once as
the service holds connections; the calls made beyond that wait in a queue and leave together, up
to :data:`MAX_ITEMS` per statement. A call made while a statement may start and nothing waits
goes out at once on its own task, as the single-row ``finalize`` it always was.

Each row is recorded exactly as by ``finalize``: only while it is ``RUNNING`` under the
caller's owner token, and the caller learns ``True`` only if its row was updated. The statement
locks its rows in id order before updating them. When it fails:

- no answer within the shortest time left of its leases: every caller gets the single path's
  ``JobSchedulerUnavailableError`` (outcome unknown);
- a broken connection (an ambiguous commit): every row is resolved as a single ``finalize``
  resolves it (read the row; send ``finalize`` again only while it still shows ``RUNNING``);
- a refusal by the server (nothing was committed): every row is sent again on its own.

A caller cancelled before its row is sent is left out; once sent, its row is recorded or not as
the statement decides (as with a single ``finalize`` cancelled in flight).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

import psycopg

from sdcore.job_scheduler._core import LeaseEngine, Params, ambiguous, outcome_unknown
from sdcore.job_scheduler._watchdog import _Abandoned

__all__ = ["MAX_ITEMS", "Finals"]

MAX_ITEMS = 1_000  # rows per finalize_many statement

# One queued outcome: its parameters, when its answer is due (monotonic; None: no bound), and
# the caller's future.
_Item = tuple[Params, float | None, "asyncio.Future[bool]"]


class Finals:
    """The queue of outcomes waiting for a finalize statement, sent by ``engine``.

    As many finalize statements run at once as the engine holds connections: outcomes made by
    as many concurrent callers go out side by side, as single statements did; only the calls
    beyond wait and leave together.
    """

    def __init__(self, engine: LeaseEngine) -> None:
        self._in_flight = max(1, engine.max_connections)
        self._one = engine.finalize  # the single-row path: one(params, limit)
        self._resolve = engine.refinalize  # a row of an ambiguous batch: (params, until, exc)
        self._many = engine.finalize_many  # (columns, limit) -> the ids it updated
        self._queue: list[_Item] = []
        self._sending: set[str] = set()  # ids whose outcome is in flight (one at a time)
        self._running = 0
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def free(self) -> bool:
        """A finalize statement may start now and nothing waits: a call goes out at once."""
        return self._running < self._in_flight and not self._queue and not self._scheduled

    async def record(self, params: Params, limit: float | None) -> bool:
        """Record one outcome: at once on the caller's own task while :attr:`free` (the single
        statement, no hand-off, as many side by side as the service has connections), else
        with the others queued meanwhile."""
        if not self.free or params[2] in self._sending:
            return await self.submit(params, limit)
        self._running += 1
        self._sending.add(params[2])
        try:
            return await self._one(params, limit)
        finally:
            self._sending.discard(params[2])
            self._sent(None)

    def submit(self, params: Params, limit: float | None) -> asyncio.Future[bool]:
        """Queue one outcome with the others; the future of ``finalize``'s answer.

        Cancelling the future before its row is sent leaves the row out.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        until = None if limit is None else time.monotonic() + limit
        self._queue.append((params, until, future))
        if not self._scheduled and self._running < self._in_flight:
            self._scheduled = True
            loop.call_soon(self._pump)
        return future

    def _pump(self) -> None:
        self._scheduled = False
        while self._running < self._in_flight and self._queue:
            batch: list[_Item] = []
            ids: set[str] = set()
            rest: list[_Item] = []
            for item in self._queue:
                if item[2].done():
                    continue  # its caller was cancelled before it was sent
                job_id = item[0][2]
                if len(batch) >= MAX_ITEMS or job_id in ids or job_id in self._sending:
                    # A second outcome of one row waits until the first is answered: the
                    # first made is the first sent, as on a single connection.
                    rest.append(item)
                else:
                    ids.add(job_id)
                    batch.append(item)
            self._queue = rest
            if not batch:
                return
            self._running += 1
            self._sending.update(ids)
            task = asyncio.create_task(self._send(batch), name="sdcore-finalize")
            self._tasks.add(task)
            task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None] | None) -> None:
        if task is not None:
            self._tasks.discard(task)
        self._running -= 1
        if self._queue and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._pump)

    async def _send(self, batch: list[_Item]) -> None:
        try:
            await self._send_batch(batch)
        finally:
            self._sending.difference_update(item[0][2] for item in batch)

    async def _send_batch(self, batch: list[_Item]) -> None:
        try:
            if len(batch) == 1:
                params, until, future = batch[0]
                await _answer(future, self._one(params, _left(until)))
                return
            await self._send_many(batch)
        except asyncio.CancelledError:
            for *_, future in batch:
                future.cancel()
            raise

    async def _send_many(self, batch: list[_Item]) -> None:
        bounds = [until for _, until, _ in batch if until is not None]
        limit = _left(min(bounds)) if bounds else None
        columns: tuple[list[Any], ...] = ([], [], [], [])
        for params, _, _ in batch:
            for column, value in zip(columns, params, strict=True):
                column.append(value)
        try:
            updated = await self._many(columns, limit)
        except _Abandoned as exc:
            for params, _, future in batch:
                if not future.done():
                    future.set_exception(_unknown(params[0], exc))
            return
        except psycopg.Error as exc:
            if ambiguous(exc):
                await asyncio.gather(*(_answer(f, self._resolve(p, u, exc)) for p, u, f in batch))
            else:  # refused: nothing was committed
                await self._each_alone(batch)
            return
        for params, _, future in batch:
            if not future.done():
                future.set_result(params[2] in updated)

    async def _each_alone(self, batch: list[_Item]) -> None:
        await asyncio.gather(*(_answer(f, self._one(p, _left(u))) for p, u, f in batch))

    async def aclose(self) -> None:
        """Wait for the statements in flight."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))


def _left(until: float | None) -> float | None:
    return None if until is None else max(until - time.monotonic(), 0.0)


def _unknown(status: str, exc: BaseException) -> Exception:
    error = outcome_unknown(status)
    error.__cause__ = exc
    return error


async def _answer(future: asyncio.Future[bool], call: Awaitable[bool]) -> None:
    """Await ``call`` and hand its result (or error) to ``future``."""
    try:
        result = await call
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the caller's own call raises it
        if not future.done():
            future.set_exception(exc)
        return
    if not future.done():
        future.set_result(result)
