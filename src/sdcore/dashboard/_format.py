"""Jinja2 filters of the dashboard: times in UTC, ages, durations, one-line errors."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

MAX_ERROR = 300


def when(value: datetime | None) -> str:
    """``2026-12-01 08:00:00Z`` (UTC), or ``—``."""
    if value is None:
        return "—"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def iso(value: datetime | None) -> str:
    """ISO 8601 in UTC for ``<time datetime=…>``."""
    return "" if value is None else value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def age(value: timedelta | None) -> str:
    """A short age: ``850 ms``, ``12 s``, ``4 min``, ``3 h``, ``2 d``."""
    if value is None:
        return "—"
    seconds = value.total_seconds()
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))} ms"
    for size, unit in ((86_400, "d"), (3_600, "h"), (60, "min")):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def since(value: datetime | None) -> str:
    """How long ago ``value`` was (``—`` for none)."""
    return "—" if value is None else age(datetime.now(UTC) - value)


def until(value: datetime | None) -> str:
    """How long until ``value`` (``now`` when passed)."""
    if value is None:
        return "—"
    left = value - datetime.now(UTC)
    return "now" if left <= timedelta(0) else "in " + age(left)


def one_line(value: object, limit: int = MAX_ERROR) -> str:
    """An error or text on one line, cut to ``limit`` characters."""
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def hour(value: datetime) -> str:
    """``13:00`` (UTC)."""
    return value.astimezone(UTC).strftime("%H:%M")


FILTERS: dict[str, Callable[..., Any]] = {
    "when": when,
    "iso": iso,
    "age": age,
    "since": since,
    "until": until,
    "one_line": one_line,
    "hour": hour,
}
