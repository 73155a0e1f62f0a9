"""Time: an injectable UTC clock and the business day, which is the calendar day in Paris.

Inside, every instant is an aware UTC ``datetime``; the Paris zone appears only where a calendar
day is needed (the overdue job) and where the cron expression is evaluated.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, date, datetime
from zoneinfo import ZoneInfo

APP_TIME_ZONE = "Europe/Paris"
_PARIS = ZoneInfo(APP_TIME_ZONE)

Clock = Callable[[], datetime]
"""Returns the current instant, aware, in UTC. Tests pass ``lambda: FIXED``."""


def utc_now() -> datetime:
    """The production clock."""
    return datetime.now(UTC)


def business_day(instant: datetime) -> date:
    """Return the calendar day in Paris at ``instant``.

    ``instant.date()`` on a UTC value would be the UTC day: at 01:00 in Paris in summer it is
    still 23:00 the day before in UTC, and a task due yesterday would turn overdue a day late.

    Raises:
        ValueError: ``instant`` is naive (its zone would be guessed).
    """
    if instant.tzinfo is None or instant.utcoffset() is None:
        raise ValueError("instant must be an aware datetime")
    return instant.astimezone(_PARIS).date()
