"""``Subscription``: one registered listener, and the handle that unsubscribes it."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, final

from sdcore.events._patterns import match_segments

if TYPE_CHECKING:
    from sdcore.events._bus import EventBus

Listener = Callable[[Any], Any]
"""A listener: called with the event object; ``def`` or ``async def``; its result is kept only by
``emit_async``."""


def describe(listener: object) -> str:
    """Return a listener's qualified name for logs (``module.Class.method``)."""
    if isinstance(listener, functools.partial):
        return f"functools.partial({describe(listener.func)})"
    target = listener if hasattr(listener, "__qualname__") else type(listener)
    module = getattr(target, "__module__", None) or "?"
    qualname = getattr(target, "__qualname__", None) or type(listener).__qualname__
    return f"{module}.{qualname}"


def is_coroutine_listener(listener: object) -> bool:
    """Return whether calling ``listener`` returns a coroutine (``async def``, also as a partial,
    a bound method or an object with ``async def __call__``)."""
    if inspect.iscoroutinefunction(listener):
        return True
    call = getattr(listener, "__call__", None)  # noqa: B004 - the async __call__ of an instance
    return call is not None and inspect.iscoroutinefunction(call)


@final
class Subscription:
    """A registered listener; calling it (or :meth:`unsubscribe`) removes it from its bus.

    Returned by :meth:`EventBus.on`. Once unsubscribed the listener is never called again, not even
    by an ``emit`` already in progress or a deferred call already scheduled (a coroutine already
    started keeps running).
    """

    # The bus reads these slots directly on every emit: plain attribute loads, no properties.
    __slots__ = (
        "_active",
        "_bus",
        "_callback",
        "_deferred",
        "_description",
        "_is_async",
        "_pattern",
        "_propagate",
        "_segments",
    )

    def __init__(
        self,
        bus: EventBus,
        pattern: str,
        segments: tuple[str, ...] | None,
        callback: Listener,
        *,
        deferred: bool,
        propagate_errors: bool,
    ) -> None:
        self._bus = bus
        self._pattern = pattern
        self._segments = segments
        self._callback = callback
        self._is_async = is_coroutine_listener(callback)
        self._deferred = deferred
        self._propagate = propagate_errors
        self._description = describe(callback)
        self._active = True

    @property
    def pattern(self) -> str:
        """The name or wildcard pattern the listener was registered for."""
        return self._pattern

    @property
    def listener(self) -> Listener:
        """The registered callable, unchanged."""
        return self._callback

    @property
    def deferred(self) -> bool:
        """Whether the listener runs after ``emit`` returns, on a later loop iteration."""
        return self._deferred

    @property
    def propagate_errors(self) -> bool:
        """Whether ``emit_async`` re-raises the listener's error."""
        return self._propagate

    @property
    def active(self) -> bool:
        """``False`` once unsubscribed."""
        return self._active

    def matches(self, name: str, segments: list[str]) -> bool:
        """Return whether the emitted ``name`` (split in ``segments``) matches this pattern."""
        if self._segments is None:
            return name == self._pattern
        return match_segments(self._segments, segments)

    def unsubscribe(self) -> bool:
        """Remove the listener from its bus.

        Returns:
            ``True`` if this call removed it, ``False`` if it was already removed.
        """
        return self._bus._unsubscribe(self)

    def __call__(self) -> bool:
        """Same as :meth:`unsubscribe`, so the handle works as an "unsubscribe" function."""
        return self.unsubscribe()

    def __repr__(self) -> str:
        flags = "".join(
            f", {flag}=True"
            for flag, on in (("deferred", self._deferred), ("propagate_errors", self._propagate))
            if on
        )
        state = "" if self._active else ", inactive"
        return f"<Subscription {self._pattern!r} -> {self._description}{flags}{state}>"
