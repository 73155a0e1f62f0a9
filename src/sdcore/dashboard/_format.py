"""Jinja2 filters of the dashboard (times in UTC, ages, durations, one-line errors), and the
parsing of the few values a request carries (a page number, a backfill's instants)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from markupsafe import Markup

MAX_ERROR = 300


class Refused(Exception):
    """A request the dashboard turns down with a status and a message for people."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        self.message = message
        super().__init__(message)


def page_number(text: str) -> int:
    """A positive number of at most 100,000 (a page, a concurrency), or :class:`Refused`."""
    # The length first: int() of thousands of digits is slow, then refused by Python itself.
    if not text.isascii() or not text.isdigit() or len(text) > 6 or not 1 <= int(text) <= 100_000:
        raise Refused(400, "Expected a positive number of at most 100000.")
    return int(text)


def instant(fields: Mapping[str, str], key: str) -> datetime:
    """The ISO 8601 instant in ``fields[key]`` (UTC unless it says otherwise), or ``Refused``."""
    text = fields.get(key, "").strip()
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise Refused(400, f"The backfill's {key!r} must be a date and time (UTC).") from None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


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


def timeline(buckets: Sequence[Any], wide: bool = False) -> Markup:
    """A schedule's hourly buckets as an inline SVG bar strip (one ``<rect>`` per hour).

    Built here rather than in a template: a page holds 50 strips of 24 bars, and a Jinja2 macro
    spent most of the page's time escaping. Every value written is an int, an ``HH:MM`` label
    or a fixed word.
    """
    if not buckets:
        return Markup('<span class="muted">—</span>')
    width, height = (12, 28) if wide else (6, 16)
    total = width * len(buckets)
    parts = [
        f'<svg class="timeline{" wide" if wide else ""}" width="{total}" height="{height}" '
        f'viewBox="0 0 {total} {height}" role="img" '
        'aria-label="ticks per hour over the last 24 hours">'
    ]
    for index, b in enumerate(buckets):
        missed = int(b.missed)
        kind = "miss" if missed else "run" if b.running else "ok" if b.expected else "none"
        detail = f"{int(b.expected)} expected, {int(b.ok)} succeeded"
        if b.running:
            detail += f", {int(b.running)} running"
        if b.failed:
            detail += f", {int(b.failed)} failed"
        parts.append(
            f'<rect x="{index * width}" y="0" width="{width - 1}" height="{height}" '
            f'class="{kind}"><title>{b.label} UTC: {detail}, {missed} missed</title></rect>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))  # noqa: S704 - ints and fixed words only (see above)


FILTERS: dict[str, Callable[..., Any]] = {
    "timeline": timeline,
    "when": when,
    "iso": iso,
    "age": age,
    "since": since,
    "until": until,
    "one_line": one_line,
    "hour": hour,
}
