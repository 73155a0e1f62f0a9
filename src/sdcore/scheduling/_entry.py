"""``Entry``: one registered schedule and its state on this scheduler (the registry's record)."""

from __future__ import annotations

import asyncio
from collections.abc import Set as AbstractSet
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from sdcore.scheduling._catch_up import Resumed
from sdcore.scheduling._policy import CatchUp, RunPolicy
from sdcore.scheduling._runner import Handler
from sdcore.scheduling._triggers import ScheduleKind, Trigger

__all__ = ["NO_INSTANTS", "Entry"]

# The catch-up instants of a schedule that has none (nearly all, nearly always): one shared empty
# frozenset instead of two empty sets per schedule (432 bytes and two objects the collector
# walks). A schedule gets sets of its own when catch-up starts instants (``TickStarter``).
NO_INSTANTS: frozenset[datetime] = frozenset()


class Entry:
    """One registered schedule and its state on this scheduler."""

    __slots__ = (
        "actions_waiting",
        "active",
        "active_since",
        "catch_up_owed",
        "handler",
        "in_flight",
        "kind",
        "name",
        "next_at",
        "offered",
        "own_handler",
        "pending",
        "policy",
        "removed",
        "resumed",
        "running",
        "stopped_at",
        "swept_until",
        "trigger",
        "version",
        "zone",
    )

    def __init__(
        self, name: str, trigger: Trigger, handler: Handler, zone: ZoneInfo, policy: RunPolicy
    ) -> None:
        self.name = name
        self.kind = trigger.kind
        self.trigger = trigger
        self.handler = handler  # what runs: own_handler, wrapped by a linked control plane
        self.own_handler = handler  # the application's handler
        self.zone = zone
        self.policy = policy
        self.active = True
        self.removed = False
        self.running: set[asyncio.Task[Any]] = set()
        self.in_flight: set[datetime] = set()
        self.next_at: datetime | None = None
        self.version = 0
        self.active_since: datetime | None = None
        self.swept_until: datetime | None = None
        # The start whose start-up catch-up this replica left to the schedule's owners: it does
        # it once it owns the schedule (sweep).
        self.catch_up_owed: datetime | None = None
        self.pending: AbstractSet[datetime] = NO_INSTANTS
        # The schedule's latest pause, when a resume ended it (set by a linked control plane):
        # start-up catch-up also starts the ticks that pause recorded as skipped.
        self.resumed: Resumed | None = None
        self.offered: AbstractSet[datetime] = NO_INSTANTS
        self.stopped_at: datetime | None = None
        # Triggers and backfills refused for overlap that wait for the runs in their way to end:
        # the pending catch-up ticks give way to them, and so does a live fire waiting for a live
        # run on the database (each one's run ends, then the next starts).
        self.actions_waiting = 0

    def upcoming(self, now: datetime) -> datetime | None:
        """The next instant after ``now`` this schedule fires at: the one it is armed at, or,
        while the timer has not looked at an instant that passed yet (a burst it looks at
        later, a loop running late), the one after ``now``."""
        at = self.next_at
        if at is None or at > now:
            return at
        return self.trigger.next_after(now)

    @property
    def catches_up(self) -> bool:
        """Whether catch-up and the sweep apply to this schedule."""
        return (
            self.policy.catch_up is not CatchUp.OFF
            and self.policy.exclusive
            and self.kind in (ScheduleKind.CRON, ScheduleKind.INTERVAL)
        )
