"""How one django-celery-beat periodic task maps to a stored schedule (no database)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from sdcore.django._celery_beat import Skipped, StoredSchedule, plan_task

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


def _crontab(**fields: str) -> SimpleNamespace:
    values = {
        "minute": "0",
        "hour": "8",
        "day_of_month": "*",
        "month_of_year": "*",
        "day_of_week": "*",
        "timezone": "Europe/Paris",
    }
    return SimpleNamespace(**{**values, **fields})


def _task(**fields: Any) -> SimpleNamespace:
    values: dict[str, Any] = {
        "name": "report",
        "task": "reports.send",
        "crontab_id": None,
        "crontab": None,
        "interval_id": None,
        "interval": None,
        "solar_id": None,
        "clocked_id": None,
        "args": "[]",
        "kwargs": "{}",
        "queue": None,
        "exchange": None,
        "routing_key": None,
        "priority": None,
        "headers": "{}",
        "expire_seconds": None,
        "expires": None,
        "one_off": False,
        "start_time": None,
        "enabled": True,
    }
    values.update(fields)
    if values["crontab"] is not None:
        values["crontab_id"] = 1
    if values["interval"] is not None:
        values["interval_id"] = 1
    return SimpleNamespace(**values)


@pytest.mark.parametrize(
    ("fields", "cron"),
    [
        ({}, "0 8 * * *"),
        ({"day_of_week": "monday,Wednesday"}, "0 8 * * mon,Wed"),
        ({"day_of_week": "mon-fri", "day_of_month": "*/2"}, "0 8 */2 * mon-fri"),
        ({"day_of_month": "1-7", "hour": "*/3"}, "0 */3 1-7 * *"),
    ],
    ids=["daily", "day-names", "star-step-dom", "hour-step"],
)
def test_crontabs(fields: dict[str, str], cron: str) -> None:
    plan = plan_task(_task(crontab=_crontab(**fields), args="[1]", kwargs='{"a": 2}'), now=NOW)
    assert plan == StoredSchedule(
        name="report",
        handler="reports.send",
        cron=cron,
        time_zone="Europe/Paris",
        args={"args": [1], "kwargs": {"a": 2}},
    )


@pytest.mark.parametrize(
    ("every", "period", "every_ms"),
    [(3, "days", 259_200_000), (1, "seconds", 1000), (2000, "microseconds", 2)],
    ids=["days", "seconds", "microseconds"],
)
def test_intervals(every: int, period: str, every_ms: int) -> None:
    interval = SimpleNamespace(every=every, period=period)
    plan = plan_task(_task(interval=interval, enabled=False), now=NOW)
    assert isinstance(plan, StoredSchedule)
    assert (plan.every_ms, plan.cron, plan.time_zone, plan.paused) == (every_ms, None, "UTC", True)


HOURLY = SimpleNamespace(every=1, period="hours")


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"crontab": _crontab(minute="61")}, "schedule 'report': invalid cron expression '61 8"),
        ({"crontab": _crontab(timezone="Mars/Base")}, "schedule 'report': unknown time zone"),
        ({"crontab": _crontab(minute="0 5")}, "crontab fields"),
        ({"crontab": _crontab(day_of_month="1", day_of_week="0-6")}, "day_of_month='1' and"),
        ({"interval": SimpleNamespace(every=1, period="fortnights")}, "unknown interval period"),
        ({"interval": HOURLY, "name": " padded"}, "schedule name must be a non-empty trimmed"),
        ({"interval": HOURLY, "task": ""}, "the task '' cannot name a handler: schedule name"),
        ({"interval": HOURLY, "args": '{"a": 1}'}, "args must be a JSON list"),
        ({"interval": HOURLY, "kwargs": "[1]"}, "kwargs must be a JSON dict"),
        (
            {"interval": HOURLY, "headers": '{"h": 1}'},
            "Celery routing or message options (headers)",
        ),
        ({"interval": HOURLY, "expire_seconds": 30}, "Celery routing or message options"),
        ({"interval": HOURLY, "start_time": NOW + timedelta(seconds=1)}, "starts at "),
        ({"interval": HOURLY, "expires": NOW}, "expired at "),
        ({"interval": HOURLY, "expires": NOW + timedelta(days=1)}, "ends at "),
        ({}, "no crontab or interval schedule"),
    ],
    ids=[
        "bad-minute",
        "bad-zone",
        "spaces",
        "both-days",
        "bad-period",
        "bad-name",
        "bad-task",
        "args-object",
        "kwargs-list",
        "headers",
        "expire-seconds",
        "future-start",
        "expired",
        "ends-later",
        "no-schedule",
    ],
)
def test_skipped(fields: dict[str, Any], reason: str) -> None:
    plan = plan_task(_task(**fields), now=NOW)
    assert isinstance(plan, Skipped)
    assert plan.reason.startswith(reason), plan.reason


def test_routing_is_dropped_when_asked_and_a_past_start_is_ignored() -> None:
    task = _task(interval=HOURLY, queue="q", priority=0, start_time=NOW - timedelta(days=1))
    assert isinstance(plan_task(task, now=NOW), Skipped)
    plan = plan_task(task, now=NOW, ignore_routing=True)
    assert isinstance(plan, StoredSchedule)
    assert plan.every_ms == 3_600_000
    assert plan.commands() == [
        "manage.py sdcore schedules create report --handler reports.send --every-ms 3600000"
        """ --args '{"args": [], "kwargs": {}}' --reason 'imported from django-celery-beat'"""
    ]
