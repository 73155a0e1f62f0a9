"""``RunHistory``: every run of a controlled scheduler recorded in the store (start, end, error).

The control plane wraps each handler with :meth:`RunHistory.wrap`. A run's ``source`` is how its
tick started (:func:`~sdcore.scheduling._supervisor.current_path`, set by the supervisor for the
tick's task): ``trigger``, ``backfill``, or ``tick`` for every other path. History never fails
a run: a write that fails is logged and the run goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any

from sdcore._internal.errors import error_text
from sdcore.scheduling._control import TRIGGER_PREFIX, Replica, RunStart, ScheduleStore
from sdcore.scheduling._policy import StartPath
from sdcore.scheduling._runner import Handler
from sdcore.scheduling._supervisor import current_path
from sdcore.scheduling._triggers import Tick

__all__ = ["RunHistory"]

_RECORD_TIMEOUT_S = 5.0
_SOURCES = {StartPath.TRIGGER: "trigger", StartPath.BACKFILL: "backfill"}


def run_source(tick: Tick) -> str:
    """The history ``source`` of the run of ``tick`` in this task."""
    if tick.run_key is not None and tick.run_key.startswith(TRIGGER_PREFIX):
        return "trigger"
    return _SOURCES.get(current_path(), "tick")


class RunHistory:
    """Records runs for one replica.

    Args:
        store: The control plane's store.
        replica: This replica (replaced when the control plane starts).
        logger: The control plane's logger.
    """

    def __init__(self, store: ScheduleStore, replica: Replica, logger: logging.Logger) -> None:
        self.store = store
        self.replica = replica
        self._log = logger
        self.loop: asyncio.AbstractEventLoop | None = None

    def wrap(self, name: str, handler: Handler) -> Handler:
        """``handler`` recording every run in the history (start, end, error)."""
        history = self
        if inspect.iscoroutinefunction(handler):

            async def recorded(tick: Tick) -> Any:
                run_id = await history.started(tick, run_source(tick))
                try:
                    result = await handler(tick)
                except BaseException as exc:
                    await history.finished(run_id, exc)
                    raise
                await history.finished(run_id, None)
                return result

            return recorded

        def recorded_sync(tick: Tick) -> Any:
            # Runs in a worker thread (the runner's to_thread, which carries the tick's context);
            # the writes go through the loop.
            run_id = history._from_thread(history.started(tick, run_source(tick)))
            try:
                result = handler(tick)
            except BaseException as exc:
                history._from_thread(history.finished(run_id, exc))
                raise
            history._from_thread(history.finished(run_id, None))
            return result

        return recorded_sync

    def _from_thread(self, coro: Any) -> Any:
        loop = self.loop
        if loop is None:
            coro.close()
            return None
        try:
            return asyncio.run_coroutine_threadsafe(coro, loop).result(_RECORD_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - history must never fail a run
            return None

    async def started(self, tick: Tick, source: str) -> int | None:
        """Record the start of a run; its history id, or ``None`` if not recorded."""
        lease = tick.lease
        try:
            return await self.store.run_started(
                RunStart(
                    schedule=tick.schedule,
                    run_key=tick.run_key or "initial",
                    source=source,
                    scheduled_at=tick.scheduled_at,
                    attempt=tick.attempt,
                    fencing_token=None if lease is None else lease.fencing_token,
                    replica=self.replica,
                )
            )
        except Exception as exc:  # noqa: BLE001 - history must never fail a run
            self._log.warning("schedule %r: run history not recorded: %s", tick.schedule, exc)
            return None

    async def finished(self, run_id: int | None, exc: BaseException | None) -> None:
        """Record the end of a run (``exc``: what it raised)."""
        if run_id is None:
            return
        if exc is None:
            status, error = "SUCCESS", None
        else:
            status = "FAIL"
            error = "cancelled" if isinstance(exc, asyncio.CancelledError) else error_text(exc)
        try:
            await asyncio.shield(self.store.run_finished(run_id, status, error))
        except Exception as exc2:  # noqa: BLE001
            self._log.warning("run history not finished: %s", exc2)
