"""Listener work outside ``emit``: tasks the bus holds, deferred batches, logging, draining.

Every task is strongly referenced until it ends (the loop keeps only weak references), and its
outcome is read in a done-callback, so no failure ends as "Task exception was never retrieved".
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from typing import Any

from sdcore.events._errors import EventLoopRequiredError
from sdcore.events._subscription import Subscription


class Background:
    """The background work of one bus.

    Args:
        logger: Where listener failures go.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self.log = logger
        self.tasks: set[asyncio.Future[Any]] = set()
        # Deferred batches scheduled but not run yet, per loop (a bus may outlive a loop).
        self.deferred: dict[asyncio.AbstractEventLoop, int] = {}

    @property
    def pending(self) -> int:
        """Listener tasks not finished plus deferred batches not run."""
        return len(self.tasks) + sum(self.deferred.values())

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        name: str,
        subscription: Subscription,
        awaitable: Any,
        *,
        log: bool = False,
    ) -> asyncio.Future[Any]:
        """Wrap a listener's awaitable in a task the bus holds until it ends.

        With ``log``, the task's failure is logged when it ends; otherwise the caller reads it.
        """
        if inspect.iscoroutine(awaitable):
            future: asyncio.Future[Any] = loop.create_task(
                awaitable, name=f"sdcore.events:{name}:{subscription._description}"
            )
        else:
            future = asyncio.ensure_future(awaitable, loop=loop)
        self.tasks.add(future)
        if log:
            future.add_done_callback(functools.partial(self.finished, name, subscription))
        else:
            future.add_done_callback(self.tasks.discard)
        return future

    def spawn(
        self,
        loop: asyncio.AbstractEventLoop | None,
        name: str,
        subscription: Subscription,
        awaitable: Any,
    ) -> None:
        """Run a listener's awaitable in the background; its failure is logged when it ends."""
        if loop is None:  # a plain listener returned an awaitable
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                if inspect.iscoroutine(awaitable):
                    awaitable.close()  # else "coroutine was never awaited" at garbage collection
                error = EventLoopRequiredError(name, [subscription._description])
                self.failed(name, subscription, error)
                return
        self.start(loop, name, subscription, awaitable, log=True)

    def finished(self, name: str, subscription: Subscription, future: asyncio.Future[Any]) -> None:
        """Done-callback: release the task, log its failure (a cancellation is silent)."""
        self.tasks.discard(future)
        if not future.cancelled() and (error := future.exception()) is not None:
            self.failed(name, subscription, error)

    async def abandon(
        self, name: str, ran: list[Subscription], waiting: dict[asyncio.Future[Any], int]
    ) -> None:
        """``emit_async`` is unwinding: cancel its listeners, log their outcome, wait for them."""
        for future, index in waiting.items():
            future.cancel()
            future.add_done_callback(functools.partial(self.finished, name, ran[index]))
        if waiting:
            # A second cancellation interrupts this wait; the callbacks still log, drain() waits.
            await asyncio.wait(waiting)

    def defer(
        self,
        loop: asyncio.AbstractEventLoop,
        name: str,
        event: object,
        subscriptions: tuple[Subscription, ...],
    ) -> None:
        """Run ``subscriptions`` on the next loop iteration (one ``call_soon`` per emit)."""
        self.deferred[loop] = self.deferred.get(loop, 0) + 1
        loop.call_soon(self._run_deferred, loop, name, event, subscriptions)

    def _run_deferred(
        self,
        loop: asyncio.AbstractEventLoop,
        name: str,
        event: object,
        subscriptions: tuple[Subscription, ...],
    ) -> None:
        try:
            for subscription in subscriptions:
                if not subscription._active:
                    continue
                try:
                    result = subscription._callback(event)
                except Exception as exc:  # noqa: BLE001 - a listener never breaks the loop
                    self.failed(name, subscription, exc)
                    continue
                if result is not None and (subscription._is_async or inspect.isawaitable(result)):
                    self.spawn(loop, name, subscription, result)
        finally:
            left = self.deferred[loop] - 1
            if left:
                self.deferred[loop] = left
            else:
                del self.deferred[loop]

    async def drain(self, timeout: float | None) -> bool:  # noqa: ASYNC109 - shutdown API
        """See :meth:`EventBus.drain`."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                await self._quiesce(loop, cancel=False)
        except TimeoutError:
            cancelled = await self._quiesce(loop, cancel=True)
            self.log.warning(
                "Event: drain timed out after %ss; cancelled %d listener task(s)",
                timeout,
                cancelled,
                extra={"action": "drain_timeout", "cancelled": cancelled},
            )
            return False
        return True

    async def _quiesce(self, loop: asyncio.AbstractEventLoop, *, cancel: bool) -> int:
        """Wait until no work of ``loop`` is left (new work included); ``cancel`` it first."""
        current = asyncio.current_task()
        cancelled = 0
        while True:
            futures = {f for f in self.tasks if f is not current and f.get_loop() is loop}
            if futures:
                if cancel:
                    cancelled += sum(f.cancel() for f in futures)
                await asyncio.wait(futures)
            elif self.deferred.get(loop):
                await asyncio.sleep(0)  # the deferred batch runs on the next iteration
            else:
                return cancelled

    def failed(self, name: str, subscription: Subscription, error: BaseException) -> None:
        """Log a listener's failure (a cancellation as a warning) with its context."""
        description = subscription._description
        if isinstance(error, asyncio.CancelledError):
            self.log.warning(
                "Event: listener %s was cancelled on event %r",
                description,
                name,
                extra={"action": "listener_cancelled", "event": name, "listener": description},
            )
            return
        # Context "Event", as NestJS logs it; the name with %r (log-injection safe).
        self.log.error(
            "Event: listener %s failed on event %r: %s: %s",
            description,
            name,
            type(error).__name__,
            str(error)[:500],
            exc_info=error,
            extra={"action": "listener_failed", "event": name, "listener": description},
        )
