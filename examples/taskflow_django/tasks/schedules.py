"""``mark-overdue-tasks``: every night at 01:00 Paris time, on exactly one worker.

One ``UPDATE`` marks every open task (``TODO``/``IN_PROGRESS``) whose due date is before *today
in Paris* as ``OVERDUE``. It is idempotent (``OVERDUE`` tasks are not open), and sdcore's lease
makes it exclusive: every ``manage.py sdcore run`` replica fires the tick, one runs it. "Today"
comes from the tick's *scheduled* instant, not the wall clock, so a retry or a catch-up run
computes the same day. No ``task.status.changed`` is emitted for these changes.
"""

from __future__ import annotations

import logging
from datetime import date, datetime
from zoneinfo import ZoneInfo

from django.conf import settings
from django.db.models import F
from sdcore.django import scheduler
from sdcore.scheduling import Tick

from tasks.models import OPEN_STATUSES, Status, Task

SCHEDULE = "mark-overdue-tasks"
PARIS = ZoneInfo("Europe/Paris")
_log = logging.getLogger(__name__)


def business_day(instant: datetime) -> date:
    """The Paris calendar day of an aware instant."""
    return instant.astimezone(PARIS).date()


def mark_overdue(today: date) -> int:
    """Mark the open tasks due before ``today`` ``OVERDUE``; return how many."""
    marked: int = Task.objects.filter(status__in=OPEN_STATUSES, due_date__lt=today).update(
        status=Status.OVERDUE, version=F("version") + 1
    )
    return marked


# retries=2: a tick that failed (database blip) runs again, never past the next tick.
@scheduler.cron(settings.TASKFLOW_OVERDUE_CRON, name=SCHEDULE, time_zone="Europe/Paris", retries=2)
def mark_overdue_tasks(tick: Tick) -> None:
    today = business_day(tick.scheduled_at)
    marked = mark_overdue(today)
    _log.info("%d task(s) marked OVERDUE (business day %s, run %s)", marked, today, tick.run_key)
