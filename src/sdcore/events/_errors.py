"""The error tree of ``sdcore.events``: every error is also the fitting builtin."""

from __future__ import annotations

from collections.abc import Sequence

from sdcore.exceptions import SdcoreError


def show(value: object, limit: int = 80) -> str:
    """Return ``repr(value)`` cut to ``limit`` characters (names come from callers, maybe huge)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


class EventError(SdcoreError):
    """Base class of every error raised by ``sdcore.events``."""


class InvalidEventNameError(EventError, ValueError):
    """An event name or a listener pattern that the bus refuses.

    Attributes:
        name: The refused name or pattern (as given).
        problem: What is wrong with it.
    """

    def __init__(self, name: object, problem: str) -> None:
        self.name = name
        self.problem = problem
        super().__init__(f"invalid event name {show(name)}: {problem}")


class InvalidListenerError(EventError, TypeError):
    """A listener that cannot be registered: not callable, or options that cannot work together.

    Attributes:
        listener: The refused listener.
        problem: What is wrong with it.
    """

    def __init__(self, listener: object, problem: str) -> None:
        self.listener = listener
        self.problem = problem
        super().__init__(f"invalid listener {show(listener)}: {problem}")


class UnknownEventError(EventError, LookupError):
    """A strict bus was asked to emit an event that no listener matches.

    Attributes:
        event: The emitted name.
        suggestions: Registered patterns that look like it, closest first (maybe empty).
    """

    def __init__(self, event: str, suggestions: Sequence[str]) -> None:
        self.event = event
        self.suggestions = tuple(suggestions)
        if self.suggestions:
            hint = "closest registered: " + ", ".join(show(s) for s in self.suggestions)
        else:
            hint = "no registered pattern looks like it"
        super().__init__(f"no listener for event {show(event)} ({hint})")


class EventLoopRequiredError(EventError, RuntimeError):
    """``emit`` was called outside a running event loop, but some listener needs one.

    Coroutine listeners and deferred listeners are scheduled on the running loop; from plain
    synchronous code there is none. Nothing was called: the check happens before any listener runs.

    Attributes:
        event: The emitted name.
        listeners: Qualified names of the listeners that need a loop.
    """

    def __init__(self, event: str, listeners: Sequence[str]) -> None:
        self.event = event
        self.listeners = tuple(listeners)
        names = ", ".join(self.listeners[:5]) + (", …" if len(self.listeners) > 5 else "")
        super().__init__(
            f"event {show(event)} has coroutine or deferred listeners ({names}) but no event loop "
            "is running in this thread; emit from async code (or use asyncio.run)"
        )
