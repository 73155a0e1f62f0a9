"""The timer loop: a heap of next fire instants, and batch start of the ticks due together.

When many schedules are due at one instant (thousands of stored per-customer schedules at
08:00), the loop starts them in slices of :data:`SLICE` ticks:

1. each tick of the slice is started (its task created) without computing its next fire time:
   a tick that is on time (less than its trigger's spacing late) cannot have a successor that
   is already due, so nothing can be coalesced;
2. the loop yields once: the handlers of non-exclusive ticks run to their first ``await``. A
   slice is small (100) so that its ticks' objects die before the garbage collector's young
   generation fills up: a burst then promotes almost nothing to the old generation, and no
   full collection runs in the middle of it;
3. exclusive ticks join the supervisor's open batch; the loop closes it once it holds
   :data:`~sdcore.scheduling._supervisor.BATCH_TICKS` ticks, or when no due tick is left, and
   its lease requests go out together through the :class:`~sdcore.scheduling._batch.
   TickAcquirer` — one ``acquire_attempts`` call (one statement on PostgreSQL) per batch;
4. once every due tick has started, the next fire times are computed (once per distinct trigger
   and instant: the 10,000 schedules of one stored expression share one trigger object and one
   computation) and re-armed, yielding between slices so that lease answers are handled
   meanwhile.

Every tick goes through :meth:`TickStarter.start_tick`, which also decides whether this replica
asks for it at all (:mod:`sdcore.scheduling._owners`): on a fleet, most replicas leave most
exclusive ticks to their owners and only re-arm them.

A tick that is late by its trigger's spacing or more (the loop was blocked, the process
suspended) takes the old path: ticks that passed are coalesced to the latest, then it starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from sdcore.scheduling._entry import Entry
from sdcore.scheduling._policy import StartPath
from sdcore.scheduling._supervisor import TickStarter
from sdcore.scheduling._triggers import OnceTrigger, Trigger

SLICE = 100  # ticks started between two yields
_MAX_SLEEP = 30.0
# A heap item: (due, arm sequence, entry version, entry).
_Item = tuple[datetime, int, int, Entry]


class NextFire:
    """The fire instant after ``due``, computed on first use; one per equal trigger and instant."""

    __slots__ = ("_value", "due", "trigger")

    def __init__(self, trigger: Trigger, due: datetime) -> None:
        self.trigger = trigger
        self.due = due
        self._value: datetime | bool | None = False  # False: not computed yet

    def __call__(self) -> datetime | None:
        value = self._value
        if value is False:
            value = self._value = self.trigger.next_after(self.due)
        assert value is not True  # noqa: S101 - for the type checker
        return value


class Timer:
    """The heap of armed schedules and the loop that fires them.

    Args:
        supervisor: Starts ticks (and owns their tasks).
        clock: The scheduler's wall clock.
        logger: The scheduler's logger.
        live: Whether an entry (at a heap version, if given) is still armed and registered.
        registered: How many schedules are registered (to bound the heap's stale items).
    """

    def __init__(
        self,
        supervisor: TickStarter,
        clock: Callable[[], datetime],
        logger: logging.Logger,
        live: Callable[[Entry, int | None], bool],
        registered: Callable[[], int],
    ) -> None:
        self._sup = supervisor
        self._clock = clock
        self._log = logger
        self._live = live
        self._registered = registered
        self.heap: list[_Item] = []
        self._seq = itertools.count()
        self._wake: asyncio.Event | None = None
        self._last: NextFire | None = None  # the last NextFire of this burst

    def reset(self) -> None:
        """Forget every armed instant (before a start)."""
        self.heap.clear()
        self._wake = asyncio.Event()

    def arm(self, entry: Entry, after: datetime) -> None:
        """Arm ``entry`` at its first fire instant after ``after`` (a one-shot: at or after)."""
        entry.version += 1
        entry.active_since = after
        if isinstance(entry.trigger, OnceTrigger):
            after = after - timedelta(microseconds=1)  # a one-shot may be due right now
        entry.next_at = entry.trigger.next_after(after)
        if entry.next_at is not None:
            self._push(entry)
            self._compact()
        if self._wake is not None:
            self._wake.set()

    def _push(self, entry: Entry) -> None:
        assert entry.next_at is not None  # noqa: S101 - checked by the callers
        heapq.heappush(self.heap, (entry.next_at, next(self._seq), entry.version, entry))

    def _compact(self) -> None:
        # stop/start/remove leave stale heap entries until their due time (a day, for a daily
        # job): rebuild the heap once they outnumber the live schedules.
        if len(self.heap) > 2 * self._registered() + 64:
            self.heap = [item for item in self.heap if self._live(item[3], item[2])]
            heapq.heapify(self.heap)

    async def run(self) -> None:
        """Fire due schedules until cancelled."""
        assert self._wake is not None  # noqa: S101 - set by reset
        while True:
            await self._fire_due(self._clock())
            delay = _MAX_SLEEP
            if self.heap:
                at = self.heap[0][0]
                delay = min(delay, max(0.0, (at - self._clock()).total_seconds()))
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()

    def next_start(
        self, after: datetime, until: datetime, starts: Callable[[Entry, datetime], bool]
    ) -> datetime | None:
        """The first armed instant in ``[after, until]`` at which ``starts`` says this replica
        starts a tick, or ``None``. The heap is walked in instant order from its top, down to
        ``until`` only (the instants before ``after`` are skipped, not their entries' order)."""
        heap = self.heap
        frontier: list[tuple[datetime, int]] = [(heap[0][0], 0)] if heap else []
        while frontier:
            due, index = heapq.heappop(frontier)
            if due > until:
                return None
            _, _, version, entry = heap[index]
            if due >= after and self._live(entry, version) and starts(entry, due):
                return due
            for child in (2 * index + 1, 2 * index + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child][0], child))
        return None

    def _due(self, now: datetime) -> bool:
        return bool(self.heap) and self.heap[0][0] <= now

    async def _fire_due(self, now: datetime) -> None:
        memo: dict[tuple[Trigger, datetime], NextFire] = {}
        self._last = None
        # The ticks started on time, to re-arm after the burst: parallel lists, so that a burst
        # leaves no object per tick behind for the garbage collector (equal triggers due at one
        # instant share their NextFire).
        entries: list[Entry] = []
        versions: list[int] = []
        followings: list[NextFire] = []
        try:
            more = self._due(now)
            while more:
                count = 0
                while count < SLICE and self._due(now):
                    due, _, version, entry = heapq.heappop(self.heap)
                    if not self._live(entry, version):
                        continue
                    count += 1
                    try:
                        following = self._fire(entry, due, now, memo)
                    except Exception:  # noqa: BLE001 - one bad schedule must not stop the others
                        self._fire_failed(entry)
                        continue
                    if following is not None:
                        entries.append(entry)
                        versions.append(entry.version)
                        followings.append(following)
                # Let this slice's handlers start; once enough exclusive ticks have started (or the
                # burst is over), close their batch and let its statement go out.
                await asyncio.sleep(0)
                more = self._due(now)
                if self._sup.flush(final=not more):
                    await asyncio.sleep(0)
                    await asyncio.sleep(0)
        finally:
            self._sup.flush()  # never leave a batch open (cancelled mid-burst)
        for index, entry in enumerate(entries):
            if index % SLICE == 0:
                await asyncio.sleep(0)  # lease answers are handled between slices
            try:
                self._rearm(entry, versions[index], followings[index]())
            except Exception:  # noqa: BLE001 - as above
                self._fire_failed(entry)

    def _fire_failed(self, entry: Entry) -> None:
        self._log.exception(
            "schedule %r: could not fire; it is stopped",
            entry.name,
            extra={"action": "fire_failed", "schedule": entry.name},
        )
        entry.active = False

    def _fire(
        self,
        entry: Entry,
        due: datetime,
        now: datetime,
        memo: dict[tuple[Trigger, datetime], NextFire],
    ) -> NextFire | None:
        """Start the tick due at ``due``; return its successor, to re-arm after the burst.

        ``None``: already re-armed (the loop was late and ticks were coalesced).
        """
        spacing = entry.trigger.spacing
        if spacing is not None and now - due < spacing:
            # On time: the next tick is after now, so nothing can be coalesced; its instant is
            # needed for re-arming (after the burst) and by a retry (on first use).
            trigger = entry.trigger
            following = self._last
            if following is None or following.trigger is not trigger or following.due != due:
                key = (trigger, due)
                following = memo.get(key)
                if following is None:
                    following = memo[key] = NextFire(trigger, due)
                self._last = following
            self._sup.start_tick(entry, due, StartPath.FIRE, deadline=following)
            return following
        # Coalesce ticks that passed while the loop was blocked or the process suspended: fire
        # only the most recent one (missed ticks are what the catch-up policy is for).
        skipped = 0
        after = entry.trigger.next_after(due)
        while after is not None and after <= now and skipped < 100_000:
            due, after, skipped = after, entry.trigger.next_after(after), skipped + 1
        if skipped:
            self._log.info(
                "schedule %r: %d tick(s) passed while the loop was late; firing the latest",
                entry.name,
                skipped,
                extra={"action": "ticks_coalesced", "schedule": entry.name},
            )
        self._rearm(entry, entry.version, after)
        self._sup.start_tick(entry, due, StartPath.FIRE, deadline=after)
        return None

    def _rearm(self, entry: Entry, version: int, following: datetime | None) -> None:
        if entry.version != version or not self._live(entry, None):
            return  # stopped, re-armed or removed since it fired
        entry.version += 1
        entry.next_at = following
        if following is not None:
            self._push(entry)
