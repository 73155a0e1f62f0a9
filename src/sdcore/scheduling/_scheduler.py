"""``Scheduler``: the registry of schedules and the timer loop that fires them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, Self, TypeVar, Unpack
from zoneinfo import ZoneInfo

from sdcore._internal.supervisor import Supervisor as Loops
from sdcore._internal.telemetry import Telemetry
from sdcore.job_scheduler import BaseJobScheduler
from sdcore.scheduling._catch_up import MAX_RANGE_TICKS, MissedTick, missed
from sdcore.scheduling._cron import CronSpec, DayRule, InvalidScheduleError, load_zone
from sdcore.scheduling._entry import NO_INSTANTS, Entry
from sdcore.scheduling._owners import Owners
from sdcore.scheduling._policy import (
    MAX_PERIOD_MS,
    CatchUp,
    ScheduleInfo,
    ScheduleNotFoundError,
    ScheduleOptions,
    build_policy,
    check_ms,
    check_name,
)
from sdcore.scheduling._runner import Handler, TickRunner, utcnow
from sdcore.scheduling._supervisor import TickStarter
from sdcore.scheduling._timer import Timer
from sdcore.scheduling._triggers import (
    CronTrigger,
    IntervalTrigger,
    OnceTrigger,
    ScheduleKind,
    Trigger,
    cron_trigger,
    expected_instants,
)

H = TypeVar("H", bound=Handler)
SH = TypeVar("SH", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True)
class ControlLink:
    """What a control plane lends a :class:`Scheduler` (:meth:`Scheduler.link`).

    Attributes:
        gate: Why a schedule's ticks must not start now (``"paused"``, or ``"unknown"`` when the
            paused state could not be read again in time), or ``None``.
        wrap: Wraps every handler (the run history).
        owners: Which exclusive ticks this replica asks for (``None``: all of them).
        changed: Told each schedule name added or removed (to declare it).
    """

    gate: Callable[[str], str | None]
    wrap: Callable[[str, Handler], Handler]
    owners: Owners | None
    changed: Callable[[str], None]


class Scheduler:
    """Cron, interval, timeout and initial schedules; exclusive across replicas with ``jobs``.

    Args:
        jobs: A job scheduler (``JobSchedulerService``); ``None`` runs every tick on every process,
            as NestJS does.
        time_zone: Default IANA zone for cron schedules.
        lease_ms: Default lease of exclusive ticks (default 5 minutes).
        grace_period_ms: On exit, how long running handlers may finish before they are cancelled.
        clock: Wall clock returning aware UTC datetimes (inject one in tests).
        logger_name: Logger for tick events.

    Raises:
        InvalidScheduleError: A bad zone or option.
    """

    def __init__(
        self,
        *,
        jobs: BaseJobScheduler | None = None,
        time_zone: str = "UTC",
        lease_ms: int = 300_000,
        grace_period_ms: int = 10_000,
        clock: Callable[[], datetime] = utcnow,
        logger_name: str = "sdcore.scheduling",
    ) -> None:
        self._jobs = jobs
        self._zone = load_zone(time_zone)
        self._lease_ms = check_ms(None, "lease_ms", lease_ms, minimum=3)
        grace = check_ms(None, "grace_period_ms", grace_period_ms, minimum=0, maximum=MAX_PERIOD_MS)
        self._clock = clock
        self._log = logging.getLogger(logger_name)
        self._entries: dict[str, Entry] = {}
        self._sup = TickStarter(TickRunner(jobs, self._log), jobs, clock, self._log, grace / 1000)
        self._timer = Timer(self._sup, clock, self._log, self._live, lambda: len(self._entries))
        self._loop_task: asyncio.Task[None] | None = None
        self._sweep_task: asyncio.Task[None] | None = None
        self._loops: Loops | None = None  # owns the timer and sweep loops (restarts a crash)
        self._started_at: datetime | None = None
        # Stored-schedule handlers by name.
        self._handlers: dict[str, Callable[..., Any]] = {}
        self._control: ControlLink | None = None  # the linked control plane (link())

    @property
    def telemetry(self) -> Telemetry:
        """The observers of this scheduler's ticks (``NOOP``; a Runtime installs its own)."""
        return self._sup.runner.telemetry

    @telemetry.setter
    def telemetry(self, hub: Telemetry) -> None:
        self._sup.runner.telemetry = hub

    # --- registration ------------------------------------------------------------------------

    def cron(
        self,
        expression: str,
        *,
        name: str | None = None,
        time_zone: str | None = None,
        day_rule: DayRule | str = DayRule.VIXIE,
        **options: Unpack[ScheduleOptions],
    ) -> Callable[[H], H]:
        """Decorate a handler to run on a cron expression (5 or 6 fields, macros, constants).

        ``day_rule`` chooses how day-of-month and day-of-week combine: ``"vixie"`` (default,
        as cronie) or ``"nestjs"`` (as npm ``cron``); see :class:`DayRule`.
        """
        return self._decorator(
            lambda h, n: self.add_cron(
                n, expression, h, time_zone=time_zone, day_rule=day_rule, **options
            ),
            name,
        )

    def interval(
        self, every_ms: int, *, name: str | None = None, **options: Unpack[ScheduleOptions]
    ) -> Callable[[H], H]:
        """Decorate a handler to run every ``every_ms`` on the shared epoch grid."""
        return self._decorator(lambda h, n: self.add_interval(n, every_ms, h, **options), name)

    def timeout(self, delay_ms: int, *, name: str | None = None) -> Callable[[H], H]:
        """Decorate a handler to run once per process, ``delay_ms`` after start."""
        return self._decorator(lambda h, n: self.add_timeout(n, delay_ms, h), name)

    def initial(
        self, *, name: str | None = None, **options: Unpack[ScheduleOptions]
    ) -> Callable[[H], H]:
        """Decorate a handler to run once per cluster, ever (``INITIAL`` lease; needs jobs)."""
        return self._decorator(lambda h, n: self.add_initial(n, h, **options), name)

    def handler(self, name: str) -> Callable[[SH], SH]:
        """Register a handler by name for *stored* schedules (created at run time).

        The handler is called as ``handler(tick, args)`` with the stored schedule's arguments
        (a dict); see :class:`~sdcore.scheduling.ScheduleControl`.

        Raises:
            InvalidScheduleError: A bad or duplicate handler name.
        """
        check_name(name)
        if name in self._handlers:
            raise InvalidScheduleError(name, "a handler with this name is already registered")

        def decorate(function: SH) -> SH:
            if not callable(function):
                raise InvalidScheduleError(name, "handler must be callable")
            self._handlers[name] = function
            return function

        return decorate

    @property
    def handlers(self) -> Mapping[str, Callable[..., Any]]:
        """The stored-schedule handlers registered with :meth:`handler`, by name."""
        return dict(self._handlers)

    def _decorator(self, register: Callable[[H, str], None], name: str | None) -> Callable[[H], H]:
        def decorate(handler: H) -> H:
            register(handler, name if name is not None else getattr(handler, "__name__", ""))
            return handler

        return decorate

    def add_cron(
        self,
        name: str,
        expression: str,
        handler: Handler,
        *,
        time_zone: str | None = None,
        day_rule: DayRule | str = DayRule.VIXIE,
        **options: Unpack[ScheduleOptions],
    ) -> None:
        """Register a cron schedule (see :meth:`cron`); usable while running."""
        check_name(name)
        trigger, zone = self._cron_trigger(name, expression, time_zone, day_rule)
        self._add(name, trigger, handler, zone, options)

    def _cron_trigger(
        self, name: str, expression: str, time_zone: str | None, day_rule: DayRule | str
    ) -> tuple[Trigger, ZoneInfo]:
        """The trigger of a cron schedule and its zone (``None``: the scheduler's default)."""
        zone = self._zone if time_zone is None else load_zone(time_zone, name)
        return cron_trigger(CronSpec.parse(expression, zone, name, day_rule=day_rule)), zone

    def add_interval(
        self, name: str, every_ms: int, handler: Handler, **options: Unpack[ScheduleOptions]
    ) -> None:
        """Register an interval schedule (see :meth:`interval`); ``every_ms`` at most 2**31 - 1."""
        check_name(name)
        every = check_ms(name, "every_ms", every_ms, minimum=1, maximum=MAX_PERIOD_MS)
        self._add(name, IntervalTrigger(every), handler, self._zone, options)

    def add_timeout(self, name: str, delay_ms: int, handler: Handler) -> None:
        """Register a one-shot, per-process schedule (see :meth:`timeout`)."""
        check_name(name)
        delay = check_ms(name, "delay_ms", delay_ms, minimum=0, maximum=MAX_PERIOD_MS)
        # Added while running: the delay counts from now, as NestJS's addTimeout does.
        base = None if self._started_at is None else self._clock()
        trigger = OnceTrigger(ScheduleKind.TIMEOUT, delay, base)
        self._add(name, trigger, handler, self._zone, {"exclusive": False})

    def add_initial(self, name: str, handler: Handler, **options: Unpack[ScheduleOptions]) -> None:
        """Register a once-per-cluster schedule (see :meth:`initial`)."""
        check_name(name)
        if self._jobs is None:
            raise InvalidScheduleError(name, "initial schedules need a job scheduler (jobs=...)")
        base = None if self._started_at is None else self._clock()
        trigger = OnceTrigger(ScheduleKind.INITIAL, 0, base)
        self._add(name, trigger, handler, self._zone, {**options, "exclusive": True})

    def _add(
        self,
        name: str,
        trigger: Trigger,
        handler: Handler,
        zone: ZoneInfo,
        options: Mapping[str, Any],
        *,
        replace: bool = False,
    ) -> None:
        """Register a schedule; with ``replace``, one of the same name that runs here already
        gives its place to it (a stored schedule changed) only once the new one is valid."""
        old = self._entries.get(name)
        if old is not None and not replace:
            raise InvalidScheduleError(name, "a schedule with this name already exists")
        if not callable(handler):
            raise InvalidScheduleError(name, "handler must be callable")
        policy = build_policy(
            name, options, has_jobs=self._jobs is not None, default_lease_ms=self._lease_ms
        )
        entry = Entry(name, trigger, handler, zone, policy)
        if self._control is not None:
            entry.handler = self._control.wrap(name, handler)
        now = self._clock()
        try:
            # Everything that could fail later (a fire instant past year 9999…) fails here,
            # before the schedule is registered.
            entry.trigger.next_after(now)
            now - timedelta(milliseconds=policy.catch_up_window_ms)
        except (OverflowError, ValueError) as exc:
            raise InvalidScheduleError(name, f"cannot compute its fire times: {exc}") from None
        after = now
        if old is not None:
            # The replaced schedule's runs going on, ticks in flight and fires waiting here are
            # the new one's: overlap still sees them, and a fire a later owner waits to ask for
            # (in the starter, or in a burst the timer looks at at its turn) or one the timer
            # has not reached yet is not lost to the change.
            waiting = self._started_at is not None and self._timer.replace(old, entry)
            due = old.next_at if old.active and self._started_at is not None else None
            if due is not None and due <= now and not waiting:
                after = due - timedelta(microseconds=1)
            self.stop(name)
            old.removed = True
            self._sup.replace(old, entry)
        if self._started_at is not None:
            self._arm(entry, after)
        self._entries[name] = entry
        if self._control is not None:
            self._control.changed(name)

    # --- registry ----------------------------------------------------------------------------

    def _entry(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise ScheduleNotFoundError(name) from None

    def get(self, name: str) -> ScheduleInfo:
        """Return one schedule. Raises ``ScheduleNotFoundError``."""
        return self._info(self._entry(name))

    def schedules(self) -> list[ScheduleInfo]:
        """Return every schedule, soonest next fire first (inactive ones last)."""
        infos = [self._info(entry) for entry in self._entries.values()]
        far = datetime.max.replace(tzinfo=self._zone)
        return sorted(infos, key=lambda i: (i.next_fire_at is None, i.next_fire_at or far, i.name))

    def _info(self, entry: Entry) -> ScheduleInfo:
        upcoming = entry.upcoming(self._clock())
        if upcoming is None and entry.active and self._started_at is None:
            upcoming = entry.trigger.next_after(self._clock())
        if not entry.active:
            upcoming = None
        return ScheduleInfo(
            name=entry.name,
            kind=entry.kind,
            description=entry.trigger.describe(),
            time_zone=entry.zone.key,
            exclusive=entry.policy.exclusive,
            active=entry.active,
            running=len(entry.running),
            next_fire_at=upcoming,
            next_fire_local=None if upcoming is None else upcoming.astimezone(entry.zone),
            expression=_expression(entry.trigger),
            retries=entry.policy.retries,
            max_runtime_ms=entry.policy.max_runtime_ms,
        )

    def stop(self, name: str) -> None:
        """Stop firing a schedule (a run in progress goes on)."""
        entry = self._entry(name)
        if entry.active and self._started_at is not None:
            entry.stopped_at = self._clock()
        entry.active = False
        entry.version += 1
        entry.next_at = None

    def start(self, name: str) -> None:
        """Resume a stopped schedule from its next fire time after now.

        Ticks that fell while it was stopped are not caught up; exclusive ones without a row are
        recorded as skipped (``"paused"``).
        """
        entry = self._entry(name)
        if not entry.active:
            entry.active = True
            if self._started_at is not None:
                now = self._clock()
                if entry.stopped_at is not None:
                    self._sup.record_paused(entry, entry.stopped_at, now)
                entry.stopped_at = None
                self._arm(entry, now)

    def remove(self, name: str) -> None:
        """Stop and forget a schedule (a run in progress goes on; ``aclose`` still awaits it)."""
        self.stop(name)
        entry = self._entries.pop(name)
        entry.removed = True
        if self._control is not None:
            self._control.changed(name)

    # --- control plane -----------------------------------------------------------------------

    def link(self, control: ControlLink) -> None:
        """Lend this scheduler to a control plane (``ScheduleControl.start`` calls this): every
        tick start passes its gate, every handler (present and future) runs wrapped, regular
        fires of exclusive schedules go by its owners, and it is told of each schedule added or
        removed. The scheduler's own API stays usable as ever.
        """
        self._control = control
        self._sup.gate = control.gate
        self._sup.owners = control.owners
        for entry in self._entries.values():
            entry.handler = control.wrap(entry.name, entry.own_handler)

    def unlink(self, *, paused: Callable[[str], bool] | None = None) -> None:
        """Undo :meth:`link`: handlers are the schedules' own again, every replica asks.

        Args:
            paused: The paused state to keep while the scheduler goes on running: its timer
                fires until the scheduler itself stops, and a paused schedule must not start a
                tick in that window. That frozen gate lapses once this run of the scheduler ends
                (a later start has no gate).
        """
        self._control = None
        self._sup.owners = None
        run = self._started_at
        if paused is None or run is None:
            self._sup.gate = None
        else:

            def frozen(name: str) -> str | None:
                if self._started_at is not run or not paused(name):
                    return None
                return "paused"

            self._sup.gate = frozen
        for entry in self._entries.values():
            entry.handler = entry.own_handler

    # --- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.start_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @property
    def running(self) -> bool:
        """Whether :meth:`start_all` ran and :meth:`aclose` did not yet."""
        return self._started_at is not None

    async def start_all(self) -> None:
        """Start firing every active schedule (``async with scheduler`` calls this).

        A scheduler can be started again after :meth:`aclose`.

        Raises:
            RuntimeError: It is already running.
        """
        if self._started_at is not None:
            raise RuntimeError("this Scheduler is already running; call aclose() first")
        now = self._clock()
        self._started_at = now
        self._sup.closed = False
        self._timer.reset()
        for entry in self._entries.values():
            if isinstance(entry.trigger, OnceTrigger):
                entry.trigger = OnceTrigger(entry.trigger.kind, entry.trigger.delay_ms, now)
            entry.pending = NO_INSTANTS
            if entry.active:
                self._arm(entry, now)
        await self._sup.catch_up_at_start(list(self._entries.values()), now, self._entries)
        loops = Loops("sdcore-scheduler", logger=self._log)
        await loops.start()
        self._loops = loops
        self._loop_task = loops.spawn("timer", self._timer.run)
        self._sweep_task = loops.spawn("sweep", self._sweep)

    async def aclose(self) -> None:
        """Stop firing; every tick this scheduler started (removed schedules' too) may finish
        within the grace period, then is cancelled and awaited."""
        for task in (self._loop_task, self._sweep_task):
            if task is not None:
                task.cancel()
        loops, self._loops = self._loops, None
        if loops is not None:
            await loops.aclose(grace_s=None)  # both loops are cancelled: wait for them to end
        self._loop_task = self._sweep_task = None
        await self._sup.shutdown()
        self._started_at = None
        for entry in self._entries.values():
            entry.next_at = None
            entry.version += 1

    def _arm(self, entry: Entry, after: datetime) -> None:
        self._timer.arm(entry, after)

    def _live(self, entry: Entry, version: int | None = None) -> bool:
        return (
            (version is None or version == entry.version)
            and entry.active
            and self._entries.get(entry.name) is entry
        )

    async def _sweep(self) -> None:
        while True:
            entries = [e for e in self._entries.values() if e.policy.catch_up is not CatchUp.OFF]
            lease = min((e.policy.lease_ms for e in entries), default=30_000)
            await asyncio.sleep(max(1.0, min(lease, 60_000) / 1000))
            await self._sup.sweep(entries, self._clock, self._live)

    # --- missed ticks ------------------------------------------------------------------------

    def expected_ticks(self, name: str, start: datetime, end: datetime) -> list[datetime]:
        """Return the scheduled instants of ``name`` in ``[start, end)`` (at most 10,000)."""
        entry = self._entry(name)
        return expected_instants(entry.trigger, start, end, limit=MAX_RANGE_TICKS)

    async def missed_ticks(
        self, name: str, start: datetime, end: datetime, *, jobs: BaseJobScheduler | None = None
    ) -> list[MissedTick]:
        """Return the ticks of ``name`` in ``[start, end)`` that have no ``SUCCESS`` row.

        A tick skipped on purpose (overlap) is listed with ``skipped`` set and 0 ``attempts``;
        one that never started has ``status`` ``None``.

        Args:
            name: The schedule.
            start: Range start (aware, inclusive).
            end: Range end (aware, exclusive).
            jobs: The job scheduler to ask (default: the scheduler's own).

        Raises:
            ScheduleNotFoundError: Unknown schedule.
            InvalidScheduleError: No job scheduler, or not a cron/interval schedule.
            ValueError: Unaware bounds or more than 10,000 ticks.
        """
        entry = self._entry(name)
        source = jobs or self._jobs
        if source is None or entry.kind not in (ScheduleKind.CRON, ScheduleKind.INTERVAL):
            raise InvalidScheduleError(
                entry.name, "missed ticks need jobs and a cron or interval schedule"
            )
        instants = expected_instants(entry.trigger, start, end, limit=MAX_RANGE_TICKS)
        return await missed(source, entry.name, entry.trigger, instants)


def _expression(trigger: Trigger) -> str:
    """The cron expression, or the interval in ms as text, as stored schedules record them."""
    if isinstance(trigger, CronTrigger):
        return trigger.spec.expression
    if isinstance(trigger, IntervalTrigger):
        return str(trigger.every_ms)
    return ""
