"""``EventBus``: in-process application events (NestJS ``@nestjs/event-emitter`` semantics).

Dispatch rules in one place (the reference page explains them):

- plain listeners run inside ``emit``, in registration order; coroutine listeners are started as
  tasks; *deferred* listeners run after ``emit`` returned, from one ``loop.call_soon`` per emit;
- a listener's error is logged and never reaches the emitter, except through ``emit_async`` for
  listeners registered with ``propagate_errors=True``;
- the name -> listeners resolution is cached per emitted name and dropped on every ``on``/``off``.
"""

from __future__ import annotations

import asyncio
import difflib
import inspect
import logging
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, Self, TypeVar

from sdcore._internal.validation import boolean
from sdcore.events._background import Background
from sdcore.events._errors import (
    EventLoopRequiredError,
    InvalidListenerError,
    UnknownEventError,
)
from sdcore.events._patterns import parse_pattern, validate_name
from sdcore.events._subscription import Listener, Subscription

L = TypeVar("L", bound=Callable[..., Any])

# Bounds the memory a stream of distinct dynamic names can take; clearing only costs re-resolution.
CACHE_LIMIT = 4096

# (immediate listeners, deferred listeners, needs a running loop), all in registration order.
_Entry = tuple[tuple[Subscription, ...], tuple[Subscription, ...], bool]


class EventBus:
    """An in-process event bus: listeners by event name or wildcard pattern.

    Args:
        logger_name: Logger for listener failures and diagnostics.
        strict: Raise :class:`UnknownEventError` when an emitted name matches no listener
            (default: return ``False`` and log one debug line).

    Not thread-safe, like the rest of asyncio: use it from the event loop's thread (from another
    thread, ``loop.call_soon_threadsafe(bus.emit, name, event)``).
    """

    def __init__(self, *, logger_name: str = "sdcore.events", strict: bool = False) -> None:
        boolean("strict", strict)
        self._log = logging.getLogger(logger_name)
        self._strict = strict
        self._subscriptions: list[Subscription] = []
        self._cache: dict[str, _Entry] = {}
        self._background = Background(self._log)

    @property
    def strict(self) -> bool:
        """Whether emitting a name without listener raises."""
        return self._strict

    @property
    def pending(self) -> int:
        """Background work not finished yet: listener tasks plus scheduled deferred batches."""
        return self._background.pending

    # -- registration ---------------------------------------------------------------------------

    def on(
        self,
        pattern: str,
        listener: Listener,
        *,
        deferred: bool = False,
        propagate_errors: bool = False,
    ) -> Subscription:
        """Register ``listener`` for every event whose name matches ``pattern``.

        Args:
            pattern: An event name, or a pattern with ``*`` (one segment) / ``**`` (zero or more).
            listener: Called with the event object; ``def`` or ``async def``.
            deferred: Run after ``emit`` returned, on a later loop iteration (NestJS
                ``{async: true}``).
            propagate_errors: Let ``emit_async`` raise this listener's error (plain ``emit``
                still only logs it).

        Returns:
            The subscription; call it (or its ``unsubscribe()``) to remove the listener.

        Raises:
            InvalidEventNameError: A bad name or pattern (``a..b``, ``a.**b``, NUL, > 255 chars).
            InvalidListenerError: Not callable, non-bool options, or ``deferred`` together with
                ``propagate_errors`` (nobody awaits a deferred listener).
        """
        segments = parse_pattern(pattern)
        if not callable(listener):
            raise InvalidListenerError(listener, "must be callable")
        for option, value in (("deferred", deferred), ("propagate_errors", propagate_errors)):
            boolean(option, value, error=lambda r: InvalidListenerError(listener, r.message))
        if deferred and propagate_errors:
            raise InvalidListenerError(
                listener,
                "deferred=True with propagate_errors=True: nobody awaits a deferred listener, "
                "so its error can only be logged",
            )
        subscription = Subscription(
            self, pattern, segments, listener, deferred=deferred, propagate_errors=propagate_errors
        )
        self._subscriptions.append(subscription)
        self._cache.clear()
        return subscription

    def listener(
        self, pattern: str, *, deferred: bool = False, propagate_errors: bool = False
    ) -> Callable[[L], L]:
        """Register the decorated function like :meth:`on` (NestJS ``@OnEvent``).

        The function is returned unchanged; remove it with ``bus.off(pattern, function)``.

        Raises:
            InvalidEventNameError: At decoration time, for a bad pattern.
        """
        parse_pattern(pattern)

        def register(function: L) -> L:
            self.on(pattern, function, deferred=deferred, propagate_errors=propagate_errors)
            return function

        return register

    def off(self, pattern: str, listener: Listener | None = None) -> int:
        """Remove ``listener`` (compared with ``==``) registered for exactly ``pattern``.

        Args:
            pattern: The pattern as registered (``off("task.*")`` does not touch ``"task.a"``).
            listener: The listener; ``None`` removes every listener of ``pattern``.

        Returns:
            How many registrations were removed (0 is not an error).

        Raises:
            InvalidEventNameError: A bad pattern (it could not have been registered).
        """
        parse_pattern(pattern)
        doomed = [
            s
            for s in self._subscriptions
            if s.pattern == pattern and (listener is None or s.listener == listener)
        ]
        for subscription in doomed:
            self._unsubscribe(subscription)
        return len(doomed)

    def listeners(self, name: str) -> list[Subscription]:
        """Return the subscriptions an emit of ``name`` would call, in registration order.

        Raises:
            InvalidEventNameError: ``name`` is not a valid emitted name.
        """
        text = validate_name(name)
        segments = text.split(".")
        return [s for s in self._subscriptions if s.matches(text, segments)]

    def _unsubscribe(self, subscription: Subscription) -> bool:
        if not subscription._active:
            return False
        subscription._active = False
        self._subscriptions.remove(subscription)
        self._cache.clear()
        return True

    # -- emitting -------------------------------------------------------------------------------

    def emit(self, name: str, event: object) -> bool:
        """Deliver ``event`` (passed through unchanged) to every listener matching ``name``.

        Plain listeners run now, in registration order; coroutine listeners are started as tasks;
        deferred listeners run after this call returned. Listener errors are logged, never raised.
        No name is special: unlike EventEmitter2, an ``"error"`` event nobody listens to is not
        raised (it returns ``False``, or raises :class:`UnknownEventError` on a strict bus).

        Args:
            name: The concrete event name (no wildcards).
            event: The event object, ideally a frozen dataclass.

        Returns:
            Whether any listener matched.

        Raises:
            InvalidEventNameError: A bad name.
            UnknownEventError: ``strict`` bus and no listener matches.
            EventLoopRequiredError: Called without a running loop while a matching listener is a
                coroutine or deferred; then no listener at all was called.
        """
        try:
            immediate, deferred, needs_loop = self._cache[name]
        except (KeyError, TypeError):
            immediate, deferred, needs_loop = self._resolve(name)
        if not immediate and not deferred:
            self._unheard(name)
            return False
        loop = self._require_loop(name, immediate, deferred) if needs_loop else None
        for subscription in immediate:
            if not subscription._active:
                continue
            try:
                result = subscription._callback(event)
            except Exception as exc:  # noqa: BLE001 - a listener never breaks the emitter
                self._background.failed(name, subscription, exc)
                continue
            if result is not None and (subscription._is_async or inspect.isawaitable(result)):
                self._background.spawn(loop, name, subscription, result)
        if deferred and loop is not None:
            self._background.defer(loop, name, event, deferred)
        return True

    async def emit_async(self, name: str, event: object) -> list[Any]:
        """Deliver ``event`` and wait for every non-deferred listener; return their results.

        Plain listeners run first, in order; coroutine listeners run concurrently as tasks.
        Deferred listeners are scheduled as with :meth:`emit` and not awaited. After all awaited
        listeners finished, the first error (in registration order) of a listener registered with
        ``propagate_errors=True`` is raised; every other error is logged.

        Args:
            name: The concrete event name.
            event: The event object.

        Returns:
            One result per non-deferred listener that ran, in registration order (``None`` for
            a listener whose error was logged; a listener unsubscribed before its turn has no
            slot).

        Raises:
            InvalidEventNameError: A bad name.
            UnknownEventError: ``strict`` bus and no listener matches.
            Exception: The first propagated listener error.
            asyncio.CancelledError: This call was cancelled: running listeners are cancelled and
                awaited first.
        """
        immediate, deferred, _ = self._resolve(name)
        if not immediate and not deferred:
            self._unheard(name)
            return []
        loop = asyncio.get_running_loop()
        ran: list[Subscription] = []
        results: list[Any] = []
        errors: dict[int, BaseException] = {}
        waiting: dict[asyncio.Future[Any], int] = {}
        try:
            for subscription in immediate:
                if not subscription._active:
                    continue
                index = len(ran)
                ran.append(subscription)
                results.append(None)
                try:
                    result = subscription._callback(event)
                except Exception as exc:  # noqa: BLE001 - settled below
                    errors[index] = exc
                    continue
                if result is not None and (subscription._is_async or inspect.isawaitable(result)):
                    waiting[self._background.start(loop, name, subscription, result)] = index
                else:
                    results[index] = result
            if deferred:
                self._background.defer(loop, name, event, deferred)
            if waiting:
                await asyncio.wait(waiting)
        except BaseException:
            await self._background.abandon(name, ran, waiting)
            raise
        for future, index in waiting.items():
            try:
                results[index] = future.result()
            except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - settled below
                errors[index] = exc
        raised: BaseException | None = None
        for index in sorted(errors):
            subscription, error = ran[index], errors[index]
            if subscription._propagate and raised is None:
                raised = error
            else:
                self._background.failed(name, subscription, error)
        if raised is not None:
            raise raised
        return results

    # -- background work ------------------------------------------------------------------------

    async def drain(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109 - shutdown API
        """Wait until every background listener (coroutine or deferred) of this loop finished.

        Work started while draining (a listener emitting again) is waited for too. The calling
        task itself is never waited for, so a listener may call ``drain``.

        Args:
            timeout: Seconds to wait; ``None`` waits as long as it takes.

        Returns:
            ``True`` if everything finished; ``False`` if the timeout expired: what was still
            running was then cancelled, awaited and logged (``action="drain_timeout"``).
        """
        return await self._background.drain(timeout)

    async def __aenter__(self) -> Self:
        """Return the bus; leaving the block drains it."""
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Wait for every background listener (no timeout: use :meth:`drain` for a bound)."""
        await self.drain()

    def __repr__(self) -> str:
        return (
            f"<EventBus listeners={len(self._subscriptions)} pending={self.pending} "
            f"strict={self._strict}>"
        )

    # -- internals ------------------------------------------------------------------------------

    def _resolve(self, name: object) -> _Entry:
        try:
            return self._cache[name]  # type: ignore[index]
        except (KeyError, TypeError):
            pass
        text = validate_name(name)
        segments = text.split(".")
        matched = [s for s in self._subscriptions if s.matches(text, segments)]
        immediate = tuple(s for s in matched if not s._deferred)
        deferred = tuple(s for s in matched if s._deferred)
        entry = (immediate, deferred, bool(deferred) or any(s._is_async for s in immediate))
        if len(self._cache) >= CACHE_LIMIT:
            self._cache.clear()
        self._cache[text] = entry
        return entry

    def _unheard(self, name: str) -> None:
        if self._strict:
            patterns = list(dict.fromkeys(s.pattern for s in self._subscriptions))
            raise UnknownEventError(name, difflib.get_close_matches(name, patterns, n=3))
        self._log.debug(
            "Event: no listener for %r", name, extra={"action": "no_listener", "event": name}
        )

    def _require_loop(
        self, name: str, immediate: Iterable[Subscription], deferred: Iterable[Subscription]
    ) -> asyncio.AbstractEventLoop:
        try:
            return asyncio.get_running_loop()
        except RuntimeError:
            needy = [s._description for s in (*immediate, *deferred) if s._is_async or s._deferred]
            raise EventLoopRequiredError(name, needy) from None
