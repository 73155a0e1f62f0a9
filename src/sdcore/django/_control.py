"""The control plane as the Django admin reaches it: a Runtime of its own that runs nothing.

The admin's actions go through :class:`sdcore.sync.ScheduleAdmin` (validation, the actor and
reason recorded, replicas notified), and its schedules list shows what the models cannot read
from one row: the next fire time and the missed ticks. Both need the control plane's pool and
the lease table, so a process holds one :class:`Control`: an ``sdcore.sync.Runtime`` with no
scheduler, relay or control loop (a pool of at most two connections), started on the first
admin request of the process and stopped at interpreter exit. A forked child (a Gunicorn
worker of a preloading master) builds its own.

Missed ticks, as ``sdcore.scheduling.Scheduler.missed_ticks`` reads them from the lease table:
the expected ticks of the last :data:`WINDOW` (from the schedule's creation at most, up to
:data:`GRACE` before now, and at most the last :data:`MAX_TICKS` of them) without a
``SUCCESS`` row, ticks still running left out. Each tick costs about 25 µs of Python (its
lease key), so the cap keeps a page of 50 per-second schedules near a second.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sdcore.job_scheduler import JobSchedulerStatus
from sdcore.postgres import PoolSettings
from sdcore.scheduling import InvalidScheduleError, Scheduler
from sdcore.scheduling import ScheduleAdmin as AsyncScheduleAdmin
from sdcore.sync import Runtime, ScheduleAdmin

__all__ = [
    "GRACE",
    "MAX_TICKS",
    "WINDOW",
    "Control",
    "Definition",
    "ScheduleStatus",
    "control",
    "idle_runtime",
]

GRACE = timedelta(minutes=1)
"""A tick due less than this long ago is not missed yet (its run may not have started)."""
WINDOW = timedelta(hours=24)
MAX_TICKS = 1_000
"""The most ticks one schedule's count reads: a day of a 5-minute cron, 16 minutes of a
per-second interval."""
ADMIN_POOL = PoolSettings(min_size=1, max_size=2, application_name="sdcore-django-admin")


@dataclass(frozen=True, slots=True, kw_only=True)
class Definition:
    """What the schedules list knows of a schedule from its row."""

    name: str
    origin: str
    kind: str
    expression: str
    time_zone: str
    day_rule: str
    paused: bool
    created_at: datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleStatus:
    """What the schedules list shows beyond the row.

    Attributes:
        replicas: Live replicas that declare the schedule.
        next_fire_at: The next fire time; ``None`` while paused, for a code schedule no live
            replica declares (it fires nowhere), and for one-shot kinds.
        missed: Missed ticks since :attr:`missed_since`; ``None`` for kinds without ticks to
            miss (timeout, initial) or a definition the calendar refuses.
        missed_since: Where the count starts.
        capped: The count covers the last :data:`MAX_TICKS` ticks only, not all of
            :data:`WINDOW` since the schedule's creation.
    """

    replicas: int
    next_fire_at: datetime | None
    missed: int | None
    missed_since: datetime
    capped: bool = False


def _noop(_: object) -> None:
    return None


def _window(definition: Definition, now: datetime) -> tuple[datetime, datetime]:
    """The full window of the count: the last WINDOW before the grace, from the creation."""
    high = now - GRACE
    return max(high - WINDOW, definition.created_at), high


class Control:
    """The admin's control plane over a started runtime that runs nothing but its pool.

    Args:
        runtime: A started ``sdcore.sync.Runtime`` (no scheduling, relay or control loop).
    """

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.pid = os.getpid()
        self.schedules = ScheduleAdmin(
            AsyncScheduleAdmin(runtime.aio.schedule_store), runtime.portal
        )
        """The blocking operator API: pause, resume, trigger, backfill."""

    def statuses(self, definitions: Sequence[Definition]) -> dict[str, ScheduleStatus]:
        """Return each schedule's replicas, next fire time and missed ticks, by name."""
        if not definitions:
            return {}
        return self.runtime.portal.call(self._statuses, list(definitions), datetime.now(UTC))

    async def _statuses(
        self, definitions: list[Definition], now: datetime
    ) -> dict[str, ScheduleStatus]:
        store = self.runtime.aio.schedule_store
        jobs = self.runtime.aio.jobs
        calendar = Scheduler()  # never started: the scheduler's own triggers, as a calendar
        found: dict[str, ScheduleStatus] = {}
        for definition in definitions:
            name = definition.name
            replicas = await store.live_declarers(name)
            low, high = _window(definition, now)
            try:
                if definition.kind == "cron":
                    calendar.add_cron(
                        name,
                        definition.expression,
                        _noop,
                        time_zone=definition.time_zone,
                        day_rule=definition.day_rule,
                        exclusive=False,
                    )
                elif definition.kind == "interval":
                    calendar.add_interval(name, int(definition.expression), _noop, exclusive=False)
                else:
                    raise InvalidScheduleError(name, f"a {definition.kind} schedule has no ticks")
            except (InvalidScheduleError, ValueError):
                found[name] = ScheduleStatus(
                    replicas=replicas, next_fire_at=None, missed=None, missed_since=low
                )
                continue
            fires = not definition.paused and (definition.origin != "code" or replicas > 0)
            full = low
            if definition.kind == "interval":  # its grid: MAX_TICKS periods back, no walk
                every = timedelta(milliseconds=int(definition.expression))
                low = max(low, high - every * MAX_TICKS)
            missed: int | None = 0
            if low < high:
                try:
                    expected = calendar.expected_ticks(name, low, high)
                except ValueError:  # over 10,000 ticks in the window: a per-second cron
                    expected = None
                if expected is None:
                    missed = None
                else:
                    if len(expected) > MAX_TICKS:
                        low = expected[-MAX_TICKS]
                    ticks = await calendar.missed_ticks(name, low, high, jobs=jobs)
                    missed = sum(t.status is not JobSchedulerStatus.RUNNING for t in ticks)
            found[name] = ScheduleStatus(
                replicas=replicas,
                next_fire_at=calendar.get(name).next_fire_at if fires else None,
                missed=missed,
                missed_since=low,
                capped=low > full,
            )
        return found

    def stop(self) -> None:
        """Stop the runtime (its pool and portal)."""
        self.runtime.stop()


_lock = threading.Lock()
_built: list[Control] = []


def control() -> Control:
    """Return this process's :class:`Control`, started on first use (one per process).

    Raises:
        RuntimeStateError: The database cannot be reached.
        django.core.exceptions.ImproperlyConfigured: Bad ``settings.SDCORE``.
    """
    with _lock:
        if _built and _built[0].pid == os.getpid():
            return _built[0]
        _built.clear()  # built before a fork: its portal thread did not survive it
        runtime = _admin_runtime()
        runtime.start()
        _built.append(Control(runtime))
        return _built[0]


def close_control() -> None:
    """Stop this process's :class:`Control`, if any (the next :func:`control` starts another)."""
    with _lock:
        if _built and _built[0].pid == os.getpid():
            _built[0].stop()
        _built.clear()


def idle_runtime(pool: PoolSettings, logger_name: str, **extra: Any) -> dict[str, Any]:
    """The keywords of a Runtime (async or sync) over Django's database that runs nothing: no
    scheduler, relay or control loop and no migration, only its pool (``extra`` added)."""
    from sdcore.django._settings import SdcoreSettings, database_url

    return {
        "database_url": database_url(),
        "pool": pool,
        "relay": None,
        "scheduling": None,
        "control": None,
        "ensure_schema": False,
        "schema": SdcoreSettings.from_django().schema,
        "logger_name": logger_name,
        **extra,
    }


def _admin_runtime() -> Runtime:
    # stop_on_sigterm: SIGTERM is the web server's signal, not sdcore's.
    return Runtime(**idle_runtime(ADMIN_POOL, "sdcore.django.admin", stop_on_sigterm=False))
