"""Notifications of status changes: which path does what.

Two paths, chosen by whether ``REDIS_URL`` is set:

- **No Redis (simulated)**: after the commit, ``task.status.changed`` reaches
  :class:`NotificationsListener`, which "sends" a simulated e-mail (a log line). In memory only: a
  crash between the commit and the listener loses it, as in the seed.
- **Redis (queued, crash-safe)**: *before* the commit, inside the status change's transaction,
  :class:`NotificationOutbox` writes a ``task-status-changed`` job for the ``notifications``
  queue into the outbox. Commit and job are one atomic write: a rollback leaves no job, a crash
  after the commit loses nothing, because sdcore's outbox relay publishes the row to BullMQ (in
  any replica, with a job id derived from the idempotency key, so a re-publish is a no-op). The
  ``NotificationsProcessor`` (``taskflow.queueing``) sends the e-mail with retries. The event
  after the commit still reaches the listener, which then only logs that the job is queued.

This module never imports ``sdcore.queues``; only ``taskflow.queueing`` does.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sdcore.outbox import Outbox, check_options
from sdcore.sqlalchemy import enqueue_once
from sqlalchemy.ext.asyncio import AsyncSession

from taskflow.events import TaskStatusChanged

NOTIFICATIONS_QUEUE = "notifications"
JOB_NAME = "task-status-changed"
_log = logging.getLogger(__name__)

Notifier = Callable[[TaskStatusChanged], Awaitable[None]]
"""What the listener calls on the simulated path (tests inject one that fails)."""


def job_options(*, attempts: int = 5, backoff_ms: int = 1000) -> dict[str, Any]:
    """BullMQ options of a notification job, validated by sdcore's outbox.

    ``attempts`` tries with exponential backoff (``2^(n-1) × backoff_ms``: 1, 2, 4, 8 s by
    default); the last 1,000 completed jobs are kept; failed ones a week, for inspection.
    """
    return check_options(
        {
            "attempts": attempts,
            "backoff": {"type": "exponential", "delay": backoff_ms},
            "removeOnComplete": {"count": 1000},
            "removeOnFail": {"age": 7 * 24 * 3600},
        }
    )


def job_payload(event: TaskStatusChanged, *, recipient: str) -> dict[str, str]:
    """The job's data: JSON, camelCase like the seed's ``NotificationJob``."""
    return {
        "taskId": str(event.task_id),
        "projectId": str(event.project_id),
        "from": event.from_status.value,
        "to": event.to_status.value,
        "changedBy": str(event.changed_by),
        "recipient": recipient,
        "occurredAt": event.occurred_at.isoformat(),
    }


class NotificationOutbox:
    """The crash-safe path: the notification job, written in the caller's transaction.

    Args:
        outbox: sdcore's outbox (``sd.outbox``).
        options: BullMQ job options (see :func:`job_options`).
    """

    def __init__(self, outbox: Outbox, *, options: Mapping[str, Any] | None = None) -> None:
        self._outbox = outbox
        self.options = dict(options) if options is not None else job_options()

    async def stage(
        self, session: AsyncSession, event: TaskStatusChanged, *, recipient: str, version: int
    ) -> bool:
        """Write the job into the outbox through ``session`` (joins its transaction).

        Args:
            session: The session of the status change, inside its transaction.
            event: The change (not committed yet).
            recipient: Who gets the e-mail.
            version: The task's version after the change: with the task id it names this
                change, so the job id is the same however often the row is relayed.

        Returns:
            ``True`` if written, ``False`` if this change was already staged.
        """
        return await enqueue_once(
            self._outbox,
            session,
            idempotency_key=f"{JOB_NAME}:{event.task_id}:v{version}",
            queue=NOTIFICATIONS_QUEUE,
            name=JOB_NAME,
            payload=job_payload(event, recipient=recipient),
            options=self.options,
        )


async def simulated_email(event: TaskStatusChanged) -> None:
    """The simulated path's "send": one log line."""
    _log.info(
        "[simulated email] task %s: %s -> %s",
        event.task_id,
        event.from_status.value,
        event.to_status.value,
        extra={"action": "simulated_email", "task_id": str(event.task_id)},
    )


class NotificationsListener:
    """Consumes ``task.status.changed`` after the commit (NestJS ``@OnEvent(..., {async: true})``).

    Registered as a *deferred* listener: it runs after ``emit`` returned, so it never slows the
    request, and its errors are caught and logged here with the task id (nobody awaits it, so an
    error not logged here would only show up without business context).

    Args:
        queued: Redis is configured: the job was already written to the outbox by the service.
        notify: The simulated path's sender (default :func:`simulated_email`).
    """

    def __init__(self, *, queued: bool, notify: Notifier = simulated_email) -> None:
        self._queued = queued
        self._notify = notify

    async def __call__(self, event: TaskStatusChanged) -> None:
        """Handle one event; never raises."""
        try:
            if self._queued:
                _log.debug(
                    "task %s: notification job is in the outbox (queue %r)",
                    event.task_id,
                    NOTIFICATIONS_QUEUE,
                    extra={"action": "notification_queued", "task_id": str(event.task_id)},
                )
                return
            await self._notify(event)
        except Exception as exc:  # noqa: BLE001 - a notification must never undo the change
            _log.error(
                "notification for task %s failed: %s: %s",
                event.task_id,
                type(exc).__name__,
                str(exc)[:300],
                exc_info=exc,
                extra={"action": "notification_failed", "task_id": str(event.task_id)},
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class Email:
    """One e-mail the processor sends."""

    recipient: str
    task_id: str
    status: str
    attempt: int


EmailSender = Callable[[Email], Awaitable[None]]
"""How the processor sends an e-mail; raising fails the attempt (BullMQ retries the job)."""


async def log_email(email: Email) -> None:
    """The default sender: a log line instead of an e-mail provider."""
    _log.info(
        "Email to %s: task %s is now %s (attempt %d)",
        email.recipient,
        email.task_id,
        email.status,
        email.attempt,
        extra={"action": "email_sent", "task_id": email.task_id, "attempt": email.attempt},
    )
