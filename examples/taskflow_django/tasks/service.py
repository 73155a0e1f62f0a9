"""The status change that notifies.

The rule the example is about: ``task.status.changed`` is emitted only once the change is
committed (``transaction.on_commit``: a rollback, of this block or of an outer one, drops it),
while the crash-safe notification job is written *inside* the transaction, through the outbox,
so that it commits or rolls back with the change.
"""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from tasks import notifications
from tasks.events import TASK_STATUS_CHANGED, TaskStatusChanged, bus
from tasks.models import Status, Task

# What a client may set; OVERDUE belongs to the nightly job.
SETTABLE = frozenset({Status.TODO, Status.IN_PROGRESS, Status.DONE})


def change_status(task_id: int, status: str) -> Task:
    """Set a task's status; once committed, emit ``task.status.changed``.

    The same status writes nothing and emits nothing.

    Raises:
        ValueError: A status a client may not set.
        Task.DoesNotExist: No such task.
    """
    if status not in SETTABLE:
        raise ValueError(f"status must be one of {', '.join(sorted(SETTABLE))}, got {status!r}")
    with transaction.atomic():
        # FOR UPDATE: two changes of one task are serialized, so "from" is exact and each
        # change gets its own version (and notification job id).
        task: Task = Task.objects.select_for_update().get(pk=task_id)
        if task.status == status:
            return task
        event = TaskStatusChanged(
            task_id=task.pk,
            from_status=task.status,
            to_status=status,
            version=task.version + 1,
            occurred_at=timezone.now(),
        )
        task.status = status
        task.version = event.version
        task.save(update_fields=["status", "version"])
        if notifications.queued():
            notifications.stage(task, event)
        transaction.on_commit(lambda: bus.emit(TASK_STATUS_CHANGED, event))
    return task
