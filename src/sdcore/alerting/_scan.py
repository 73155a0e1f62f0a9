"""``MissedScan``: ticks nobody ran, found in the lease table (catch-up off or on).

Catch-up and the sweep notice a missed tick when they start it; with ``catch_up="off"`` nothing
ever starts it. The scan reads each exclusive cron and interval schedule's expected ticks and
calls one with no row (or given back unstarted) missed once ``missed_after`` has passed since the
last of its owners could ask for it (:data:`~sdcore.scheduling._owners.LAST_ASK_S` after its
instant, the first owners dead: as the sweep, the scan leaves a tick to its later owners until
then). Every replica scans; the decisions keep it to one alert per incident.

The first scan of a start waits until ``missed_after`` has passed since it, then judges only the
latest such tick of the window, once per schedule: an outage before this start is one incident,
however many ticks it missed (and a restart does not page again for the older ones). Later
scans judge each tick since the previous scan, oldest first (the first of a burst opens the
incident, the rest are part of it).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from sdcore.alerting._incidents import Problem
from sdcore.alerting._model import AlertKind
from sdcore.job_scheduler import BaseJobScheduler, JobSchedulerError

if TYPE_CHECKING:
    import logging

    from sdcore.scheduling import MissedTick, Scheduler

__all__ = ["MissedScan"]

_NARROWINGS = 32  # halvings of a range too long for missed_ticks (10,000 ticks at most)


class MissedScan:
    """The scan's memory on one replica: how far each schedule was judged.

    Args:
        missed_after: How long after its instant a tick without a row is missed.
        window: How far back the first scan looks.
        started: When alerting started here (UTC).
        logger: Where a schedule's failed read is logged.
    """

    def __init__(
        self, missed_after: timedelta, window: timedelta, started: datetime, logger: logging.Logger
    ) -> None:
        self._after = missed_after
        self._window = window
        self._started = started
        self._log = logger
        self._floors: dict[str, datetime] = {}
        self._first_seen: dict[str, datetime] = {}

    async def missed(
        self, scheduler: Scheduler, jobs: BaseJobScheduler, now: datetime
    ) -> list[Problem]:
        """The missed ticks judged now, as problems to decide (oldest first per schedule)."""
        from sdcore.scheduling._owners import LAST_ASK_S

        late = self._after + timedelta(seconds=LAST_ASK_S)
        end = now - late
        if end < self._started:
            return []  # the ticks before this start are judged together, once they all are
        found: list[Problem] = []
        for info in scheduler.schedules():
            if not (info.exclusive and info.active) or info.kind.value not in ("cron", "interval"):
                continue
            floor = self._floors.get(info.name)
            try:
                first = self._first_seen.get(info.name)
                if first is None:
                    first = await jobs.first_seen(info.name)
                    if first is None:
                        continue  # never ran anywhere: nothing is missed yet
                    self._first_seen[info.name] = first  # changes only if its rows are pruned
                start = max(first, now - self._window if floor is None else floor)
                if start >= end:
                    continue
                ticks = await _missed_ticks(scheduler, jobs, info.name, start, end)
            except (JobSchedulerError, ValueError) as exc:
                self._log.warning(
                    "alerting scan of %r failed: %s",
                    info.name,
                    exc,
                    extra={"action": "alert_scan_failed", "schedule": info.name},
                )
                continue
            self._floors[info.name] = end
            lost = [t for t in ticks if t.skipped is None and (t.status is None or t.given_back)]
            if floor is None:
                lost = lost[-1:]
            after_ms = int(late.total_seconds() * 1000)
            found += [
                Problem(
                    kind=AlertKind.MISSED,
                    schedule=info.name,
                    run_key=tick.run_key,
                    scheduled_at=tick.scheduled_at,
                    attempt=0,
                    reason=(
                        f"no replica ran it ({tick.given_back or 'never started'}, "
                        f"{after_ms} ms after its instant)"
                    ),
                )
                for tick in lost
            ]
        return found


async def _missed_ticks(
    scheduler: Scheduler, jobs: BaseJobScheduler, name: str, start: datetime, end: datetime
) -> list[MissedTick]:
    """``scheduler.missed_ticks`` of ``[start, end)``, or of its latest part when the range holds
    more ticks than one read takes (the newest ticks are the ones that matter here).

    Raises:
        ValueError: Not even a narrowed range could be read.
        JobSchedulerError: The database failed.
    """
    from sdcore.scheduling import InvalidScheduleError

    for _ in range(_NARROWINGS):
        try:
            return await scheduler.missed_ticks(name, start, end, jobs=jobs)
        except InvalidScheduleError:
            raise
        except ValueError:
            start = end - (end - start) / 2
    return await scheduler.missed_ticks(name, start, end, jobs=jobs)
