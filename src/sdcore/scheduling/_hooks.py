"""``SchedulerHooks``: the control plane's one way into a :class:`Scheduler`.

The control plane (``_plane.py``, ``_actions.py``, ``_history.py``) reads the registry, starts
ticks through the supervisor's one start path, and installs two hooks — the pause gate and the
run-history wrapper — only through this class, so the scheduler's internals can change without
the control plane following them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from sdcore.job_scheduler import BaseJobScheduler
from sdcore.scheduling._entry import Entry
from sdcore.scheduling._owners import Owners
from sdcore.scheduling._policy import MAX_PERIOD_MS, StartPath, check_ms, check_name
from sdcore.scheduling._runner import Handler, TickOutcome
from sdcore.scheduling._scheduler import Scheduler
from sdcore.scheduling._triggers import IntervalTrigger, Tick

__all__ = ["SchedulerHooks"]


class SchedulerHooks:
    """What the control plane may see and do in one scheduler.

    Args:
        scheduler: The scheduler (its public API stays usable as ever).
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._originals: dict[str, Handler] = {}

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

    def install(
        self,
        gate: Callable[[str], str | None],
        wrap: Callable[[str, Handler], Handler],
        owners: Owners | None = None,
    ) -> None:
        """Gate every tick start by ``gate``, wrap every handler (present and future), and let
        ``owners`` decide which exclusive ticks this replica asks for."""
        scheduler = self.scheduler
        scheduler._sup.gate = gate
        scheduler._sup.owners = owners
        scheduler._wrap = wrap
        for entry in scheduler._entries.values():
            if entry.name not in self._originals:
                self._originals[entry.name] = entry.handler
                entry.handler = wrap(entry.name, entry.handler)

    def watch(self, changed: Callable[[str], None] | None) -> None:
        """Call ``changed(name)`` after every schedule added or removed (``None``: stop)."""
        self.scheduler._on_change = changed

    def add_interval(
        self,
        name: str,
        every_ms: int,
        handler: Handler,
        zone: ZoneInfo,
        options: Mapping[str, Any],
    ) -> None:
        """Register an interval schedule whose ticks carry ``zone`` (a stored schedule's)."""
        check_name(name)
        every = check_ms(name, "every_ms", every_ms, minimum=1, maximum=MAX_PERIOD_MS)
        self.scheduler._add(name, IntervalTrigger(every), handler, zone, options)

    def uninstall(self, *, paused: Callable[[str], bool] | None = None) -> None:
        """Remove the wrapper, the watch and the live gate (handlers are the schedules' own again).

        Args:
            paused: The paused state to keep while the scheduler goes on running: its timer
                fires until the scheduler itself stops, and a paused schedule must not start a
                tick in that window. That frozen gate lapses once this run of the scheduler ends
                (a later start has no gate).
        """
        scheduler = self.scheduler
        scheduler._on_change = None
        scheduler._sup.owners = None  # nothing reads the cluster any more: every replica asks
        run = scheduler._started_at
        if paused is None or run is None:
            scheduler._sup.gate = None
        else:

            def frozen(name: str) -> str | None:
                if scheduler._started_at is not run or not paused(name):
                    return None
                return "paused"

            scheduler._sup.gate = frozen
        scheduler._wrap = None
        for name, handler in self._originals.items():
            entry = scheduler._entries.get(name)
            if entry is not None:
                entry.handler = handler
        self._originals.clear()

    def release_unknown(self) -> None:
        """The gate knows the paused state again: offer the fires that waited for it."""
        self.scheduler._sup.release_unknown()

    def launch(
        self, entry: Entry, at: datetime, path: StartPath, *, tick: Tick | None = None
    ) -> asyncio.Task[TickOutcome] | None:
        """Start one tick through the supervisor (overlap and gate apply); ``None``: refused."""
        return self.scheduler._sup.launch(entry, at, path, deadline=None, tick=tick)

    def catch_up(self, entry: Entry, instants: list[datetime]) -> None:
        """Start missed ticks as start-up catch-up does (one after the other under ``skip``)."""
        self.scheduler._sup.start_pending(
            entry, instants, StartPath.CATCH_UP, log_level=logging.INFO
        )
