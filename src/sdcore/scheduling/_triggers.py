"""When schedules fire, and the identity of each tick: pure functions of the scheduled instant."""

from __future__ import annotations

import enum
import functools
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Protocol
from zoneinfo import ZoneInfo

from sdcore.job_scheduler import JobExecutionLease
from sdcore.scheduling._cron import CronSpec

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)
_SECOND = timedelta(seconds=1)


class ScheduleKind(enum.StrEnum):
    """How a schedule fires."""

    CRON = "cron"
    INTERVAL = "interval"
    TIMEOUT = "timeout"
    INITIAL = "initial"


def format_run_key(instant: datetime, *, millis: bool = False) -> str:
    """Return the canonical run key of a scheduled instant: ``YYYY-MM-DDTHH:MM:SSZ`` in UTC.

    Args:
        instant: The *scheduled* instant (aware).
        millis: Add milliseconds (``.mmm``), for sub-second intervals only.

    Returns:
        The run key, identical on every replica whatever its ``TZ`` or clock.
    """
    global _last_key
    last = _last_key
    if last is not None and last[1] is millis and last[0] == instant:
        return last[2]  # the ticks of a burst share their instant's key
    utc = instant.astimezone(UTC)
    if millis:
        key = utc.strftime("%Y-%m-%dT%H:%M:%S.") + f"{utc.microsecond // 1000:03d}Z"
    else:
        key = utc.strftime("%Y-%m-%dT%H:%M:%SZ")
    _last_key = (instant, millis, key)
    return key


# The last run key formatted: (instant, millis, key).
_last_key: tuple[datetime, bool, str] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Tick:
    """What a handler is told about the run it was given.

    Attributes:
        schedule: The schedule's name (also the job code when exclusive).
        scheduled_at: The scheduled instant, aware, in UTC — never "now".
        local_time: The same instant in the schedule's time zone.
        run_key: The lease run key (``None`` for ``initial`` schedules).
        lease: The lease when the schedule is exclusive (its ``idempotency_key`` and
            ``fencing_token`` are what side effects should carry), else ``None``.
        attempt: 1 for the first attempt, 2… for retries of a failed tick.
    """

    schedule: str
    scheduled_at: datetime
    local_time: datetime
    run_key: str | None
    lease: JobExecutionLease | None = field(default=None, repr=False)
    attempt: int = 1


class Trigger(Protocol):
    """Computes fire instants (UTC)."""

    @property
    def kind(self) -> ScheduleKind:
        """How the schedule fires."""
        ...

    @property
    def spacing(self) -> timedelta | None:
        """No two fire instants are closer than this (``None``: it fires at most once)."""
        ...

    def next_after(self, after: datetime) -> datetime | None:
        """Return the first fire instant strictly after ``after``, or ``None`` if no more."""
        ...

    def run_key(self, instant: datetime) -> str | None:
        """Return the run key of the tick scheduled at ``instant``."""
        ...

    def describe(self) -> str:
        """A short human description (the expression or the interval)."""
        ...


@dataclass(frozen=True, slots=True)
class CronTrigger:
    """Fires on a cron expression in a time zone."""

    spec: CronSpec
    kind: ScheduleKind = ScheduleKind.CRON

    @property
    def spacing(self) -> timedelta | None:
        # cron fields are whole seconds, and so are UTC offsets: instants are whole seconds.
        return _SECOND

    def next_after(self, after: datetime) -> datetime | None:
        return self.spec.next_after(after)

    def run_key(self, instant: datetime) -> str | None:
        return format_run_key(instant)

    def describe(self) -> str:
        return self.spec.expression


@functools.lru_cache(maxsize=4096)
def cron_trigger(spec: CronSpec) -> CronTrigger:
    """The trigger of ``spec``, one object per equal spec (see ``CronSpec.parse``)."""
    return CronTrigger(spec)


@dataclass(frozen=True, slots=True)
class IntervalTrigger:
    """Fires every ``every_ms`` on a grid shared by all replicas: multiples since the Unix epoch.

    The first run is at the next grid point after start, not at start.
    """

    every_ms: int
    kind: ScheduleKind = ScheduleKind.INTERVAL

    @property
    def spacing(self) -> timedelta | None:
        return self.every_ms * _MS

    def next_after(self, after: datetime) -> datetime | None:
        elapsed = (after.astimezone(UTC) - EPOCH) // _MS
        return EPOCH + (elapsed // self.every_ms + 1) * self.every_ms * _MS

    def run_key(self, instant: datetime) -> str | None:
        return format_run_key(instant, millis=self.every_ms % 1000 != 0)

    def describe(self) -> str:
        return f"every {self.every_ms} ms"


@dataclass(frozen=True, slots=True)
class OnceTrigger:
    """Fires once: ``delay_ms`` after the scheduler starts (timeout) or at start (initial)."""

    kind: ScheduleKind
    delay_ms: int
    started_at: datetime | None = None

    @property
    def spacing(self) -> timedelta | None:
        return None

    def next_after(self, after: datetime) -> datetime | None:
        if self.started_at is None:
            return None
        due = self.started_at + self.delay_ms * _MS
        return due if due > after else None

    def run_key(self, instant: datetime) -> str | None:
        return None if self.kind is ScheduleKind.INITIAL else format_run_key(instant, millis=True)

    def describe(self) -> str:
        if self.kind is ScheduleKind.INITIAL:
            return "once per cluster"
        return f"once, {self.delay_ms} ms after start"


def make_tick(name: str, trigger: Trigger, zone: ZoneInfo, instant: datetime) -> Tick:
    """Build the :class:`Tick` of ``trigger`` scheduled at ``instant``."""
    utc = instant.astimezone(UTC)
    return Tick(
        schedule=name,
        scheduled_at=utc,
        local_time=utc.astimezone(zone),
        run_key=trigger.run_key(utc),
    )


def expected_instants(
    trigger: Trigger, start: datetime, end: datetime, *, limit: int, keep_last: bool = False
) -> list[datetime]:
    """Return the fire instants in ``[start, end)``.

    Args:
        trigger: The schedule's trigger.
        start: Inclusive start (aware).
        end: Exclusive end (aware).
        limit: Most instants returned.
        keep_last: Return the last ``limit`` instants instead of failing when there are more
            (scans at most 100 times ``limit``).

    Raises:
        ValueError: More than ``limit`` instants (unless ``keep_last``), an unaware bound, or a
            start at the very first representable instant (year 1).
    """
    if start.tzinfo is None or end.tzinfo is None:
        raise ValueError("start and end must be aware datetimes")
    instants: deque[datetime] = deque(maxlen=limit if keep_last else None)
    scanned = 0
    try:
        current = trigger.next_after(start - timedelta(microseconds=1))
    except OverflowError:
        raise ValueError(
            f"start {start.isoformat()} is out of range: the earliest instant supported is "
            "0001-01-01T00:00:00.000001Z"
        ) from None
    while current is not None and current < end:
        if not keep_last and len(instants) >= limit:
            raise ValueError(f"more than {limit} ticks in the range; narrow it")
        scanned += 1
        if scanned > 100 * limit:
            raise ValueError(f"more than {100 * limit} ticks in the range; narrow it")
        instants.append(current)
        try:
            current = trigger.next_after(current)
        except OverflowError:
            break  # no fire instant after the year 9999, hence none before ``end``
    return list(instants)
