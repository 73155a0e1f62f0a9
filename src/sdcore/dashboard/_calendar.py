"""Expected ticks per hour of cron and interval schedules, for the missed-tick timelines."""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta

from sdcore.scheduling import InvalidScheduleError, Scheduler

BUCKET = timedelta(hours=1)
CACHE_SIZE = 5_000
WARM_PAIRS = CACHE_SIZE // 25
"""Most (expression, zone) pairs :meth:`Calendar.warm` fills: 24 hours each fit the cache."""
SLICE_S = 0.005
VIXIE = "vixie"  # the default day rule (the only one warmed: a NestJS rule is rare)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class Calendar:
    """Expected ticks per hour, per (kind, expression, zone, day rule), from a never-started
    Scheduler.

    Each hour's cron instants are computed once and kept (as POSIX seconds) for the counts of
    that hour, whole or in part (the current hour, an hour cut by a schedule's creation), so a
    page of 50 schedules sharing a dozen expressions walks no calendar after the first visit.
    Interval schedules fire on a grid since the epoch: their counts are arithmetic.
    """

    def __init__(self) -> None:
        self._scheduler = Scheduler()
        self._names: dict[tuple[str, str, str], str | None] = {}
        self._hours: OrderedDict[tuple[str, str, str, datetime], list[float]] = OrderedDict()
        self._next: dict[tuple[str, str, str], datetime | None] = {}

    def _entry(self, expression: str, zone: str, day_rule: str) -> str | None:
        key = (expression, zone, day_rule)
        if key not in self._names:
            name = f"calendar-{len(self._names)}"
            try:
                self._scheduler.add_cron(
                    name, expression, _noop, time_zone=zone, day_rule=day_rule, exclusive=False
                )
            except InvalidScheduleError:
                self._names[key] = None
            else:
                self._names[key] = name
        return self._names[key]

    def next_fire(
        self, kind: str, expression: str, zone: str, day_rule: str = VIXIE
    ) -> datetime | None:
        """The next fire instant after now (``None``: not a cron/interval schedule)."""
        if kind == "interval":
            every = _every_ms(expression)
            if every is None:
                return None
            elapsed = (datetime.now(UTC) - EPOCH) // timedelta(milliseconds=1)
            return EPOCH + (elapsed // every + 1) * every * timedelta(milliseconds=1)
        if kind != "cron":
            return None
        key = (expression, zone, day_rule)
        upcoming = self._next.get(key)
        if upcoming is not None and upcoming > datetime.now(UTC):
            return upcoming
        name = self._entry(expression, zone, day_rule)
        upcoming = None if name is None else self._scheduler.get(name).next_fire_at
        if len(self._next) > CACHE_SIZE:
            self._next.clear()
        self._next[key] = upcoming
        return upcoming

    def _hour(self, expression: str, zone: str, start: datetime, day_rule: str) -> list[float]:
        key = (expression, zone, day_rule, start)
        found = self._hours.get(key)
        if found is not None:
            self._hours.move_to_end(key)
            return found
        name = self._entry(expression, zone, day_rule)
        end = start + BUCKET
        instants = [] if name is None else self._scheduler.expected_ticks(name, start, end)
        found = [t.timestamp() for t in instants]
        self._hours[key] = found
        if len(self._hours) > CACHE_SIZE:
            self._hours.popitem(last=False)
        return found

    async def warm(self, pairs: Iterable[tuple[str, str]], starts: Sequence[datetime]) -> int:
        """Fill the cache with the hours ``starts`` of cron ``(expression, zone)`` pairs.

        At most :data:`WARM_PAIRS` pairs; the work is cut in slices of about 5 ms that yield to
        the event loop, so requests served meanwhile wait at most one slice. Returns how many
        hours were computed (hours already cached cost nothing).
        """
        computed = 0
        deadline = time.monotonic() + SLICE_S
        for index, (expression, zone) in enumerate(pairs):
            if index >= WARM_PAIRS:
                break
            for start in starts:
                if (expression, zone, VIXIE, start) in self._hours:
                    continue
                self._hour(expression, zone, start, VIXIE)
                computed += 1
                if time.monotonic() >= deadline:
                    await asyncio.sleep(0)
                    deadline = time.monotonic() + SLICE_S
        return computed

    def expected(
        self,
        kind: str,
        expression: str,
        zone: str,
        bucket: datetime,
        low: datetime,
        high: datetime,
        day_rule: str = VIXIE,
    ) -> int:
        """How many ticks fall in ``[low, high)``, a part of the hour starting at ``bucket``."""
        if high <= low:
            return 0
        if kind == "interval":
            every = _every_ms(expression)
            if every is None:
                return 0
            ms = timedelta(milliseconds=1)
            # Grid points k * every (ms since the epoch) with low <= point < high.
            return -(-((high - EPOCH) // ms) // every) + ((low - EPOCH) // ms) // -every
        if kind != "cron":
            return 0
        instants = self._hour(expression, zone, bucket, day_rule)
        if low == bucket and high - bucket == BUCKET:
            return len(instants)
        return bisect_left(instants, high.timestamp()) - bisect_left(instants, low.timestamp())

    def expects(
        self,
        kind: str,
        expression: str,
        zone: str,
        bucket: datetime,
        instant: datetime,
        day_rule: str = VIXIE,
    ) -> bool:
        """Whether ``instant`` (in the hour starting at ``bucket``) is one of its ticks."""
        if kind == "interval":
            every = _every_ms(expression)
            ms = (instant - EPOCH) / timedelta(milliseconds=1)
            return every is not None and ms == int(ms) and int(ms) % every == 0
        if kind != "cron":
            return False
        instants = self._hour(expression, zone, bucket, day_rule)
        at = instant.timestamp()
        found = bisect_left(instants, at)
        return found < len(instants) and instants[found] == at


def _noop(_: object) -> None:
    return None


def _every_ms(expression: str) -> int | None:
    try:
        every = int(expression)
    except ValueError:
        return None
    return every if every > 0 else None
