"""The BullMQ side: the processor of the notification queue (with Redis only).

``apps.TasksConfig.ready`` hands it to the process's Runtime when Redis is configured;
``manage.py sdcore run`` then runs it. This is the one module that imports ``sdcore.queues``.
"""

from __future__ import annotations

import logging
from typing import Any

from asgiref.sync import sync_to_async
from django.db import close_old_connections
from sdcore.queues import Job, Processor

from tasks.models import SentEmail, Task

_log = logging.getLogger(__name__)


def record_email(*, job_id: str, task_id: int, recipient: str, status: str, attempt: int) -> bool:
    """Send (a log line) and record one e-mail; ``False`` if this job was already sent, or if
    the task was deleted since (nobody to tell: the job succeeds without an e-mail)."""
    close_old_connections()
    try:
        if not Task.objects.filter(pk=task_id).exists():
            _log.info("task %s is gone: no e-mail for job %s", task_id, job_id)
            return False
        _, created = SentEmail.objects.get_or_create(
            job_id=job_id,
            defaults={
                "task_id": task_id,
                "recipient": recipient,
                "status": status,
                "attempt": attempt,
            },
        )
    finally:
        close_old_connections()
    if created:
        _log.info(
            "Email to %s: task %s is now %s (attempt %d)", recipient, task_id, status, attempt
        )
    return bool(created)


class NotificationsProcessor(Processor):
    """Sends the e-mail of a ``task-status-changed`` job.

    Raising fails the attempt and BullMQ retries the job with the backoff set when it was added
    (``notifications.job_options``). BullMQ delivers at least once: the unique ``job_id`` of
    :class:`~tasks.models.SentEmail` makes a repeat a no-op.

    Args:
        queue: The queue name (``settings.TASKFLOW_NOTIFY_QUEUE``).
    """

    concurrency = 5

    def __init__(self, queue: str) -> None:
        self.queue = queue

    async def process(self, job: Job) -> Any:
        data = job.data
        await sync_to_async(record_email)(
            job_id=str(job.id),
            task_id=int(data["taskId"]),
            recipient=str(data["recipient"]),
            status=str(data["to"]),
            attempt=int(job.attemptsMade or 0) + 1,
        )
        return None
