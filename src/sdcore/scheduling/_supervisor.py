"""The tasks a scheduler owns, and the one path by which every tick starts.

Every tick (regular fire, start-up catch-up, sweep) goes through :meth:`TickStarter.start_tick`,
which applies the overlap policy in one place and records a tick skipped on purpose. Every task
belongs to the supervisor, not to a registry entry, so ``aclose()`` waits for (or cancels) the
ticks of removed schedules too.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import logging
import operator
from collections.abc import Callable, Coroutine, Iterable, Mapping
from collections.abc import Set as AbstractSet
from datetime import datetime, timedelta
from typing import Any

from sdcore._internal.telemetry import SKIPPED_OVERLAP, SKIPPED_PAUSE
from sdcore.job_scheduler import BaseJobScheduler, JobSchedulerError, TickRecord
from sdcore.scheduling._catch_up import (
    MAX_CATCH_UP,
    at_start,
    candidates,
    latest_instants,
    start_keys,
    started_at_start,
    tick_keys,
    unsettled,
)
from sdcore.scheduling._entry import NO_INSTANTS, Entry
from sdcore.scheduling._owners import LAST_ASK_S, OWNERS, Order, Owners, second_delay
from sdcore.scheduling._policy import _PATH, CatchUp, Overlap, StartPath
from sdcore.scheduling._policy import current_path as current_path  # re-exported
from sdcore.scheduling._runner import (
    GATE_UNKNOWN,
    Deadline,
    FirstOffer,
    TickOutcome,
    TickRunner,
    tick_options,
)
from sdcore.scheduling._triggers import ScheduleKind, Tick, make_tick

# The sweep looks at ticks this long past their instant; those of a schedule with owners also
# past the last owner's ask (LAST_ASK_S), so that it never starts a tick a later owner would.
_SWEEP_MARGIN = timedelta(seconds=1)
# Regular fires acquired together: the timer closes a batch once it holds this many ticks (its
# acquire is one statement of as many keys), or when the burst has no more due ticks.
BATCH_TICKS = 250
# A later owner whose turn is less than this far away asks now (a timer looks at an instant's
# ticks at that turn, up to a clock's rounding).
_TURN_COME_S = 0.001
# The most tick keys a sweep round reads in one statement (``tick_records``).
SWEEP_KEYS = 1_000
# A round (sweep or start-up catch-up) lets the loop run other tasks every this many schedules.
_YIELD_EVERY = 50
_OWNED_KINDS = (ScheduleKind.CRON, ScheduleKind.INTERVAL)
_name = operator.attrgetter("name")


@dataclasses.dataclass(frozen=True, slots=True)
class _Fire:
    """A regular fire acquired before its task exists (in an open batch), or one a later owner
    starts later."""

    entry: Entry
    due: datetime
    tick: Tick | None
    deadline: Deadline


@dataclasses.dataclass(frozen=True, slots=True)
class _Swept:
    """One schedule in a round of reads (a sweep's, or start-up catch-up's): the ticks to read
    (lock key -> instant), the end of the window looked at, and the instants its catch-up had
    chosen already (its pending set then)."""

    entry: Entry
    end: datetime
    keys: dict[str, datetime]
    chosen: AbstractSet[datetime]


class TickStarter:
    """Starts ticks through the policy checks and owns their tasks.

    Args:
        runner: Executes one tick.
        jobs: The lease service (``None``: no exclusivity, no catch-up).
        clock: The scheduler's wall clock.
        logger: The scheduler's logger.
        grace_s: How long ``shutdown`` lets ticks finish before cancelling them.
    """

    def __init__(
        self,
        runner: TickRunner,
        jobs: BaseJobScheduler | None,
        clock: Callable[[], datetime],
        logger: logging.Logger,
        grace_s: float,
    ) -> None:
        self._runner = runner
        self._jobs = jobs
        self._clock = clock
        self._log = logger
        self._grace = grace_s
        # Every owned task, with the tick it runs (``None``: a batch or a skip record); one done
        # callback per task ends both (a burst starts thousands of tasks).
        self._tasks: dict[asyncio.Task[Any], tuple[Entry, datetime] | None] = {}
        self._on_done = self._task_done
        self._batch: list[_Fire] | None = None  # the fires of this loop turn (start_tick)
        self._batch_task: asyncio.Task[Any] | None = None
        self._batch_go: asyncio.Future[None] | None = None  # closes the open batch
        # Every batch whose task has not ended (the open one, and those awaiting their acquire).
        self._batches: dict[asyncio.Task[Any], list[_Fire]] = {}
        # Set by the control plane (sdcore.scheduling._control): the reason a schedule's ticks
        # must not start now ("paused"), or None. Trigger and backfill starts pass it.
        self.gate: Callable[[str], str | None] | None = None
        # Set by the control plane: which replicas ask for an exclusive schedule's regular fires
        # (sdcore.scheduling._owners); None: every replica asks for every tick.
        self.owners: Owners | None = None
        # The fires this replica starts later as a later owner of their instant, by start time.
        self._later: dict[float, list[_Fire]] = {}
        self._later_handles: dict[float, asyncio.TimerHandle] = {}
        runner.held = self._held
        runner.admits = self._admits
        # Set from the start of shutdown until the scheduler starts again: no pending catch-up
        # tick starts any more (the end of a cancelled tick would otherwise start the next
        # one, a task that shutdown no longer waits for and that outlives aclose()).
        self.closed = False
        # Ticks started for past instants (backfill, catch-up, sweep): they do not make a live
        # fire of the same schedule an overlap skip (see _admit).
        self._background: set[asyncio.Task[Any]] = set()
        # The latest live fire of each schedule that waits for such a run to end. Only the
        # latest waits: a long run in the way would otherwise queue every fire of its length,
        # and replaying them one after the other puts the schedule behind for good (its fresh
        # fires are then overlap skips behind stale ones). An earlier fire it replaces is a
        # missed tick, without a row, that the catch-up policy decides about.
        self._deferred: dict[Entry, datetime] = {}
        # The schedules whose waiting fire waits for a live run waiting on the database: it
        # gives way to a trigger or backfill refused for that run (one behind a backfill or
        # catch-up run does not, or two backfills would keep the schedule waiting between them).
        self._yielding: set[Entry] = set()
        # The latest fire of each schedule that came while the gate could not tell whether it
        # is paused (GATE_UNKNOWN); started by release_unknown() once the gate knows again.
        self._unknown: dict[Entry, datetime] = {}
        # The schedules whose pending catch-up ticks the gate refused as unknown (ditto).
        self._unknown_pending: set[Entry] = set()
        # Set (and replaced) each time the gate knows the paused state again (release_unknown).
        self._known = asyncio.Event()

    def _admits(self, name: str) -> str | None:
        """The gate for a tick that has just won its lease, read at once (no waiting)."""
        gate = self.gate
        if gate is None or current_path() in (StartPath.TRIGGER, StartPath.BACKFILL):
            return None
        return gate(name)

    async def _held(self, name: str, until: datetime | None) -> str | None:
        """The gate for a tick already running in this task (before a retry, after a jitter):
        trigger and backfill ticks pass it, as at admission.

        An unknown state (the view is older than the propagation bound: the process slept
        during the backoff or the jitter) is not an answer: this waits until the state is read
        again, or until ``until`` (the next tick) and then answers :data:`GATE_UNKNOWN`, so
        that nothing starts on a pause this process may have slept through.
        """
        if current_path() in (StartPath.TRIGGER, StartPath.BACKFILL):
            return None
        while True:
            gate = self.gate  # re-read: a stopping control plane swaps in its frozen gate
            if gate is None:
                return None
            reason = gate(name)
            if reason != GATE_UNKNOWN:
                return reason
            left = 1.0
            if until is not None:
                left = min(left, (until - self._clock()).total_seconds())
            if left <= 0:
                return GATE_UNKNOWN
            # Not asyncio.wait_for: on Python 3.11 a cancel() racing its expiry is swallowed.
            waiter = asyncio.ensure_future(self._known.wait())
            try:
                await asyncio.wait({waiter}, timeout=left)
            finally:
                waiter.cancel()

    def release_unknown(self) -> None:
        """The gate knows again: offer the fires that waited for it (pause, overlap and the
        lease decide as for any fire), and wake the running ticks waiting in :meth:`_held`."""
        known, self._known = self._known, asyncio.Event()
        known.set()
        waiting, self._unknown = self._unknown, {}
        for entry, due in waiting.items():
            self.launch(entry, due, StartPath.FIRE, deadline=entry.upcoming(self._clock()))
        pending, self._unknown_pending = self._unknown_pending, set()
        for entry in pending:
            self.drain(entry)

    @property
    def runner(self) -> TickRunner:
        """The tick runner (the scheduler's telemetry hangs on it)."""
        return self._runner

    @property
    def waiting(self) -> bool:
        """Whether fires wait here for a later owner's turn (:meth:`_start_later`)."""
        return bool(self._later)

    @property
    def tasks(self) -> int:
        """Ticks (and skip records) in progress."""
        return len(self._tasks)

    def _batch_ended(self, batch: list[_Fire], task: asyncio.Task[Any]) -> None:
        """A batch task ended: cancelled (before or during its acquire), its ticks end here."""
        if self._batch is batch:
            self._batch = self._batch_go = None  # cancelled before it was closed
        self._batches.pop(task, None)
        for fire in batch:
            if task in fire.entry.running:
                fire.entry.running.discard(task)
                self._ended(fire.entry, fire.due, None)

    def _own(
        self,
        coro: Coroutine[Any, Any, Any],
        name: str,
        context: contextvars.Context | None = None,
        tick: tuple[Entry, datetime] | None = None,
    ) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name, context=context)
        self._tasks[task] = tick
        task.add_done_callback(self._on_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        tick = self._tasks.pop(task, None)
        if tick is not None:
            self._ended(tick[0], tick[1], task)
        if not task.cancelled() and (error := task.exception()) is not None:
            # The runner logs what a tick can raise; this is for what it could not foresee (a
            # job scheduler's bug in a skip record, …): logged once, never left for asyncio to
            # report as "Task exception was never retrieved".
            self._log.error(
                "Scheduler: task %r ended with an unexpected error: %s: %s",
                task.get_name(),
                type(error).__name__,
                str(error)[:500],
                exc_info=error,
                extra={"action": "task_failed", "task": task.get_name()},
            )

    def flush(self, *, final: bool = True) -> bool:
        """Close the batch of regular fires started so far and let its acquire go out; ``True``
        if one was closed.

        Args:
            final: Close it whatever its size (the burst has no more due ticks); otherwise only
                once it holds :data:`BATCH_TICKS` ticks (start slices are smaller than that).
        """
        batch, go = self._batch, self._batch_go
        if batch is None or go is None or (not final and len(batch) < BATCH_TICKS):
            return False
        self._batch = self._batch_go = None
        go.set_result(None)
        return True

    def start_tick(
        self,
        entry: Entry,
        due: datetime,
        path: StartPath,
        *,
        deadline: Deadline,
        rank: int | None = None,
    ) -> bool:
        """Start the tick of ``entry`` at ``due`` unless a policy says no; ``True`` if started.

        Overlap applies the same way on every path. A regular fire skipped by overlap is recorded
        as skipped (exclusive schedules); a catch-up or sweep start stays pending instead.

        A regular fire of an exclusive cron or interval schedule is started here only by the
        instant's owners: at once by the first, :func:`second_delay` after the instant by the
        second, twice that by the third. ``rank`` is this replica's place among them (0: ask
        now; ``None``: as :meth:`route` says now).

        A regular fire of an exclusive schedule is acquired before its task exists: the ticks
        started until the timer closes the batch (:meth:`flush`) share one batch task, which
        sends their acquires together and starts a task only for the ticks won here (and for the
        lost ones that still have retry offers to make). Until the answer, the batch task counts
        as the tick's run for the overlap policy, and the tick as in flight.
        """
        if path is StartPath.FIRE and rank != 0:
            if rank is None:
                rank = self.route(entry, due)
            if rank >= OWNERS:
                return False  # the schedule's owners ask for it
            if rank > 0 and self._start_later(_Fire(entry, due, None, deadline), rank):
                return True
        if path is not StartPath.FIRE or not self._runner.acquires_first(entry.policy):
            return self.launch(entry, due, path, deadline=deadline) is not None
        tick = self._admit(entry, due, path, None)
        if tick is None:
            return False
        batch, holder = self._batch, self._batch_task
        if batch is None or holder is None:
            batch = self._batch = []
            go = self._batch_go = asyncio.get_running_loop().create_future()
            holder = self._batch_task = self._own(
                self._acquire_batch(batch, go), "sdcore-tick-batch"
            )
            holder.add_done_callback(functools.partial(self._batch_ended, batch))
            self._batches[holder] = batch
        batch.append(_Fire(entry, due, tick, deadline))
        entry.running.add(holder)
        entry.in_flight.add(due)
        return True

    def route(self, entry: Entry, due: datetime | None = None, order: Order | None = None) -> int:
        """This replica's rank among the owners of ``entry``'s regular fire at ``due`` (``None``:
        of its catch-up and sweep): 0 asks at the instant, ``r`` below :data:`OWNERS` asks ``r``
        times :func:`second_delay` later, :data:`OWNERS` or more never (0 for every schedule
        that has no owners: not exclusive, one-shot, or no view of the cluster). ``order``: the
        instant's order as :meth:`Owners.order` read it earlier (default: the view's now)."""
        owners = self.owners
        if owners is None or not self.routed(entry):
            return 0
        if due is None:
            return owners.rank(entry.name)
        return owners.fire_rank(entry.name, due, order)

    def order(self, due: datetime) -> Order | None:
        """The owners' order of ``due``'s epoch as the view has it now (:meth:`Owners.order`)."""
        return None if self.owners is None else self.owners.order(due)

    def routed(self, entry: Entry) -> bool:
        """Whether ``entry``'s regular fires go by owners (once the cluster has a view)."""
        return self._jobs is not None and entry.policy.exclusive and entry.kind in _OWNED_KINDS

    def place(self, due: datetime, entries: list[Entry]) -> int:
        """This replica's place among the owners of every tick of ``entries`` (routed ones) at
        ``due`` at the least (:meth:`Owners.place`): 0 when it may be a first owner of one."""
        owners = self.owners
        return 0 if owners is None else owners.place(due, map(_name, entries))

    def owns(self, entry: Entry) -> bool:
        """Whether this replica does ``entry``'s start-up catch-up and sweep."""
        return self.route(entry) < OWNERS

    def _start_later(self, fire: _Fire, rank: int) -> bool:
        """Start ``fire`` as its instant's owner of ``rank`` (1 or more), ``rank`` times
        :func:`second_delay` after its instant: the fires of one instant that wait as long
        share one timer, and go out as one batch. ``False``: that time has come (the caller
        starts it now)."""
        loop = asyncio.get_running_loop()
        deadline = fire.deadline
        following = deadline() if callable(deadline) else deadline
        gap = None if following is None else following - fire.due
        wait = rank * second_delay(gap) - (self._clock() - fire.due).total_seconds()
        if wait < _TURN_COME_S:
            return False
        at = round(loop.time() + wait, 2)  # fires due together share one timer (10 ms apart)
        waiting = self._later.get(at)
        if waiting is None:
            waiting = self._later[at] = []
            handle = loop.call_at(at, self._start_waiting, at)
            self._later_handles[at] = handle
        waiting.append(fire)
        return True

    def _start_waiting(self, at: float) -> None:
        self._later_handles.pop(at, None)
        waiting = self._later.pop(at, [])
        if self.closed:
            return
        for fire in waiting:
            try:
                self.start_tick(
                    fire.entry, fire.due, StartPath.FIRE, deadline=fire.deadline, rank=0
                )
            except Exception:  # noqa: BLE001 - one bad schedule must not stop the others
                self._log.exception(
                    "schedule %r: could not start a tick",
                    fire.entry.name,
                    extra={"action": "fire_failed", "schedule": fire.entry.name},
                )
        self.flush()

    def launch(
        self,
        entry: Entry,
        due: datetime,
        path: StartPath,
        *,
        deadline: Deadline,
        tick: Tick | None = None,
    ) -> asyncio.Task[TickOutcome] | None:
        """:meth:`start_tick` returning the tick's task (``None``: not started).

        Args:
            entry: The schedule.
            due: The scheduled instant (the in-flight identity of the tick on this process).
            path: How it starts; a paused schedule (the control gate) starts only
                ``TRIGGER`` and ``BACKFILL`` ticks, and records a paused regular fire as skipped.
            deadline: Retries never start at or after this instant.
            tick: The tick to run (default: the tick of ``due``; a trigger has its own run key).
        """
        admitted = self._admit(entry, due, path, tick)
        if admitted is None:
            return None
        return self._spawn(entry, due, path, admitted, deadline, None)

    def _admit(
        self, entry: Entry, due: datetime, path: StartPath, tick: Tick | None
    ) -> Tick | None:
        """The tick to start, or ``None`` when a policy says no (a skip is recorded here)."""
        if entry.removed or not entry.active:
            return None
        if due in entry.in_flight:
            return None  # this very tick is already running here
        if tick is None:
            tick = make_tick(entry.name, entry.trigger, entry.zone, due)
        reason = None if self.gate is None else self.gate(entry.name)
        if reason is not None and path not in (StartPath.TRIGGER, StartPath.BACKFILL):
            if reason == GATE_UNKNOWN:
                # A process that slept (SIGSTOP, a VM pause) or lost the database must not start
                # a tick on a pause state it has not re-read. Only the latest fire waits; earlier
                # ones are missed ticks, which the catch-up policy decides about.
                if path in (StartPath.CATCH_UP, StartPath.SWEEP) and due in entry.pending:
                    # Offered again once the gate knows (release_unknown), not at the next sweep.
                    offered = entry.offered
                    if isinstance(offered, set):
                        offered.discard(due)
                    self._unknown_pending.add(entry)
                if path is StartPath.FIRE:
                    self._unknown[entry] = due
                    self._log.info(
                        "schedule %r run %r: waits until the paused state is read again",
                        entry.name,
                        tick.run_key,
                        extra={
                            "action": "tick_gate_unknown",
                            "schedule": entry.name,
                            "run_key": tick.run_key,
                        },
                    )
                return None
            if path is StartPath.FIRE:
                self._log.info(
                    "schedule %r run %r: skipped, the schedule is %s",
                    entry.name,
                    tick.run_key,
                    reason,
                    extra={
                        "action": "tick_paused_skipped",
                        "schedule": entry.name,
                        "run_key": tick.run_key,
                    },
                )
                self._own(
                    self._runner.record_skipped(
                        entry.name, entry.kind, entry.policy, tick, reason, outcome=SKIPPED_PAUSE
                    ),
                    f"sdcore-skip:{entry.name}",
                )
            return None
        if entry.running and entry.policy.overlap is not Overlap.ALLOW:
            if path is StartPath.FIRE and entry.running <= self._background:
                # Only backfill or catch-up runs are in the way: the live tick is not an overlap
                # of the schedule with itself, and skipping it would lose it for good (a skip
                # row is settled). It starts when they end (_ended), unless a later fire
                # replaces it first (see _deferred).
                self._defer(entry, due, tick, "a backfill or catch-up run of it", "tick_deferred")
                return None
            if (
                path is StartPath.FIRE
                and self._jobs is not None
                and entry.policy.exclusive
                and entry.name not in self._runner.in_handler
            ):
                # The run in the way is not in its handler: it waits on the database (its
                # acquire, or its completion's commit: a slow moment, an outage, a failover).
                # That is not an overlap, and a skip row would settle this tick for good: it
                # starts when that run ends, unless its successor is due first (see _deferred).
                self._defer(
                    entry,
                    due,
                    tick,
                    "its previous run, which waits on the database,",
                    "tick_waits_on_database",
                    yields=True,
                )
                return None
            self._log.log(
                logging.INFO if path is StartPath.FIRE else logging.DEBUG,
                "schedule %r run %r: skipped, the previous run is still running here (%s)",
                entry.name,
                tick.run_key,
                path.value,
                extra={
                    "action": "tick_overlap_skipped",
                    "schedule": entry.name,
                    "run_key": tick.run_key,
                    "path": path.value,
                },
            )
            if path is StartPath.FIRE:
                self._own(
                    self._runner.record_skipped(
                        entry.name,
                        entry.kind,
                        entry.policy,
                        tick,
                        "overlap",
                        outcome=SKIPPED_OVERLAP,
                    ),
                    f"sdcore-skip:{entry.name}",
                )
            return None
        return tick

    def _spawn(
        self,
        entry: Entry,
        due: datetime,
        path: StartPath,
        tick: Tick,
        deadline: Deadline,
        first: FirstOffer | None,
    ) -> asyncio.Task[TickOutcome]:
        context = None
        if _PATH.get() is not path:
            # The tick's task knows how it started (the run history's "source"); a regular
            # fire from the timer loop needs no context of its own.
            context = contextvars.copy_context()
            context.run(_PATH.set, path)
        runner = self._runner
        coro = (
            runner.run_plain(entry.name, entry.handler, tick)
            if runner.runs_plain(entry.policy)
            else runner.run(
                name=entry.name,
                kind=entry.kind,
                handler=entry.handler,
                policy=entry.policy,
                tick=tick,
                deadline=deadline,
                clock=self._clock,
                record_skip=path is StartPath.FIRE,
                first=first,
            )
        )
        task: asyncio.Task[TickOutcome] = self._own(
            coro, f"sdcore-tick:{entry.name}", context, (entry, due)
        )
        if path in (StartPath.BACKFILL, StartPath.CATCH_UP, StartPath.SWEEP):
            self._background.add(task)
        entry.running.add(task)
        entry.in_flight.add(due)
        return task

    def _ended(self, entry: Entry, due: datetime, task: asyncio.Task[Any] | None) -> None:
        """A tick of ``entry`` at ``due`` ended here (``task``: its task, if it had one)."""
        if task is not None:
            entry.running.discard(task)
        entry.in_flight.discard(due)
        if entry in self._deferred and not entry.running:
            # Before the pending catch-up ticks' drain below: the live schedule goes first.
            with contextlib.suppress(RuntimeError):  # the loop is closing
                asyncio.get_running_loop().call_soon(self._start_deferred, entry)
        if entry.pending and not entry.running and not entry.removed:
            # Catch-up under overlap "skip": the next missed tick starts when this one ends.
            with contextlib.suppress(RuntimeError):  # the loop is closing
                asyncio.get_running_loop().call_soon(self.drain, entry)

    async def _acquire_batch(self, batch: list[_Fire], go: asyncio.Future[None]) -> None:
        """Acquire the ticks of ``batch`` together once it is closed (``go``); start the ones
        that need a task."""
        await go
        runner = self._runner
        holder = asyncio.current_task()
        assert holder is not None  # noqa: S101 - a task's coroutine
        ticks: list[Tick] = []
        items = []
        for fire in batch:
            entry, tick = fire.entry, fire.tick
            assert tick is not None  # noqa: S101 - admitted fires carry their tick
            ticks.append(tick)
            options = tick_options(entry.name, entry.kind, entry.policy, tick.run_key)
            items.append((options, entry.policy.budget))
        assert runner.acquirer is not None  # noqa: S101 - acquires_first checked jobs
        answers = await runner.acquirer.acquire_each(items)
        for fire, tick, (options, _), answer in zip(batch, ticks, items, answers, strict=True):
            entry, due = fire.entry, fire.due
            entry.running.discard(holder)
            first = FirstOffer(options, answer)
            if runner.ends_lost(entry.name, entry.policy, tick, first):
                self._ended(entry, due, None)
            else:
                entry.in_flight.discard(due)  # the task's own from here
                self._spawn(entry, due, StartPath.FIRE, tick, fire.deadline, first)

    async def catch_up_at_start(
        self, entries: list[Entry], now: datetime, registry: Mapping[str, Entry]
    ) -> None:
        """Start-up catch-up: missed ticks of the window, never before the schedule's first row.

        When the owned schedules first ran is read for up to :data:`SWEEP_KEYS` of them in one
        statement, and the rows of their ticks in statements of up to as many keys."""
        jobs = self._jobs
        if jobs is None:
            return
        owned: list[Entry] = []
        for entry in entries:
            entry.catch_up_owed = None
            if not entry.catches_up or not entry.active:
                continue
            if not self.owns(entry):
                # Its owners catch up. They may be dead replicas whose heartbeats have not
                # lapsed yet (a fleet killed and restarted at once): owed until this one owns
                # the schedule, then done by its sweep (which looks back only to this start).
                entry.catch_up_owed = now
                continue
            entry.swept_until = now
            owned.append(entry)
        for index in range(0, len(owned), SWEEP_KEYS):
            await self._catch_up_chunk(owned[index : index + SWEEP_KEYS], now, registry)

    async def _catch_up_chunk(
        self, entries: list[Entry], now: datetime, registry: Mapping[str, Entry]
    ) -> None:
        assert self._jobs is not None  # noqa: S101 - catch_up_at_start checked it
        try:
            # Plain str codes: a name may be a str subclass (a StrEnum member), equal to its
            # value as a dict key.
            firsts = await self._jobs.first_seen_many([str.__str__(e.name) for e in entries])
        except (JobSchedulerError, ValueError) as exc:
            for entry in entries:
                self._catch_up_failed(entry, exc)
            return
        batch: list[_Swept] = []
        keys = 0
        for index, entry in enumerate(entries, 1):
            if index % _YIELD_EVERY == 0:
                await asyncio.sleep(0)  # a long window's instants and keys take CPU
            first = firsts.get(entry.name)
            window_start = now - timedelta(milliseconds=entry.policy.catch_up_window_ms)
            try:
                # Never ran anywhere (no row): nothing to catch up.
                ticks = (
                    {}
                    if first is None
                    else start_keys(entry.name, entry.trigger, window_start, now)
                )
            except ValueError as exc:
                self._catch_up_failed(entry, exc)
                continue
            if batch and keys + len(ticks) > SWEEP_KEYS:
                await self._catch_up_batch(batch, firsts, now, registry)
                batch, keys = [], 0
            batch.append(_Swept(entry, now, ticks, NO_INSTANTS))
            keys += len(ticks)
        if batch:
            await self._catch_up_batch(batch, firsts, now, registry)

    async def _catch_up_batch(
        self,
        batch: list[_Swept],
        firsts: Mapping[str, datetime],
        now: datetime,
        registry: Mapping[str, Entry],
    ) -> None:
        """Read the rows of ``batch``'s ticks in one statement; start each schedule's missed
        ones."""
        records = await self._read(batch, sweep=False)
        if records is None:
            return
        for item in batch:
            entry = item.entry
            if registry.get(entry.name) is not entry:
                continue  # removed while we awaited
            first = firsts.get(entry.name)
            window_start = now - timedelta(milliseconds=entry.policy.catch_up_window_ms)
            start = (
                []
                if first is None
                else started_at_start(
                    first,
                    records,
                    item.keys,
                    entry.policy.catch_up,
                    window_start,
                    now,
                    entry.resumed,
                )
            )
            self.start_pending(entry, start, StartPath.CATCH_UP, log_level=logging.INFO)

    async def sweep(
        self,
        entries: Iterable[Entry],
        clock: Callable[[], datetime],
        live: Callable[[Entry], bool],
    ) -> None:
        """One sweep round: re-run ticks fired since each schedule became active here that
        never started or were abandoned (``RUNNING`` past their lease: the lease decides), plus
        pending ones. The rows of many schedules' ticks are read in one statement of up to
        :data:`SWEEP_KEYS` keys; a schedule whose round fails is logged and left to the next."""
        if self._jobs is None:
            return
        batch: list[_Swept] = []
        keys = 0
        for index, entry in enumerate(entries, 1):
            if index % _YIELD_EVERY == 0:
                await asyncio.sleep(0)  # a round of many schedules takes CPU
            if not live(entry) or not entry.catches_up or entry.active_since is None:
                continue
            if not self.owns(entry):
                continue  # its owners sweep it
            try:
                swept = await self._window(entry, clock(), live)
            except Exception:  # noqa: BLE001 - one schedule's failure must not end the round
                self._sweep_failed(entry)
                continue
            if swept is None:
                continue
            if batch and keys + len(swept.keys) > SWEEP_KEYS:
                await self._sweep_batch(batch, live)
                batch, keys = [], 0
            batch.append(swept)
            keys += len(swept.keys)
        if batch:
            await self._sweep_batch(batch, live)

    async def _window(
        self, entry: Entry, now: datetime, live: Callable[[Entry], bool]
    ) -> _Swept | None:
        """What a sweep at ``now`` reads for ``entry``: its ticks to look at, or ``None`` (an
        owed start-up catch-up done instead, or a failure logged)."""
        end = now - _SWEEP_MARGIN
        if self.owners is not None and self.routed(entry):
            end -= timedelta(seconds=LAST_ASK_S)
        window_start = now - timedelta(milliseconds=entry.policy.catch_up_window_ms)
        # Strictly after the activation instant: a tick exactly at it was start-up catch-up's.
        assert entry.active_since is not None  # noqa: S101 - sweep checked it
        active = entry.active_since + timedelta(microseconds=1)
        since = max(active, window_start, entry.swept_until or active)
        if entry.policy.catch_up is CatchUp.LATEST:
            since = max(active, window_start)
        if entry.catch_up_owed is not None:
            await self._catch_up_owed(entry, entry.catch_up_owed, window_start, live)
            return None  # the next round sweeps from the start on
        try:
            fresh = candidates(entry.policy.catch_up, entry.trigger, since, end)
            consider = sorted({*fresh, *(t for t in entry.pending if t >= window_start)})
            keys = tick_keys(entry.name, entry.trigger, consider)
        except ValueError as exc:
            self._catch_up_failed(entry, exc)
            return None
        # The pending ticks were chosen already: a resume's among them were chosen because the
        # pause skipped them, and replacing the pending set must not drop them.
        return _Swept(entry, end, keys, entry.pending)

    async def _sweep_batch(self, batch: list[_Swept], live: Callable[[Entry], bool]) -> None:
        """Read the rows of ``batch``'s ticks in one statement, then start each schedule's
        unsettled ones."""
        records = await self._read(batch, sweep=True)
        if records is None:
            return
        for swept in batch:
            entry = swept.entry
            if not live(entry):
                continue  # stopped or removed while we awaited
            if entry.pending is not swept.chosen:
                # Another catch-up chose this schedule's pending ticks while we awaited (a
                # resume's): that choice is newer than ours. The next round looks again.
                continue
            try:
                start = unsettled(records, swept.keys, swept.chosen)
                if swept.end > (entry.swept_until or swept.end):
                    entry.swept_until = swept.end
                self.start_pending(entry, start, StartPath.SWEEP, log_level=logging.DEBUG)
            except Exception:  # noqa: BLE001 - one schedule's failure must not end the round
                self._sweep_failed(entry)

    async def _read(self, batch: list[_Swept], *, sweep: bool) -> dict[str, TickRecord] | None:
        """The rows of ``batch``'s ticks in one statement, or ``None`` with each schedule's
        failure logged. A database error is a catch-up failure; anything else fails only a
        sweep's round (the sweep must outlive a bad round), and is raised at start."""
        assert self._jobs is not None  # noqa: S101 - the callers checked it
        try:
            return await self._jobs.tick_records([k for item in batch for k in item.keys])
        except (JobSchedulerError, ValueError) as exc:
            for item in batch:
                self._catch_up_failed(item.entry, exc)
        except Exception:
            if not sweep:
                raise
            for item in batch:
                self._sweep_failed(item.entry)
        return None

    def _sweep_failed(self, entry: Entry) -> None:
        self._log.exception(
            "schedule %r: catch-up sweep failed",
            entry.name,
            extra={"action": "sweep_failed", "schedule": entry.name},
        )

    async def _catch_up_owed(
        self,
        entry: Entry,
        owed: datetime,
        window_start: datetime,
        live: Callable[[Entry], bool],
    ) -> None:
        """The start-up catch-up of the start at ``owed``, which this replica left to the
        schedule's owners then and owns now (within today's catch-up window)."""
        jobs = self._jobs
        assert jobs is not None  # noqa: S101 - sweep checked it
        try:
            start = await at_start(
                jobs,
                entry.name,
                entry.trigger,
                entry.policy.catch_up,
                max(window_start, owed - timedelta(milliseconds=entry.policy.catch_up_window_ms)),
                owed,
                entry.resumed,
            )
        except (JobSchedulerError, ValueError) as exc:
            self._catch_up_failed(entry, exc)
            return  # still owed: the next round tries again
        if not live(entry) or entry.catch_up_owed != owed:
            return  # stopped, removed or restarted while we awaited
        entry.catch_up_owed = None
        # The pending ticks were chosen already (a resume's): replacing the set keeps them.
        held = (t for t in entry.pending if t >= window_start)
        self.start_pending(
            entry, sorted({*start, *held}), StartPath.CATCH_UP, log_level=logging.INFO
        )

    def start_pending(
        self, entry: Entry, instants: list[datetime], path: StartPath, *, log_level: int
    ) -> None:
        """Start the missed ``instants`` of ``entry`` (catch-up), one after the other under
        overlap ``skip``."""
        if entry.policy.catch_up is CatchUp.LATEST:
            instants = instants[-1:]
        entry.pending = set(instants)
        entry.offered = offered = set()
        for instant in instants:
            if entry.running and entry.policy.overlap is not Overlap.ALLOW:
                break  # the rest start one after the other (see start_tick's done callback)
            offered.add(instant)
            tick = make_tick(entry.name, entry.trigger, entry.zone, instant)
            self._log.log(
                log_level,
                "schedule %r: catching up missed tick %r",
                entry.name,
                tick.run_key,
                extra={
                    "action": "catch_up",
                    "schedule": entry.name,
                    "run_key": tick.run_key,
                    "path": path.value,
                },
            )
            self.start_tick(entry, instant, path, deadline=entry.upcoming(self._clock()))

    def record_paused(self, entry: Entry, since: datetime, until: datetime) -> None:
        """Record the ticks that fell while ``entry`` was stopped as skipped (``"paused"``).

        Only ticks without a row are written: another replica that was not paused may have run
        them, or may still take the skip record over (it costs no attempt).
        """
        if (
            self._jobs is None
            or not entry.policy.exclusive
            or entry.kind not in (ScheduleKind.CRON, ScheduleKind.INTERVAL)
            or until <= since
        ):
            return
        try:
            instants = latest_instants(entry.trigger, since, until, MAX_CATCH_UP)
        except ValueError:
            return

        async def record() -> None:
            for instant in instants:
                tick = make_tick(entry.name, entry.trigger, entry.zone, instant)
                await self._runner.record_skipped(
                    entry.name, entry.kind, entry.policy, tick, "paused"
                )

        self._own(record(), f"sdcore-paused:{entry.name}")

    def replace(self, old: Entry, new: Entry) -> None:
        """``new`` takes the place of ``old`` (its schedule changed): the runs of ``old`` going
        on here, its ticks in flight, the fires waiting for a later owner's turn, for a backfill
        or catch-up run to end or for the paused state, and those in the open batch are
        ``new``'s from now on (each starts with ``new``'s handler and policy), also in the
        batches awaiting their acquire."""
        new.running = old.running
        new.in_flight = old.in_flight
        for task, tick in self._tasks.items():
            if tick is not None and tick[0] is old:
                self._tasks[task] = (new, tick[1])
        for waiting in (self._deferred, self._unknown):
            if old in waiting:
                waiting[new] = waiting.pop(old)
        if old in self._yielding:
            self._yielding.discard(old)
            self._yielding.add(new)
        for fires in (*self._later.values(), *self._batches.values()):
            for index, fire in enumerate(fires):
                if fire.entry is old:
                    fires[index] = dataclasses.replace(fire, entry=new)
        if new in self._deferred and not new.running:
            # The runs in its way ended after the start of the old entry's fire was queued.
            with contextlib.suppress(RuntimeError):  # the loop is closing
                asyncio.get_running_loop().call_soon(self._start_deferred, new)

    def _defer(
        self,
        entry: Entry,
        due: datetime,
        tick: Tick,
        what: str,
        action: str,
        *,
        yields: bool = False,
    ) -> None:
        """Let the fire of ``entry`` at ``due`` wait for ``what`` to end here: the latest such
        fire of a schedule waits, an earlier one is a missed tick. ``yields``: it gives way to
        the triggers and backfills refused for the same runs (see _yielding)."""
        earlier = self._deferred.get(entry)
        if earlier is not None and earlier < due:
            self._deferred_missed(entry, earlier, "the next fire waits in its place")
        if earlier is None or earlier < due:
            self._deferred[entry] = due
            if yields:
                self._yielding.add(entry)
            else:
                self._yielding.discard(entry)
        self._log.info(
            "schedule %r run %r: waits for %s to end here",
            entry.name,
            tick.run_key,
            what,
            extra={"action": action, "schedule": entry.name, "run_key": tick.run_key},
        )

    def _deferred_missed(self, entry: Entry, due: datetime, why: str) -> None:
        run_key = make_tick(entry.name, entry.trigger, entry.zone, due).run_key
        self._log.info(
            "schedule %r run %r: a missed tick, %s",
            entry.name,
            run_key,
            why,
            extra={"action": "tick_deferred_missed", "schedule": entry.name, "run_key": run_key},
        )

    def _start_deferred(self, entry: Entry) -> None:
        """Start the live fire of ``entry`` that waited for the runs in its way, if its
        successor is not due yet (then it is a missed tick); behind a live run waiting on the
        database, after the triggers and backfills that wait for it too."""
        due = self._deferred.get(entry)
        if due is None:
            return
        if entry.removed or not entry.active:
            del self._deferred[entry]
            self._yielding.discard(entry)
            self._deferred_missed(entry, due, "the schedule stopped while it waited")
            return
        if entry.running or (entry.actions_waiting and entry in self._yielding):
            # Something started first, or a trigger or backfill refused for the live run in its
            # way goes first: the end of its run calls this again.
            return
        del self._deferred[entry]
        self._yielding.discard(entry)
        following = entry.trigger.next_after(due)
        if following is not None and following <= self._clock():
            self._deferred_missed(entry, due, "the runs in its way ended after the next was due")
            return
        reason = None if self.gate is None else self.gate(entry.name)
        if reason is not None and reason != GATE_UNKNOWN:
            # Paused while it waited: the tick fell before the pause, so it is not the pause's
            # skip (a resume's catch-up covers only the pause's own ticks). It stays without a
            # row, a missed tick that the catch-up policy decides about.
            run_key = make_tick(entry.name, entry.trigger, entry.zone, due).run_key
            self._log.info(
                "schedule %r run %r: not started, the schedule became %s while it waited",
                entry.name,
                run_key,
                reason,
                extra={"action": "tick_deferred_gated", "schedule": entry.name, "run_key": run_key},
            )
            return
        self.launch(entry, due, StartPath.FIRE, deadline=entry.upcoming(self._clock()))

    def drain(self, entry: Entry) -> None:
        """Start the next pending catch-up tick of ``entry`` if nothing of it runs here and no
        trigger or backfill waits for its turn; a live fire waiting here goes first (one of a
        schedule stopped or removed meanwhile is dropped, logged)."""
        if entry in self._deferred and not entry.running:
            self._start_deferred(entry)
        if (
            self.closed
            or entry.removed
            or not entry.active
            or entry.running
            or entry.actions_waiting
        ):
            return
        for instant in sorted(entry.pending - entry.offered - entry.in_flight):
            offered = entry.offered
            if not isinstance(offered, set):
                offered = entry.offered = set(offered)
            offered.add(instant)
            deadline = entry.upcoming(self._clock())
            if self.start_tick(entry, instant, StartPath.CATCH_UP, deadline=deadline):
                return

    def _catch_up_failed(self, entry: Entry, exc: BaseException) -> None:
        self._log.warning(
            "schedule %r: catch-up skipped: %s",
            entry.name,
            exc,
            extra={"action": "catch_up_failed", "schedule": entry.name},
        )

    async def shutdown(self) -> None:
        """Let every owned task finish within the grace period, then cancel and await it."""
        # Fires that were waiting belong to this run of the scheduler: none starts after it.
        self._unknown.clear()
        self._unknown_pending.clear()
        for entry, due in self._deferred.items():
            self._deferred_missed(entry, due, "the scheduler stopped while it waited")
        self._deferred.clear()
        self._yielding.clear()
        for handle in self._later_handles.values():
            handle.cancel()
        self._later_handles.clear()
        self._later.clear()
        self.closed = True
        await self._shutdown_ticks()
        self._known = asyncio.Event()  # a later run may be on another event loop
        if self._runner.acquirer is not None:
            await self._runner.acquirer.aclose()

    async def _shutdown_ticks(self) -> None:
        if not self._tasks:
            return
        # A batch acquire finishing within the grace period starts the ticks it won: they get
        # what is left of it too.
        loop = asyncio.get_running_loop()
        end = loop.time() + self._grace
        pending: set[asyncio.Task[Any]] = set()
        while self._tasks.keys() - pending and loop.time() < end:
            _, pending = await asyncio.wait(set(self._tasks), timeout=end - loop.time())
        pending = {task for task in self._tasks if not task.done()}
        for task in pending:
            task.cancel()
        if pending:
            self._log.warning(
                "cancelled %d run(s) still going after the grace period",
                len(pending),
                extra={"action": "shutdown_cancelled"},
            )
            await asyncio.wait(pending)
