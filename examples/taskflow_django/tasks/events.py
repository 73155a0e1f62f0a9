"""The ``task.status.changed`` event and the in-process bus it goes through.

The bus is sdcore's :class:`~sdcore.events.EventBus`; its listeners here are plain functions,
so ``emit`` runs them in the request's thread, without an event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sdcore.events import EventBus

# Event names are plain strings (a typo matches no listener and raises nothing): keep them here.
TASK_STATUS_CHANGED = "task.status.changed"

bus = EventBus(logger_name="tasks.events")


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskStatusChanged:
    """A task's status changed, and the change is committed.

    Attributes:
        task_id: The task.
        from_status: The status before.
        to_status: The status after.
        version: The task's version after the change.
        occurred_at: When (aware UTC).
    """

    task_id: int
    from_status: str
    to_status: str
    version: int
    occurred_at: datetime
