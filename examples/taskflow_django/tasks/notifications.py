"""Notifications of status changes: which path does what.

Two paths, chosen by whether ``SDCORE["REDIS_URL"]`` is set (``get_runtime().queues_enabled``):

- **No Redis (simulated)**: after the commit, ``task.status.changed`` reaches
  :func:`on_status_changed`, which "sends" the e-mail as a log line. In memory only: a crash
  between the commit and the listener loses it.
- **Redis (queued, crash-safe)**: inside the status change's transaction, :func:`stage` writes a
  ``task-status-changed`` job into sdcore's outbox (``enqueue_once``). Change and job commit or
  roll back together; ``manage.py sdcore run`` relays the row to BullMQ (job id from the
  idempotency key, so a re-publish is a no-op) and ``tasks.processors`` sends the e-mail, with
  retries. The event after the commit still reaches the listener, which then only logs that
  the job is queued.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from sdcore.django import enqueue_once, get_runtime
from sdcore.outbox import check_options

from tasks.events import TaskStatusChanged
from tasks.models import Task

JOB_NAME = "task-status-changed"
_log = logging.getLogger(__name__)


def queued() -> bool:
    """Whether notifications go through the outbox and BullMQ (Redis is configured)."""
    return get_runtime().queues_enabled


def job_options(*, attempts: int = 5, backoff_ms: int = 1000) -> dict[str, Any]:
    """BullMQ options of a notification job, validated by sdcore's outbox: ``attempts`` tries
    with exponential backoff; the last 1,000 completed jobs kept, failed ones a week."""
    return check_options(
        {
            "attempts": attempts,
            "backoff": {"type": "exponential", "delay": backoff_ms},
            "removeOnComplete": {"count": 1000},
            "removeOnFail": {"age": 7 * 24 * 3600},
        }
    )


def stage(task: Task, event: TaskStatusChanged) -> bool:
    """Write the notification job into the outbox, in the caller's ``transaction.atomic()``.

    The task id and its version after the change name this change, so the job id is the same
    however often the row is relayed. Returns ``False`` if this change was already staged.
    """
    return enqueue_once(
        idempotency_key=f"{JOB_NAME}:{event.task_id}:v{event.version}",
        queue=settings.TASKFLOW_NOTIFY_QUEUE,
        name=JOB_NAME,
        payload={
            "taskId": event.task_id,
            "from": event.from_status,
            "to": event.to_status,
            "recipient": task.owner_email,
            "occurredAt": event.occurred_at.isoformat(),
        },
        options=job_options(),
    )


def on_status_changed(event: TaskStatusChanged) -> None:
    """The listener of ``task.status.changed``, run after the commit."""
    if queued():
        _log.debug("task %s: notification job is in the outbox", event.task_id)
        return
    _log.info(
        "[simulated email] task %s: %s -> %s", event.task_id, event.from_status, event.to_status
    )
