"""The periodic tasks the importer's tests read: one per case it maps or skips."""

import json
from datetime import timedelta

from django.utils import timezone
from django_celery_beat.models import (
    ClockedSchedule,
    CrontabSchedule,
    IntervalSchedule,
    PeriodicTask,
    SolarSchedule,
)


def create() -> int:
    """Create them; return how many periodic tasks there are."""
    weekdays = CrontabSchedule.objects.create(
        minute="0", hour="8", day_of_week="mon-fri", timezone="Europe/Paris"
    )
    early = CrontabSchedule.objects.create(minute="30", hour="6")
    both = CrontabSchedule.objects.create(
        minute="0", hour="0", day_of_month="1", day_of_week="monday"
    )
    second = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.SECONDS)
    hourly = IntervalSchedule.objects.create(every=2, period=IntervalSchedule.HOURS)
    tiny = IntervalSchedule.objects.create(every=1500, period=IntervalSchedule.MICROSECONDS)
    sun = SolarSchedule.objects.create(event="sunrise", latitude=48.85, longitude=2.35)
    once = ClockedSchedule.objects.create(clocked_time=timezone.now() + timedelta(days=1))
    report = "reports.tasks.send_report"
    PeriodicTask.objects.create(
        name="daily-report", task=report, crontab=weekdays, kwargs=json.dumps({"full": True})
    )
    PeriodicTask.objects.create(name="disabled-digest", task=report, crontab=early, enabled=False)
    PeriodicTask.objects.create(
        name="heartbeat", task="beat.heartbeat", interval=second, args='[1, "x"]'
    )
    PeriodicTask.objects.create(name="unregistered", task="nobody.registers", interval=hourly)
    PeriodicTask.objects.create(name="sunrise", task=report, solar=sun)
    PeriodicTask.objects.create(name="launch", task=report, clocked=once, one_off=True)
    PeriodicTask.objects.create(
        name="routed", task=report, interval=hourly, queue="reports", priority=5
    )
    PeriodicTask.objects.create(name="both-days", task=report, crontab=both)
    PeriodicTask.objects.create(name="one-off", task=report, interval=hourly, one_off=True)
    PeriodicTask.objects.create(name="bad-json", task=report, interval=hourly, kwargs="{not json")
    PeriodicTask.objects.create(name="sub-ms", task=report, interval=tiny)
    PeriodicTask.objects.create(
        name="later", task=report, interval=hourly, start_time=timezone.now() + timedelta(days=2)
    )
    PeriodicTask.objects.create(
        name="expired", task=report, interval=hourly, expires=timezone.now() - timedelta(days=2)
    )
    return int(PeriodicTask.objects.count())
