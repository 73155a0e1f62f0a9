"""In-process application events: a small bus with wildcards, deferred listeners and draining.

The NestJS ``@nestjs/event-emitter`` model in asyncio: ``emit(name, event)`` is synchronous and
returns whether any listener matched; a listener's error is logged and never reaches the emitter
(unless it opted in with ``propagate_errors=True`` and the emitter awaits ``emit_async``); coroutine
and deferred listeners are tasks the bus holds and ``drain()`` waits for. Events live in memory
only: for work that must survive a restart, use the outbox.
"""

from sdcore.events._bus import EventBus
from sdcore.events._errors import (
    EventError,
    EventLoopRequiredError,
    InvalidEventNameError,
    InvalidListenerError,
    UnknownEventError,
)
from sdcore.events._patterns import MAX_EVENT_NAME_LENGTH
from sdcore.events._subscription import Listener, Subscription

__all__ = [
    "MAX_EVENT_NAME_LENGTH",
    "EventBus",
    "EventError",
    "EventLoopRequiredError",
    "InvalidEventNameError",
    "InvalidListenerError",
    "Listener",
    "Subscription",
    "UnknownEventError",
]
