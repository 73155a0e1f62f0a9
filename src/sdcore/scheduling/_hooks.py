"""``SchedulerHooks``: the control plane's one way into a :class:`Scheduler`.

The control plane (``_plane.py``, ``_actions.py``, ``_history.py``) reads the registry and starts
ticks through the supervisor's one start path only through this class, so the scheduler's
internals can change without the control plane following them. What it lends the scheduler (the
pause gate, the run-history wrapper, the owners, the registry watch) goes in by the scheduler's
own door, :meth:`Scheduler.link`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

from sdcore.job_scheduler import BaseJobScheduler
from sdcore.scheduling._cron import DayRule, InvalidScheduleError, load_zone
from sdcore.scheduling._entry import Entry
from sdcore.scheduling._owners import OWNERS
from sdcore.scheduling._policy import MAX_PERIOD_MS, StartPath, check_ms, check_name
from sdcore.scheduling._runner import Handler, TickOutcome
from sdcore.scheduling._scheduler import ControlLink, Scheduler
from sdcore.scheduling._triggers import (
    IntervalTrigger,
    ScheduleKind,
    Tick,
    Trigger,
)

__all__ = ["SchedulerHooks"]


class SchedulerHooks:
    """What the control plane may see and do in one scheduler.

    Args:
        scheduler: The scheduler (its public API stays usable as ever).
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    @property
    def jobs(self) -> BaseJobScheduler | None:
        """The scheduler's lease service (``None``: no exclusivity)."""
        return self.scheduler._jobs

    def entry(self, name: str) -> Entry | None:
        """The registered schedule ``name``, if any."""
        return self.scheduler._entries.get(name)

    def entries(self) -> list[Entry]:
        """Every registered schedule."""
        return list(self.scheduler._entries.values())

    def names(self) -> set[str]:
        """The names of every registered schedule."""
        return set(self.scheduler._entries)

    async def acquires_quiet(self, at_most_s: float) -> None:
        """Wait until no tick acquire is queued or in flight, at most ``at_most_s`` seconds."""
        acquirer = self.scheduler._sup.runner.acquirer
        if acquirer is not None:
            await acquirer.quiet(at_most_s)

    def link(self, control: ControlLink) -> None:
        """Lend the scheduler to the control plane (:meth:`Scheduler.link`)."""
        self.scheduler.link(control)

    def put_stored(
        self,
        name: str,
        kind: ScheduleKind,
        expression: str,
        time_zone: str | None,
        day_rule: DayRule | str,
        handler: Handler,
        options: Mapping[str, Any],
    ) -> None:
        """Register a stored schedule, or replace the one of that name that runs here (its runs
        going on and fires waiting here carry over: :meth:`TickStarter.replace`).

        Raises:
            InvalidScheduleError, ValueError, TypeError: The definition cannot run here; nothing
                changed.
        """
        check_name(name)
        scheduler = self.scheduler
        trigger: Trigger
        if kind is ScheduleKind.CRON:
            trigger, zone = scheduler._cron_trigger(name, expression, time_zone, day_rule)
        elif kind is ScheduleKind.INTERVAL:
            # An interval's zone is its ticks' local time only.
            zone = load_zone(time_zone, name)
            every = check_ms(name, "every_ms", int(expression), minimum=1, maximum=MAX_PERIOD_MS)
            trigger = IntervalTrigger(every)
        else:
            raise InvalidScheduleError(name, f"a stored schedule is cron or interval, not {kind}")
        scheduler._add(name, trigger, handler, zone, options, replace=True)

    def unlink(self, *, paused: Callable[[str], bool] | None = None) -> None:
        """Take the scheduler back (:meth:`Scheduler.unlink`; ``paused``: the frozen gate)."""
        self.scheduler.unlink(paused=paused)

    def next_start_in(self, after_s: float, within_s: float) -> float | None:
        """Seconds until the first instant in ``[after_s, within_s]`` (seconds from now) at which
        this replica may start a tick (one it fires, or asks for as one of its owners), or
        ``None``; ``after_s`` while ticks are in progress here (a retry reads the gate again)
        or wait for a later owner's turn."""
        scheduler = self.scheduler
        sup = scheduler._sup
        if not scheduler.running:
            return None
        if sup.tasks or sup.waiting:
            return after_s
        now = scheduler._clock()
        due = scheduler._timer.next_start(
            now + timedelta(seconds=after_s),
            now + timedelta(seconds=within_s),
            lambda entry, at: entry.active and sup.route(entry, at) < OWNERS,
        )
        return None if due is None else (due - now).total_seconds()

    def release_unknown(self) -> None:
        """The gate knows the paused state again: offer the fires that waited for it."""
        self.scheduler._sup.release_unknown()

    def launch(
        self, entry: Entry, at: datetime, path: StartPath, *, tick: Tick | None = None
    ) -> asyncio.Task[TickOutcome] | None:
        """Start one tick through the supervisor (overlap and gate apply); ``None``: refused."""
        return self.scheduler._sup.launch(entry, at, path, deadline=None, tick=tick)

    def drain(self, entry: Entry) -> None:
        """Start the next pending catch-up tick of ``entry`` if nothing keeps it waiting."""
        self.scheduler._sup.drain(entry)

    def catch_up(self, entry: Entry, instants: list[datetime]) -> None:
        """Start missed ticks as start-up catch-up does (one after the other under ``skip``)."""
        self.scheduler._sup.start_pending(
            entry, instants, StartPath.CATCH_UP, log_level=logging.INFO
        )
