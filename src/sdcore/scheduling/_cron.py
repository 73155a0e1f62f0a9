"""Cron evaluation in a time zone, with cron's (cronie's) daylight-saving rules.

Expressions are evaluated on naive *wall-clock* times with cronsim, then mapped to UTC here, so the
DST rules are ours and the same for 5- and 6-field expressions:

- a wall time in the spring-forward gap: a *fixed-time* job (neither the minute nor the hour field
  starts with ``*``) runs once, at the instant the gap ends; a wildcard job skips it;
- a wall time in the repeated fall-back hour: a fixed-time job runs once (the first copy); a
  wildcard job runs in both copies (two distinct UTC instants).

All arithmetic is done in UTC or on naive wall times; aware local datetimes are only built to ask
``zoneinfo`` for offsets (``aware + timedelta`` would silently reset ``fold``).

Day-of-month and day-of-week combine by one of two rules (:class:`DayRule`): Vixie cron's (also
cronie's and cronsim's; the default) and npm ``cron``'s, which NestJS uses. They differ when the
other day field is restricted and one starts with ``*`` without being the full range (``*/10``)
or is the full range without starting with ``*`` (``1-31``, ``1-7``).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from sdcore.exceptions import SdcoreError

MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
    # npm cron's presets (PRESETS in its src/constants.ts, 4.4.0), so NestJS strings port as-is.
    "@minutely": "* * * * *",
    "@secondly": "* * * * * *",
    "@weekdays": "0 0 * * 1-5",
    "@weekends": "0 0 * * 0,6",
}
MAX_EXPRESSION_LENGTH = 1024
_SECOND = timedelta(seconds=1)


class DayRule(enum.StrEnum):
    """How a cron expression's day-of-month and day-of-week fields combine.

    Attributes:
        VIXIE: The default, as Vixie cron, cronie and Debian cron do it: if either day field
            *starts with* ``*``, a day must match both fields; otherwise either field.
            ``0 0 */10 * 0`` fires on the 1st, 11th, 21st and 31st only when that day is a Sunday.
        NESTJS: As npm ``cron`` (``@nestjs/schedule``) does it: a field is unrestricted only if it
            lists every value (``*``, ``*/1``, ``1-31``, ``0-6``); if both fields are restricted, a
            day matching either fires. ``0 0 */10 * 0`` fires on the 1st, 11th, 21st and 31st
            and on every Sunday.
    """

    VIXIE = "vixie"
    NESTJS = "nestjs"


class SchedulingError(SdcoreError):
    """Base class of every error raised by :mod:`sdcore.scheduling`."""


class InvalidScheduleError(SchedulingError, ValueError):
    """A schedule that cannot be registered: bad expression, zone, name or option.

    Attributes:
        schedule: The schedule's name (or ``None`` if it had none yet).
        problem: What is wrong.
    """

    def __init__(self, schedule: str | None, problem: str) -> None:
        self.schedule = schedule
        self.problem = problem
        where = f"schedule {schedule!r}: " if schedule else ""
        super().__init__(f"{where}{problem}")


def load_zone(name: object, schedule: str | None = None) -> ZoneInfo:
    """Return the IANA zone ``name`` or raise :class:`InvalidScheduleError`."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise InvalidScheduleError(schedule, f"time zone must be an IANA name, got {name!r:.80}")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidScheduleError(schedule, f"unknown time zone {name!r:.80}") from None


@dataclass(frozen=True, slots=True)
class CronSpec:
    """A validated cron expression in a zone.

    Attributes:
        expression: The expression as given (macros kept).
        zone: The zone it is evaluated in.
        fields: The normalized 5 or 6 fields (macros expanded).
        fixed: Whether DST gaps/repeats are handled as for a fixed-time job.
        day_and: Whether a day must match both day fields (else either), per the day rule.
    """

    expression: str
    zone: ZoneInfo
    fields: tuple[str, ...] = field(repr=False)
    fixed: bool = field(repr=False)
    day_and: bool = field(repr=False, default=True)
    # The parsed expression (one per distinct expression): every fire-time computation starts
    # from a copy of it instead of parsing the text again (a burst of 10,000 schedules computes
    # 10,000 at once).
    _parsed: CronSim | None = field(repr=False, compare=False, default=None)

    @classmethod
    def parse(
        cls,
        expression: object,
        zone: ZoneInfo,
        schedule: str | None = None,
        *,
        day_rule: DayRule | str = DayRule.VIXIE,
    ) -> CronSpec:
        """Validate ``expression`` and check that it fires at all.

        Args:
            expression: 5 or 6 fields, or a macro such as ``@daily``.
            zone: The zone the wall-clock fields are read in.
            schedule: The schedule's name, for error messages.
            day_rule: How the two day fields combine (see :class:`DayRule`).

        Raises:
            InvalidScheduleError: Malformed, too long, never firing, or an unknown day rule.
        """
        try:
            rule = DayRule(day_rule)
        except ValueError:
            raise InvalidScheduleError(
                schedule, f"day_rule must be 'vixie' or 'nestjs', got {day_rule!r:.80}"
            ) from None
        if not isinstance(expression, str):
            raise InvalidScheduleError(
                schedule, f"cron expression must be a str, got {type(expression).__name__}"
            )
        if len(expression) > MAX_EXPRESSION_LENGTH or "\x00" in expression:
            raise InvalidScheduleError(schedule, "cron expression is too long or contains NUL")
        key = (expression, zone, rule)
        cached = _SPECS.get(key)
        if cached is not None:
            return cached  # the stored schedules of one expression share one spec
        text = MACROS.get(expression.strip().lower(), expression.strip())
        fields = tuple(text.split())
        if len(fields) not in (5, 6):
            raise InvalidScheduleError(
                schedule,
                f"cron expression {expression!r:.80} must have 5 fields (minute first) or 6 "
                "(second first), or be a macro such as @daily",
            )
        normalized = " ".join(fields)
        try:
            probe = CronSim(normalized, datetime(2000, 1, 1))  # noqa: DTZ001 - wall-clock
        except CronSimError as exc:
            raise InvalidScheduleError(
                schedule, f"invalid cron expression {expression!r:.80}: {exc}"
            ) from None
        minute, hour = (fields[0], fields[1]) if len(fields) == 5 else (fields[1], fields[2])
        day_and = probe.day_and if rule is DayRule.VIXIE else _npm_day_and(probe)
        spec = cls(
            expression=expression,
            zone=zone,
            fields=fields,
            fixed=not (minute.startswith("*") or hour.startswith("*")),
            day_and=day_and,
            _parsed=_parsed(fields, day_and),
        )
        try:
            spec.next_after(datetime(2000, 1, 1, tzinfo=UTC))
        except (CronSimError, StopIteration):
            raise InvalidScheduleError(
                schedule, f"cron expression {expression!r:.80} never fires"
            ) from None
        if len(_SPECS) >= _MAX_SPECS:
            _SPECS.clear()
        _SPECS[key] = spec
        return spec

    def _sim(self, wall: datetime) -> CronSim:
        parsed = self._parsed
        if parsed is None:
            parsed = _parsed(self.fields, self.day_and)
            object.__setattr__(self, "_parsed", parsed)
        # A fresh iterator over the parsed fields (they are only read while iterating): the
        # state cronsim's constructor sets for a naive forward start, without the parsing.
        sim = object.__new__(CronSim)
        sim.__dict__.update(parsed.__dict__)
        sim.dt = wall.replace(microsecond=0)
        sim.skip_initial_tick = False
        sim.tick_direction = 1
        sim.fixup_tz = None
        return sim

    def _wall_after(self, wall: datetime) -> datetime:
        return next(self._sim(wall))

    def next_after(self, after: datetime) -> datetime:
        """Return the first fire instant strictly after ``after`` (aware), in UTC."""
        after = after.astimezone(UTC)
        local = after.astimezone(self.zone)
        wall = local.replace(tzinfo=None, fold=0)
        candidates = self._sim(wall)
        for _ in range(100_000):  # a wildcard job skips at most one gap's worth of candidates
            best = self._map(next(candidates), after)
            if best is not None:
                break
        else:  # pragma: no cover - only for pathological zones
            raise CronSimError("no fire time found")
        if not self.fixed and local.fold == 0 and _is_ambiguous(wall, self.zone):
            # `after` is in the first copy of a repeated period: the second copy begins earlier
            # in wall time than `after`, so look for its first candidate too.
            start, end = _repeated_period(after, self.zone)
            second = self._wall_after(start - timedelta(microseconds=1))
            if second < end:
                instant = second.replace(tzinfo=self.zone, fold=1).astimezone(UTC)
                if after < instant < best:
                    best = instant
        return best

    def _map(self, wall: datetime, after: datetime) -> datetime | None:
        """Map a wall-clock candidate to its UTC fire instant (or ``None`` to skip it)."""
        first = wall.replace(tzinfo=self.zone, fold=0).astimezone(UTC)
        second = wall.replace(tzinfo=self.zone, fold=1).astimezone(UTC)
        if first == second:
            return first if first > after else None
        if _exists(wall, self.zone):
            # Ambiguous (fall-back): the first copy for everyone, the second for wildcard jobs.
            if first > after:
                return first
            if not self.fixed and second > after:
                return second
            return None
        # Nonexistent (spring-forward gap).
        if not self.fixed:
            return None
        gap_end = _transition(second, first, self.zone)
        return gap_end if gap_end > after else None


# Valid specs by (expression, zone, day rule): equal schedules share one spec (and one trigger,
# see sdcore.scheduling._triggers.cron_trigger), so a burst of them computes one next fire time
# and the timer recognizes them by identity. Bounded: cleared when full.
_SPECS: dict[tuple[str, ZoneInfo, DayRule], CronSpec] = {}
_MAX_SPECS = 4096


@functools.lru_cache(maxsize=4096)
def _parsed(fields: tuple[str, ...], day_and: bool) -> CronSim:
    """The parsed fields, shared by every spec of one expression (only read while iterating)."""
    parsed = CronSim(" ".join(fields), datetime(2000, 1, 1))  # noqa: DTZ001 - wall-clock
    # cronsim decides AND/OR by Vixie's rule at construction and reads this flag as it iterates;
    # the NestJS rule only changes that decision (pinned by the table tests).
    parsed.day_and = day_and
    return parsed


_ALL_DAYS = frozenset(range(1, 32))
_ALL_WEEKDAYS = frozenset(range(7))


def _npm_day_and(sim: CronSim) -> bool:
    """npm cron's rule: OR only when both day fields are restricted, judged by their values.

    npm cron 4.4.0 (``src/time.ts``, ``_getNextDateFrom``) skips a day when a restricted field
    misses it and the other field is unrestricted or misses it too; a field is unrestricted when
    it holds every value (31 days; 7 weekdays once 7 is folded onto 0). With at most one field
    restricted, AND gives the same days (the unrestricted field matches every day).
    """
    weekdays = {value % 7 for value in sim.weekdays if isinstance(value, int)}
    dom_full = set(sim.days) == _ALL_DAYS
    dow_full = weekdays == _ALL_WEEKDAYS and all(isinstance(v, int) for v in sim.weekdays)
    return dom_full or dow_full


def _exists(wall: datetime, zone: tzinfo) -> bool:
    aware = wall.replace(tzinfo=zone, fold=0)
    return aware.astimezone(UTC).astimezone(zone).replace(tzinfo=None) == wall


def _is_ambiguous(wall: datetime, zone: tzinfo) -> bool:
    first = wall.replace(tzinfo=zone, fold=0).astimezone(UTC)
    second = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
    return first != second and _exists(wall, zone)


def _transition(before: datetime, after: datetime, zone: tzinfo) -> datetime:
    """Return the first UTC instant in ``(before, after]`` whose UTC offset equals ``after``'s."""
    target = after.astimezone(zone).utcoffset()
    lo, hi = before, after
    while hi - lo > _SECOND:
        mid = lo + (hi - lo) / 2
        if mid.astimezone(zone).utcoffset() == target:
            hi = mid
        else:
            lo = mid
    return hi.replace(microsecond=0)


def _repeated_period(after: datetime, zone: tzinfo) -> tuple[datetime, datetime]:
    """For ``after`` in the first copy of a repeated period, return its wall ``[start, end)``."""
    wall = after.astimezone(zone).replace(tzinfo=None, fold=0)
    second = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
    transition = _transition(after, second, zone)
    start = transition.astimezone(zone).replace(tzinfo=None, fold=0)
    end = (transition - _SECOND).astimezone(zone).replace(tzinfo=None, fold=0) + _SECOND
    return start, end
