"""The timer loop: armed schedules grouped by instant, and batch start of the ticks due together.

Schedules are armed in **buckets**: one per instant (and per kind, below), holding its schedules
in two parallel lists, so that a burst (thousands of stored per-customer schedules at 08:00)
costs one heap item, and no object per schedule for the garbage collector. A bucket holds either
exclusive schedules whose ticks go by owners (:mod:`sdcore.scheduling._owners`), or the others.

When a bucket comes due, the loop starts its ticks in slices of :data:`SLICE`:

1. each tick of the slice is started (its task created) without computing its next fire time:
   a tick less than its trigger's spacing late, or in a bucket of owned ticks less than the
   bucket's gap (the least time from its instant to the next instant of any schedule in it),
   cannot have a successor that is already due;
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
asks for it at all: at the instant as a first owner, later as a second or third
(:mod:`sdcore.scheduling._owners`), or not at all. Only the first owner of a bucket of
:data:`BURST` ticks or more walks it at the instant, where it needs the CPU (on a fleet of 24,
23 other replicas walked 10,000 schedules at once). The others look at it later
(:meth:`Timer._later`, by this replica's place among the ticks' owners, :meth:`TickStarter.place`):

- a later owner at its turn, one or two owner delays after the instant. It asks for the ticks
  armed at the instant whose schedules are still active (one stopped and started meanwhile is
  asked for, as a waiting fire would be; compaction leaves the bucket alone), however late the
  loop gets there (the instants that passed after it are coalesced as usual). Each is ranked in
  the owners' order the view had at the instant: a replica that joined meanwhile does not take
  the turn (it did not fire the tick). A schedule replaced meanwhile (its stored definition
  changed) takes its old entry's place in the bucket (:meth:`Timer.replace`), whatever its new
  timing, as a fire waiting in the starter would (:meth:`TickStarter.replace`);
- any other replica three delays after the instant (at most half the gap), only to re-arm the
  ticks; it asks for one only if its view now says it has become an owner.

A smaller bucket costs less than waking up again: its later owners' fires wait in the starter.

A tick later than that (the loop was blocked, the process suspended) takes the old path: ticks
that passed are coalesced to the latest, then it starts.
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
from sdcore.scheduling._owners import OWNERS, Order, second_delay
from sdcore.scheduling._policy import StartPath
from sdcore.scheduling._supervisor import TickStarter
from sdcore.scheduling._triggers import OnceTrigger, Trigger

SLICE = 100  # ticks started between two yields
# Owned ticks due at one instant that only their first owner walks at the instant (a smaller
# bucket costs the others less than waking up again for it).
BURST = SLICE
_MAX_SLEEP = 30.0
_MAX_NEXT = 4096  # next instants kept, by (trigger, instant)


class NextFire:
    """The fire instant after ``due``, computed on first use; one per equal trigger and instant."""

    __slots__ = ("_value", "due", "trigger")

    def __init__(
        self, trigger: Trigger, due: datetime, value: datetime | bool | None = False
    ) -> None:
        self.trigger = trigger
        self.due = due
        self._value = value  # False: not computed yet

    def __call__(self) -> datetime | None:
        value = self._value
        if value is False:
            value = self._value = self.trigger.next_after(self.due)
        assert value is not True  # noqa: S101 - for the type checker
        return value


class Bucket:
    """The schedules armed at one instant: entries with the version each was armed at (an entry
    re-armed, stopped or removed since is stale here, and skipped).

    Attributes:
        due: The instant.
        owned: Whether its schedules' ticks go by owners (:meth:`TickStarter.routed`).
        gap: The least time from ``due`` to the next instant of any schedule armed in it
            (``None``: none has one, or not an owned bucket).
        at: When the loop looks at it: ``due``, or later on a replica that is not their first
            owner (set once it came due).
        turn: This replica's place among the owners of its ticks when it came due, if it
            looks at it later as one of them (1 or 2; 0 otherwise).
        order: The owners' order of ``due``'s epoch at that time, which ranks its ticks then
            (:meth:`Owners.order`).
        index: Each entry's position, once :meth:`Timer.replace` looked one up.
    """

    __slots__ = ("at", "due", "entries", "gap", "index", "order", "owned", "turn", "versions")

    def __init__(self, due: datetime, owned: bool) -> None:
        self.due = due
        self.owned = owned
        self.entries: list[Entry] = []
        self.versions: list[int] = []
        self.gap: timedelta | None = None
        self.at: datetime | None = None
        self.turn = 0
        self.order: Order | None = None
        self.index: dict[Entry, int] | None = None

    def keep(self, live: Callable[[Entry, int | None], bool]) -> int:
        """Drop the entries ``live`` says are stale; how many are left."""
        pairs = zip(self.entries, self.versions, strict=True)
        if all(live(entry, version) for entry, version in pairs):
            return len(self.entries)  # (the usual case: no list, no object per entry)
        kept = [
            (entry, version)
            for entry, version in zip(self.entries, self.versions, strict=True)
            if live(entry, version)
        ]
        self.entries = [entry for entry, _ in kept]
        self.versions = [version for _, version in kept]
        return len(kept)


# A heap item: (when the loop looks at the bucket, arm sequence, bucket).
_Item = tuple[datetime, int, Bucket]


class Timer:
    """The armed schedules and the loop that fires them.

    Args:
        supervisor: Starts ticks (and owns their tasks).
        clock: The scheduler's wall clock.
        logger: The scheduler's logger.
        live: Whether an entry (at a heap version, if given) is still armed and registered.
        registered: How many schedules are registered (to bound the stale items kept).
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
        self._open: dict[tuple[datetime, bool], Bucket] = {}  # buckets not yet due, by instant
        self.armed = 0  # entries in the buckets not yet due, stale ones included
        # The instant after an armed one (for its bucket's gap), reused when it fires.
        self._next: dict[tuple[Trigger, datetime], datetime | None] = {}
        self._last_next: tuple[Trigger, datetime, datetime | None] | None = None
        # The buckets of owned ticks this replica asks for at a later turn, from the instant
        # until they are walked.
        self._waiting: list[Bucket] = []
        self._seq = itertools.count()
        self._wake: asyncio.Event | None = None
        self._last: NextFire | None = None  # the last NextFire of this burst

    def reset(self) -> None:
        """Forget every armed instant (before a start)."""
        self.heap.clear()
        self._open.clear()
        self._waiting.clear()
        self.armed = 0
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
        due = entry.next_at
        assert due is not None  # noqa: S101 - checked by the callers
        owned = self._sup.routed(entry)
        bucket = self._open.get((due, owned))
        if bucket is None:
            bucket = self._open[due, owned] = Bucket(due, owned)
            heapq.heappush(self.heap, (due, next(self._seq), bucket))
        bucket.entries.append(entry)
        bucket.versions.append(entry.version)
        self.armed += 1
        if owned:
            following = self._following(entry.trigger, due)
            if following is not None and (bucket.gap is None or following - due < bucket.gap):
                bucket.gap = following - due

    def _following(self, trigger: Trigger, due: datetime) -> datetime | None:
        """The instant after ``due`` (computed once per equal trigger and instant)."""
        last = self._last_next
        if last is not None and last[0] is trigger and last[1] == due:
            return last[2]  # the schedules of one burst, re-armed one after the other
        key = (trigger, due)
        if key in self._next:
            following = self._next[key]
        else:
            if len(self._next) >= _MAX_NEXT:
                self._next.clear()
            following = self._next[key] = trigger.next_after(due)
        self._last_next = (trigger, due, following)
        return following

    def _compact(self) -> None:
        # stop/start/remove leave stale items until their due time (a day, for a daily job):
        # rebuild the buckets once they outnumber the live schedules.
        if self.armed <= 2 * self._registered() + 64:
            return
        kept: list[_Item] = []
        self.armed = 0
        for item in self.heap:
            bucket = item[2]
            if bucket.at is not None:
                kept.append(item)  # came due: looked at soon, as it was then
                continue
            live = bucket.keep(self._live)
            if live:
                kept.append(item)
                self.armed += live
            elif self._open.get((bucket.due, bucket.owned)) is bucket:
                del self._open[bucket.due, bucket.owned]
        heapq.heapify(kept)
        self.heap = kept

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
        """The first time in ``[after, until]`` at which the loop looks at a bucket where
        ``starts`` says this replica starts a tick, or ``None``. The heap is walked in order from
        its top, down to ``until`` only (the buckets before ``after`` are skipped, not their
        order); a bucket this replica leaves to their owners is skipped whole."""
        heap = self.heap
        frontier: list[tuple[datetime, int]] = [(heap[0][0], 0)] if heap else []
        while frontier:
            at, index = heapq.heappop(frontier)
            if at > until:
                return None
            bucket = heap[index][2]
            due, turn = bucket.due, bucket.turn
            # (A later owner's turn asks for every tick of its bucket still active.)
            if (
                after <= at
                and (turn or not (bucket.owned and self._sup.place(due, bucket.entries) >= OWNERS))
                and any(
                    self._live(entry, None if turn else version) and (turn or starts(entry, due))
                    for entry, version in zip(bucket.entries, bucket.versions, strict=True)
                )
            ):
                return at
            for child in (2 * index + 1, 2 * index + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child][0], child))
        return None

    def _take(self, now: datetime) -> Bucket | None:
        """The next bucket to look at now, taken off the heap, or ``None``. A burst of owned ticks
        whose first owner this replica is not goes back under the time it looks at it."""
        heap = self.heap
        while heap and heap[0][0] <= now:
            _, _, bucket = heapq.heappop(heap)
            if bucket.at is None:
                bucket.at = bucket.due
                self.armed -= len(bucket.entries)
                if self._open.get((bucket.due, bucket.owned)) is bucket:
                    del self._open[bucket.due, bucket.owned]
                if bucket.owned and len(bucket.entries) >= BURST and self._later(bucket) > now:
                    heapq.heappush(heap, (bucket.at, next(self._seq), bucket))
                    continue
            return bucket
        return None

    def _later(self, bucket: Bucket) -> datetime:
        """When this replica looks at a burst of owned ticks that has just come due (sets
        ``bucket.at``): at once as their first owner; at its turn as a later one; after the
        last owner's turn (at most half the gap) as none of them, only to re-arm them."""
        place = self._sup.place(bucket.due, bucket.entries)
        if place == 0:
            return bucket.due
        later = min(place, OWNERS) * second_delay(bucket.gap)
        half = None if bucket.gap is None else bucket.gap.total_seconds() / 2
        if place < OWNERS:
            order = self._sup.order(bucket.due)
            if order is None or (half is not None and later > half):
                return bucket.due  # its turns wait in the starter (TickStarter._start_later)
            # Its ticks are asked for then as they ranked now, and as they were armed now: one
            # stopped and started meanwhile is still asked for, one stale now is not.
            bucket.turn, bucket.order = place, order
            bucket.keep(self._live)
            self._waiting.append(bucket)
        elif half is not None:
            later = min(later, half)
        bucket.at = bucket.due + timedelta(seconds=later)
        return bucket.at

    def replace(self, old: Entry, new: Entry) -> bool:
        """``new`` takes ``old``'s place in the buckets this replica asks for at a later turn
        (its schedule changed meanwhile): the instant's tick is asked for as ``new``'s, whatever
        ``new``'s timing, as a fire waiting in the starter is (:meth:`TickStarter.replace`);
        ``True`` if ``old`` had such a tick. ``new`` is not armed again from there."""
        found = False
        for bucket in self._waiting:
            index = bucket.index
            if index is None:
                index = bucket.index = {entry: i for i, entry in enumerate(bucket.entries)}
            position = index.pop(old, None)
            if position is not None:
                bucket.entries[position] = new
                bucket.versions[position] = -1  # never a version of new's
                index[new] = position
                found = True
        return found

    def _walked(self, bucket: Bucket | None) -> None:
        """``bucket`` has been walked (or put back as another)."""
        if bucket is not None and bucket.turn:
            self._waiting = [b for b in self._waiting if b is not bucket]

    def _put_back(self, bucket: Bucket, done: int) -> None:
        """Arm again what a bucket taken off the heap still holds after ``done`` entries (the
        loop stopped in its middle: a crash it restarts after, or a cancellation)."""
        rest = Bucket(bucket.due, bucket.owned)
        rest.entries, rest.versions = bucket.entries[done:], bucket.versions[done:]
        rest.gap, rest.at, rest.turn, rest.order = bucket.gap, bucket.at, bucket.turn, bucket.order
        heapq.heappush(self.heap, (bucket.at or bucket.due, next(self._seq), rest))
        self._walked(bucket)
        if rest.turn:
            self._waiting.append(rest)

    async def _fire_due(self, now: datetime) -> None:
        memo: dict[tuple[Trigger, datetime], NextFire] = {}
        self._last = None
        # The ticks started on time, to re-arm after the burst: parallel lists, so that a burst
        # leaves no object per tick behind for the garbage collector (equal triggers due at one
        # instant share their NextFire).
        entries: list[Entry] = []
        versions: list[int] = []
        followings: list[NextFire] = []
        bucket: Bucket | None = None
        done = 0  # the bucket's entries looked at
        rearmed = 0  # the ticks started on time that are armed again
        try:
            try:
                bucket = self._take(now)
                while bucket is not None:
                    due = bucket.due
                    within = bucket.gap if bucket.owned else None
                    turn, order = bucket.turn, bucket.order
                    armed, armed_versions = bucket.entries, bucket.versions
                    for start in range(0, len(armed), SLICE):
                        for index in range(start, min(start + SLICE, len(armed))):
                            done = index + 1
                            entry, version = armed[index], armed_versions[index]
                            # At its turn, a later owner asks for every tick armed at the
                            # instant whose schedule is still active, as ranked then.
                            if not self._live(entry, None if turn else version):
                                continue
                            try:
                                rank = self._sup.route(entry, due, order) if turn else None
                                following = self._fire(entry, version, due, now, memo, within, rank)
                            except Exception:  # noqa: BLE001 - one bad schedule must not stop the others
                                self._fire_failed(entry)
                                continue
                            if following is not None:
                                entries.append(entry)
                                versions.append(version)
                                followings.append(following)
                        # Let this slice's handlers start; once enough exclusive ticks have
                        # started (or the burst is over), close their batch and let its
                        # statement go out.
                        await asyncio.sleep(0)
                        last = start + SLICE >= len(armed)
                        if last:
                            self._walked(bucket)
                            bucket, done = self._take(now), 0
                        if self._sup.flush(final=last and bucket is None):
                            await asyncio.sleep(0)
                            await asyncio.sleep(0)
                    if not armed:
                        self._walked(bucket)
                        bucket, done = self._take(now), 0
            finally:
                if bucket is not None and done < len(bucket.entries):
                    self._put_back(bucket, done)
                else:
                    self._walked(bucket)
                self._sup.flush()  # never leave a batch open (cancelled mid-burst)
            while rearmed < len(entries):
                if rearmed % SLICE == 0:
                    await asyncio.sleep(0)  # lease answers are handled between slices
                self._rearm_started(entries[rearmed], versions[rearmed], followings[rearmed])
                rearmed += 1
        finally:
            # Stopped half way (a crash the loop is restarted after, or a cancellation): the
            # ticks already started are armed again all the same.
            for index in range(rearmed, len(entries)):
                self._rearm_started(entries[index], versions[index], followings[index])

    def _rearm_started(self, entry: Entry, version: int, following: NextFire) -> None:
        try:
            self._rearm(entry, version, following())
        except Exception:  # noqa: BLE001 - one bad schedule must not stop the others
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
        version: int,
        due: datetime,
        now: datetime,
        memo: dict[tuple[Trigger, datetime], NextFire],
        within: timedelta | None,
        rank: int | None,
    ) -> NextFire | None:
        """Start the tick due at ``due`` of ``entry`` armed at ``version``; return its successor,
        to re-arm after the burst.

        ``within``: how late a tick is still on time (its successor is after now): its bucket's
        gap, or (``None``) its trigger's spacing. ``rank``: this replica's place among the
        tick's owners (``None``: as the view says now). ``None``: already re-armed (the loop was
        late and ticks were coalesced).
        """
        spacing = entry.trigger.spacing
        if spacing is not None and now - due < (within or spacing):
            # On time: the next tick is after now, so nothing can be coalesced; its instant is
            # needed for re-arming (after the burst) and by a retry (on first use).
            trigger = entry.trigger
            following = self._last
            if following is None or following.trigger is not trigger or following.due != due:
                key = (trigger, due)
                following = memo.get(key)
                if following is None:
                    following = memo[key] = NextFire(trigger, due, self._next.get(key, False))
                self._last = following
            self._sup.start_tick(entry, due, StartPath.FIRE, deadline=following, rank=rank)
            return following
        # Coalesce ticks that passed while the loop was blocked or the process suspended: fire
        # only the most recent one (missed ticks are what the catch-up policy is for).
        skipped = 0
        instant, after = due, entry.trigger.next_after(due)
        next_instant = after
        while after is not None and after <= now and skipped < 100_000:
            due, after, skipped = after, entry.trigger.next_after(after), skipped + 1
        if skipped:
            self._log.info(
                "schedule %r: %d tick(s) passed while the loop was late; firing the latest",
                entry.name,
                skipped,
                extra={"action": "ticks_coalesced", "schedule": entry.name},
            )
        self._rearm(entry, version, after)
        if rank is not None:
            # A later owner's turn, however late: the instant's own tick is asked for all the
            # same, ranked as then (its earlier owners may be gone); later ones as ranked now.
            self._sup.start_tick(entry, instant, StartPath.FIRE, deadline=next_instant, rank=rank)
            if not skipped:
                return None
            rank = None
        self._sup.start_tick(entry, due, StartPath.FIRE, deadline=after, rank=rank)
        return None

    def _rearm(self, entry: Entry, version: int, following: datetime | None) -> None:
        if entry.version != version or not self._live(entry, None):
            return  # stopped, re-armed or removed since it fired
        entry.version += 1
        entry.next_at = following
        if following is not None:
            self._push(entry)
