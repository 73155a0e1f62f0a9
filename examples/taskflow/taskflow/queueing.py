"""The BullMQ side: ``NotificationsProcessor``. Imported only when ``REDIS_URL`` is set.

This is the one TaskFlow module that imports ``sdcore.queues`` (hence ``bullmq`` and ``redis``):
``create_app`` imports it lazily, the way the seed loads ``NotificationsQueueModule`` through
``ConditionalModule.registerWhen``.
"""

from __future__ import annotations

import logging
from typing import Any

from sdcore.queues import Job, Processor

from taskflow.notifications import NOTIFICATIONS_QUEUE, Email, EmailSender, log_email

_log = logging.getLogger(__name__)


class NotificationsProcessor(Processor):
    """Sends the e-mail of a ``task-status-changed`` job (NestJS ``@Processor`` + ``WorkerHost``).

    Raising fails the attempt and BullMQ retries the job with the backoff set when it was added
    (``taskflow.notifications.job_options``). BullMQ delivers at least once: a send may repeat
    after a crash, so a real sender passes the job id to its provider as an idempotency key.

    Args:
        send: How to send (default: a log line, ``Email to …: task … is now DONE (attempt n)``).
        concurrency: Jobs processed at once by this process.
    """

    queue = NOTIFICATIONS_QUEUE

    def __init__(self, *, send: EmailSender = log_email, concurrency: int = 5) -> None:
        self._send = send
        self.concurrency = concurrency

    async def process(self, job: Job) -> Any:
        """Send one e-mail; the attempt number is ``attemptsMade + 1``."""
        data = job.data
        await self._send(
            Email(
                recipient=str(data["recipient"]),
                task_id=str(data["taskId"]),
                status=str(data["to"]),
                attempt=int(job.attemptsMade or 0) + 1,
            )
        )
        return None

    async def on_failed(self, job: Job, error: BaseException, final: bool) -> None:
        """Log a failed attempt with the task id (NestJS ``@OnWorkerEvent('failed')``)."""
        task_id = (job.data or {}).get("taskId")
        if final:
            _log.error(
                "Email for task %s failed for good after %d attempt(s): %s: %s",
                task_id,
                job.attemptsMade,
                type(error).__name__,
                str(error)[:300],
                extra={"action": "email_failed_final", "task_id": task_id, "job_id": job.id},
            )
        else:
            _log.warning(
                "Email for task %s failed (attempt %d), BullMQ retries it: %s",
                task_id,
                job.attemptsMade,
                str(error)[:300],
                extra={"action": "email_retry", "task_id": task_id, "job_id": job.id},
            )
