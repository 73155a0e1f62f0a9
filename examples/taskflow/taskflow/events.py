"""The ``task.status.changed`` event: a name in one constant, the content in a frozen class."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from taskflow.db import TaskStatus

# Event names are plain strings (a typo matches no listener and raises nothing): keep them here.
TASK_STATUS_CHANGED = "task.status.changed"


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskStatusChanged:
    """A task's status changed, and the change is committed.

    Attributes:
        task_id: The task.
        project_id: Its project.
        from_status: The status before.
        to_status: The status after.
        changed_by: The user who changed it.
        occurred_at: When (aware UTC, from the service's clock).
    """

    task_id: uuid.UUID
    project_id: uuid.UUID
    from_status: TaskStatus
    to_status: TaskStatus
    changed_by: uuid.UUID
    occurred_at: datetime
