"""A tiny application module for the ``sdcore schedules`` CLI tests."""

from __future__ import annotations

from sdcore.scheduling import CronExpression, Scheduler, Tick

scheduler = Scheduler(time_zone="Europe/Paris")


@scheduler.cron(CronExpression.EVERY_DAY_AT_1AM, name="mark-overdue-tasks")
async def mark_overdue(tick: Tick) -> None:
    """Nightly job."""


@scheduler.interval(60_000, name="refresh-stats")
def refresh(tick: Tick) -> None:
    """Every minute."""


def make_scheduler() -> Scheduler:
    """A factory, as some applications expose."""
    return scheduler


not_a_scheduler = 42
