"""``ScheduleControl``: one replica's side of the control plane.

It syncs the scheduler's schedules to the store, keeps each schedule's paused state (the
supervisor's gate), runs stored schedules whose handler this process registers, executes open
trigger and backfill actions through the supervisor's one start path, and records the run history.
Changes arrive by notification (PostgreSQL LISTEN) and by polling every ``poll_interval_ms``.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

from sdcore._internal.supervisor import Supervisor
from sdcore._internal.validation import int_between
from sdcore.scheduling._actions import ActionRunner
from sdcore.scheduling._catch_up import Resumed
from sdcore.scheduling._control import (
    ActionKind,
    ControlAction,
    Declared,
    Replica,
    ScheduleRow,
    ScheduleStore,
    fingerprint,
    policy_options,
)
from sdcore.scheduling._cron import CronSpec, DayRule, InvalidScheduleError
from sdcore.scheduling._entry import Entry
from sdcore.scheduling._history import RunHistory
from sdcore.scheduling._hooks import SchedulerHooks
from sdcore.scheduling._owners import MEMBER_TTL_BEATS, Member, Owners
from sdcore.scheduling._runner import GATE_UNKNOWN, Handler, utcnow
from sdcore.scheduling._scheduler import ControlLink, Scheduler
from sdcore.scheduling._triggers import (
    CronTrigger,
    IntervalTrigger,
    ScheduleKind,
    Tick,
)

__all__ = ["ScheduleControl"]

# The propagation bound: a replica whose paused state was read longer ago than this (or than one
# poll interval and a second, if that is longer) starts no tick until it has read it again.
STALE_AFTER_S = 2.0

# While notifications arrive, a poll not needed for a tick's gate waits for the heartbeat; the
# one before a tick lands this long before its instant, and a view counts as covering the
# instants up to GATE_MARGIN_S before it goes stale (the gate is read again once a tick's lease
# is won, after its acquire).
POLL_LEAD_S = 0.5
GATE_MARGIN_S = 1.0

# How long a stopping replica tries to remove its row. Its heartbeat ends either way, and a row
# not seen for 30 s stops counting as declaring anything, so a give-up costs nothing lasting.
LEAVE_TIMEOUT_S = 5.0


def _expression(entry: Entry) -> str:
    trigger = entry.trigger
    if isinstance(trigger, CronTrigger):
        return trigger.spec.expression
    if isinstance(trigger, IntervalTrigger):
        return str(trigger.every_ms)
    return trigger.describe()


def _day_rule(entry: Entry) -> str:
    """The day rule of a cron schedule, ``vixie`` whenever the rule makes no difference to it.

    A spec keeps only how its day fields combine, so the rule is read back from that: an
    expression both rules read alike records the default (and keeps its fingerprint).
    """
    trigger = entry.trigger
    if not isinstance(trigger, CronTrigger):
        return DayRule.VIXIE.value
    spec = trigger.spec
    vixie = CronSpec.parse(spec.expression, spec.zone, entry.name, day_rule=DayRule.VIXIE)
    return DayRule.VIXIE.value if vixie.day_and == spec.day_and else DayRule.NESTJS.value


def _declared(entry: Entry) -> Declared:
    options = policy_options(entry.policy)
    expression = _expression(entry)
    rule = _day_rule(entry)
    return Declared(
        name=entry.name,
        kind=entry.kind.value,
        expression=expression,
        time_zone=entry.zone.key,
        options=options,
        fingerprint=fingerprint(
            entry.kind.value, expression, entry.zone.key, options, day_rule=rule
        ),
        day_rule=rule,
    )


class ScheduleControl:
    """Connect a :class:`Scheduler` to the cluster's control plane.

    Start it before the scheduler (``async with control:`` then ``async with scheduler:``; the
    :class:`~sdcore.Runtime` does both), so that a paused schedule never fires at start-up.

    Args:
        scheduler: This process's scheduler (its job scheduler makes actions exactly once).
        store: The control plane's store (:class:`PostgresScheduleStore`, or the in-memory double).
        poll_interval_ms: How often to poll for changes (also the bound on propagation when
            notifications are unavailable).
        listen: Use the store's notifications (``False`` under PgBouncer transaction pooling).
        heartbeat_ms: How often this replica marks itself alive.
        host: Host name recorded in the run history (default: ``socket.gethostname()``).
        pid: Process id recorded (default: ``os.getpid()``).
        clock: Wall clock returning aware UTC datetimes (the scheduler's, in tests that move
            time): when this replica started, and the catch-up window of a resume.
        logger_name: Logger.
        history_store: Where the run history is written (default: ``store``). The ``Runtime``
            keeps ``store`` on a small pool of the control plane's own, so that polls never
            queue behind the application's work, and writes the history (group-committed:
            the starts and the ends of many runs, one statement each) through the
            application's pool.

    Raises:
        ValueError: An interval out of range.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        store: ScheduleStore,
        *,
        poll_interval_ms: int = 1_000,
        listen: bool = True,
        heartbeat_ms: int = 5_000,
        host: str | None = None,
        pid: int | None = None,
        clock: Callable[[], datetime] = utcnow,
        logger_name: str = "sdcore.scheduling.control",
        history_store: ScheduleStore | None = None,
    ) -> None:
        int_between("poll_interval_ms", poll_interval_ms, 10, 3_600_000)
        int_between("heartbeat_ms", heartbeat_ms, 10, 3_600_000)
        self.scheduler = scheduler
        self.store = store
        self._poll_s = poll_interval_ms / 1000
        self._heartbeat_s = heartbeat_ms / 1000
        self._listen = listen
        self._host = host if host is not None else socket.gethostname()
        self._pid = pid if pid is not None else os.getpid()
        self._log = logging.getLogger(logger_name)
        self._clock = clock
        self.replica = Replica(replica_id=str(uuid.uuid4()), host=self._host, pid=self._pid)
        self._hooks = SchedulerHooks(scheduler)
        self._history = RunHistory(
            store if history_store is None else history_store, self.replica, self._log
        )
        self._actions = ActionRunner(self._hooks, store, self._log, clock=clock)
        self._paused: dict[str, bool] = {}
        self._resumed: dict[str, datetime] = {}
        self._stored: dict[str, str] = {}  # stored schedule name -> fingerprint running here
        self._stored_defs: dict[str, dict[str, Any]] = {}  # ... and its definition
        self._declared: dict[str, str] = {}  # code schedule name -> fingerprint declared
        # Names the registry reported added or removed (or whose row was removed while this
        # replica declares them): declared again before the next poll.
        self._dirty: set[str] = set()
        self._busy: set[int] = set()
        self._revision = 0
        self._caught_up_to = 0  # the newest action id the applied rows are known to precede
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._listen_task: asyncio.Task[None] | None = None
        self._sup: Supervisor | None = None  # owns the loops and the actions' tasks
        self._wake = asyncio.Event()
        self._last_beat = 0.0
        self._closing = False
        self._listening = False  # LISTEN took effect and its connection has not failed since
        self._actions_open = False  # as the last poll read it
        self._joined = False
        self._since = clock()
        # When the paused state held here was last read (monotonic): a view older than
        # _stale_s gates every tick as unknown until the next successful poll.
        self._fresh_at: float | None = None
        self._stale_s = max(STALE_AFTER_S, self._poll_s + 1.0)
        # This replica's view of the live replicas (read with each heartbeat), and what the
        # holders of each digest of that view declare (see _read_members).
        self._owners = Owners(self.replica.replica_id, stale_s=MEMBER_TTL_BEATS * self._heartbeat_s)
        self._versions: dict[str, dict[str, str]] = {}
        self._same: tuple[str, dict[str, frozenset[str]]] = ("", {})
        self._no_members_warned = False

    # --- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> ScheduleControl:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def running(self) -> bool:
        """Whether :meth:`start` ran and :meth:`aclose` did not yet."""
        return self._loop_task is not None

    def paused(self, name: str) -> bool:
        """Whether this replica currently holds ``name`` as paused."""
        return self._paused.get(name, False)

    async def start(self) -> None:
        """Sync the declared schedules, load the paused state and stored schedules, start polling.

        Raises:
            RuntimeError: Already started.
        """
        if self._loop_task is not None:
            raise RuntimeError("this ScheduleControl is already started")
        self._history.loop = asyncio.get_running_loop()
        self._history.quiet = self._hooks.acquires_quiet
        self._wake = asyncio.Event()
        self._closing = False
        self._listening = False
        self._since = self._clock() - timedelta(seconds=5)  # clock skew with the database
        self._owners = Owners(self.replica.replica_id, stale_s=MEMBER_TTL_BEATS * self._heartbeat_s)
        self._versions = {}
        self._same = ("", {})
        self._hooks.link(
            ControlLink(
                gate=self._gate,
                wrap=self._history.wrap,
                owners=self._owners,
                changed=self._registry_changed,
            )
        )
        self.replica = Replica(
            replica_id=self.replica.replica_id,
            host=self._host,
            pid=self._pid,
            handlers=tuple(sorted(self.scheduler.handlers)),
        )
        self._history.replica = self.replica
        sup = Supervisor("sdcore-control", logger=self._log)
        await sup.start()
        self._sup = sup  # from here on, stored schedules' declarations run under it
        try:
            await self._sync()
            self._joined = True
            self._revision = await self.store.revision()
            began = time.monotonic()
            for row in await self.store.rows(None):
                self._apply(row, initial=True)
            self._fresh_at = began
            await self._read_members()
            self._loop_task = sup.spawn("poll", self._run)
            if self._listen and hasattr(self.store, "listen"):
                self._listen_task = sup.spawn("listen", self._listener, cancel_on_close=True)
        except BaseException:
            self._sup = None
            for task in list(self._tasks):
                task.cancel()
            await sup.aclose(grace_s=None)
            self._tasks.clear()
            raise

    async def aclose(self) -> None:
        """Stop polling, cancel coordinators (another replica takes a backfill over), leave."""
        self._closing = True
        self._wake.set()
        for task in (self._loop_task, self._listen_task, *self._tasks):
            if task is not None:
                task.cancel()
        sup, self._sup = self._sup, None
        if sup is not None:
            await sup.aclose(grace_s=None)  # every child is cancelled: wait for each to end
        self._loop_task = self._listen_task = None
        self._tasks.clear()
        self._busy.clear()
        # The paused set cannot change any more (nothing polls): frozen, it gates the scheduler's
        # remaining fires until the scheduler stops, which happens after this returns.
        frozen = {name for name, paused in self._paused.items() if paused}
        self._hooks.unlink(paused=frozen.__contains__)
        for name in list(self._stored):
            if self._hooks.entry(name) is not None:
                self.scheduler.remove(name)
        self._stored.clear()
        self._stored_defs.clear()
        try:
            await asyncio.wait_for(self._history.drain(), LEAVE_TIMEOUT_S)
        except TimeoutError:
            self._log.warning("run history writes still pending at stop; not waited for")
        if not self._joined:
            return
        self._joined = False
        try:
            # Bounded: with the database unreachable the pool would wait its whole checkout
            # timeout (30 s by default) and hold the stop past a pod's grace period.
            await asyncio.wait_for(self.store.leave(self.replica), LEAVE_TIMEOUT_S)
        except TimeoutError:
            self._log.warning(
                "could not leave the control plane within %.0f s; this replica's row expires "
                "by itself",
                LEAVE_TIMEOUT_S,
            )
        except Exception as exc:  # noqa: BLE001 - the row expires by itself
            self._log.warning("could not leave the control plane: %s", exc)

    async def _sync(self) -> None:
        entries = self._hooks.entries()
        declared = [_declared(e) for e in entries if e.name not in self._stored]
        self._declared = {d.name: d.fingerprint for d in declared}
        self._dirty.clear()
        self._warn_mixed(await self.store.sync(self.replica, declared))
        for name, fp in self._stored.items():
            await self.store.declare(self.replica, name, fp, self._stored_defs.get(name))

    def _warn_mixed(self, mixed: list[str]) -> None:
        for name in mixed:
            self._log.warning(
                "schedule %r: live replicas declare different definitions of it (code versions "
                "differ); see `sdcore schedules list`",
                name,
                extra={"action": "schedule_versions_mixed", "schedule": name},
            )

    def _registry_changed(self, name: str) -> None:
        """A schedule was added to or removed from the scheduler (also while it runs)."""
        self._dirty.add(name)
        self._wake.set()  # the loop declares it before its next poll

    async def _redeclare(self) -> None:
        """Declare the code schedules added since the last sync and undeclare removed ones.

        Only the names the registry reported are looked at (a replica may hold thousands).
        Stored schedules are skipped: this replica declares those as it applies their rows.
        """
        if not self._dirty:
            return
        dirty, self._dirty = self._dirty, set()
        try:
            fresh: list[Declared] = []
            gone: list[str] = []
            for name in sorted(dirty):
                entry = self._hooks.entry(name)
                if name in self._stored:
                    continue
                if entry is not None:
                    fresh.append(_declared(entry))
                elif name in self._declared:
                    gone.append(name)
            if fresh:
                self._warn_mixed(await self.store.sync(self.replica, fresh))
                for d in fresh:
                    self._declared[d.name] = d.fingerprint
            for name in gone:
                await self.store.declare(self.replica, name, None)
                del self._declared[name]
        except BaseException:
            self._dirty |= dirty  # the next round tries again
            raise

    # --- hooks -----------------------------------------------------------------------------

    def _gate(self, name: str) -> str | None:
        fresh = self._fresh_at
        if fresh is not None and time.monotonic() - fresh > self._stale_s:
            # This process slept (SIGSTOP, a paused VM, a blocked loop) or cannot reach the
            # database: a pause may have been committed meanwhile. Ask again before any start.
            self._wake.set()
            return GATE_UNKNOWN
        return "paused" if self._paused.get(name, False) else None

    # --- the loop --------------------------------------------------------------------------

    def wake(self) -> None:
        """Poll now (called per notification)."""
        self._wake.set()

    async def _listener(self) -> None:
        listen = getattr(self.store, "listen")  # noqa: B009 - optional capability

        def heard() -> None:
            self._listening = True  # the first call comes once LISTEN took effect
            self.wake()

        while True:
            try:
                await listen(heard)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - polling goes on meanwhile
                self._log.warning("control plane LISTEN failed (polling meanwhile): %s", exc)
            finally:
                self._listening = False
            self.wake()  # back to polling every interval from now on
            await asyncio.sleep(max(self._poll_s, 1.0))

    def _poll_delay(self, now: float) -> float:
        """Seconds until the next poll (``now``: the loop's clock).

        Without notifications: every poll interval. With them (a change wakes the loop at once),
        polls that only keep the paused state fresh are made when the gate needs them: at the
        poll interval while a tick may start here, else :data:`POLL_LEAD_S` before the next
        instant at which one may (its owners'; the others' ticks are not gated here), else at
        the heartbeat. The view a tick starts on is then never older than without them.
        """
        fresh = self._fresh_at
        if not self._listening or fresh is None or self._actions_open:
            # Open actions are offered again at every poll (one whose replica died runs again
            # once its lease expires): they keep the interval.
            return self._poll_s
        idle = max(self._poll_s, self._last_beat + self._heartbeat_s - now)
        covered = fresh + self._stale_s - GATE_MARGIN_S - time.monotonic()
        need = self._hooks.next_start_in(max(0.0, covered), idle + POLL_LEAD_S)
        if need is None:
            return idle
        return min(idle, max(self._poll_s, need - POLL_LEAD_S))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        self._last_beat = loop.time()
        woken = False
        while not self._closing:
            # Cleared before the poll: a notification arriving during it wakes the next one.
            self._wake.clear()
            try:
                await self._redeclare()
                await self.poll()
                # A notification (a replica left, or a control write): the owners of the ticks
                # a leaving replica owned must know at once, not at the next beat.
                if woken or loop.time() - self._last_beat >= self._heartbeat_s:
                    self._last_beat = loop.time()
                    await self._beat()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must outlive a bad round
                self._log.exception("control plane poll failed", extra={"action": "poll_failed"})
            # Not asyncio.timeout: on Python 3.11 a cancel() racing its expiry is swallowed as
            # a TimeoutError, and aclose() would wait for this loop forever.
            waiter = asyncio.ensure_future(self._wake.wait())
            try:
                done, _ = await asyncio.wait({waiter}, timeout=self._poll_delay(loop.time()))
            finally:
                waiter.cancel()
            woken = bool(done)

    async def poll(self) -> None:
        """Apply every change since the last poll and start the open actions this replica can.

        While nothing changes this is one statement (:meth:`ScheduleStore.changes`): the rows
        are read only past a newer revision, the actions only while one is open. The paused
        state held here is then known current as of the poll's start: a row written before it
        committed with a revision that statement sees (revisions commit in order).
        """
        began = time.monotonic()
        changes = await self.store.changes()
        self._actions_open = changes.actions_open
        if changes.revision > self._revision:
            await self._apply_changes()
        self._fresh_at = began
        self._hooks.release_unknown()
        if not changes.actions_open or not self.scheduler.running:
            return
        names = sorted(self._local_names())
        if not names:
            return
        actions = await self.store.open_actions(names)
        newest = max((action.id for action in actions), default=0)
        if newest > max(self._revision, self._caught_up_to):
            # Action ids and revisions come from one sequence and commit in order: once an
            # action is visible, so is every change written before it (an update, a re-create).
            # Apply those first, or the action would run the definition they replaced.
            await self._apply_changes()
            self._caught_up_to = newest
            names = sorted(self._local_names())
            actions = [a for a in actions if a.schedule in names]
        for action in actions:
            if action.id in self._busy:
                continue
            if action.action is ActionKind.TRIGGER:
                self._spawn(action, functools.partial(self._actions.trigger, action))
            elif action.action is ActionKind.BACKFILL:
                self._spawn(action, functools.partial(self._actions.backfill, action))

    async def _beat(self) -> None:
        """The heartbeat: one statement marks this replica alive and reads its peers. A replica
        the others no longer see (it slept past the members' TTL, or a peer's sync forgot it)
        declares its schedules again, then reads its peers with them."""
        seen = await self._read_members()
        if seen is None:  # the store keeps no digests: a plain heartbeat
            seen = await self.store.heartbeat(self.replica)
        if not seen:
            await self._sync()
            await self._read_members()

    async def _read_members(self) -> bool | None:
        """Mark this replica alive and read the live replicas and what each declares: the
        owners of each exclusive schedule are chosen among them
        (:mod:`sdcore.scheduling._owners`).

        Returns:
            Whether this replica was among them; ``None``: the store keeps no digests (nothing
            was marked).
        """
        mine = {**self._declared, **self._stored}  # name -> fingerprint declared here
        digest = _digest(mine)
        ttl_ms = round(MEMBER_TTL_BEATS * self._heartbeat_s * 1000)
        rows = await self.store.members(self.replica, digest, ttl_ms)
        if rows is None:
            if not self._no_members_warned:
                self._no_members_warned = True
                self._log.warning(
                    "the control plane cannot read replica digests (run `sdcore db upgrade "
                    "--schedules`); this replica asks for every exclusive tick meanwhile",
                    extra={"action": "owners_off"},
                )
            self._owners.forget()
            return None
        seen = False
        # What the holders of each digest declare (name -> fingerprint), and of that the names
        # they declare in this replica's version: a schedule's owners are chosen among the
        # replicas that run its definition as this one does (a rolling deploy that changes it
        # fires ticks that only one version has). The holders of this replica's digest declare
        # what it declares now, and keep doing so when its declarations change before the next
        # read. Each frozenset is kept from read to read while this replica's digest stays: an
        # unchanged view compares equal by identity.
        before = self._same[1] if self._same[0] == digest else {}
        versions: dict[str, dict[str, str]] = {digest: mine}
        same: dict[str, frozenset[str]] = {digest: before.get(digest) or frozenset(mine)}
        members: list[Member] = []
        for row in rows:
            held = row.digest
            if row.replica_id == self.replica.replica_id:
                seen = True
                continue
            if held is None:  # no digest recorded (an older version): declares nothing here
                members.append(Member(row.replica_id, frozenset()))
                continue
            if held not in same:
                declared = self._versions.get(held)
                if declared is None:
                    declared = await self.store.declared_versions(held)
                    if _digest(declared) != held:
                        # The holder read has changed its declarations since it wrote this
                        # digest: they are not the other holders'. Counted as declaring
                        # nothing until a read matches (a replica left out of a schedule's
                        # owners only makes the others ask for it).
                        same[held] = frozenset()
                        members.append(Member(row.replica_id, same[held]))
                        continue
                versions[held] = declared
                same[held] = before.get(held) or frozenset(
                    name for name, version in declared.items() if mine.get(name) == version
                )
            members.append(Member(row.replica_id, same[held]))
        self._versions = versions
        self._same = (digest, same)
        self._owners.update(members, same[digest])
        return seen

    async def _apply_changes(self) -> None:
        for row in await self.store.rows(self._revision):
            self._revision = max(self._revision, row.revision)
            self._apply(row, initial=False)

    def _local_names(self) -> set[str]:
        return self._hooks.names()

    def _spawn(self, action: ControlAction, make: Callable[[], Awaitable[Any]]) -> None:
        async def run() -> None:
            try:
                await make()
            except Exception as exc:  # noqa: BLE001 - another replica may take the action over
                self._log.error(
                    "control action %d (%s of %r) failed here: %s",
                    action.id,
                    action.action.value,
                    action.schedule,
                    exc,
                    extra={"action": "control_action_failed", "schedule": action.schedule},
                )

        task = self._own(run, f"{action.action.value}:{action.id}")
        if task is not None:
            self._busy.add(action.id)
            task.add_done_callback(lambda _: self._busy.discard(action.id))

    # --- applying rows ---------------------------------------------------------------------

    def _apply(self, row: ScheduleRow, *, initial: bool) -> None:
        if row.origin == "stored" or row.name in self._stored:
            # A stored schedule running here whose row is now a code schedule's (removed, then
            # taken back by a code sync before this replica polled) is gone as well.
            self._apply_stored(row)
        if row.removed_at is not None and row.name in self._declared:
            # Removed by an operator while no live replica declared it, yet this one does: sync
            # it again, which takes the name back.
            self._registry_changed(row.name)
        was = self._paused.get(row.name, False)
        now_paused = row.paused and row.removed_at is None
        self._paused[row.name] = now_paused
        current = self._hooks.entry(row.name)
        if current is not None:
            paused_at, resumed_at = row.paused_at, row.resumed_at
            current.resumed = (
                Resumed(paused_at, resumed_at)
                if not now_paused and paused_at is not None and resumed_at is not None
                else None
            )
        if now_paused and not was and not initial:
            self._log.info(
                "schedule %r paused", row.name, extra={"action": "paused", "schedule": row.name}
            )
        if not now_paused and row.resumed_at is not None and not initial:
            seen = self._resumed.get(row.name)
            fresh = was or row.resumed_at >= self._since
            if fresh and (seen is None or row.resumed_at > seen) and row.paused_at is not None:
                self._resumed[row.name] = row.resumed_at
                self._log.info(
                    "schedule %r resumed",
                    row.name,
                    extra={"action": "resumed", "schedule": row.name},
                )
                entry = self._hooks.entry(row.name)
                if entry is not None and entry.catches_up:
                    paused_at, resumed_at = row.paused_at, row.resumed_at
                    self._own(lambda: self._actions.resume_catch_up(entry, paused_at, resumed_at))
        elif row.resumed_at is not None:
            self._resumed[row.name] = row.resumed_at

    def _own(
        self, make: Callable[[], Awaitable[Any]], name: str = "task"
    ) -> asyncio.Task[None] | None:
        """Run ``make()`` once under the supervisor (``None``: closing, nothing is started)."""
        if self._sup is None or self._closing:
            return None

        async def once() -> None:
            await make()

        task = self._sup.spawn(name, once, restart=False)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _apply_stored(self, row: ScheduleRow) -> None:
        sched = self.scheduler
        running_fp = self._stored.get(row.name)
        if (
            row.removed_at is not None
            or row.origin != "stored"
            or row.handler is None
            or row.handler not in sched.handlers
        ):
            if running_fp is not None:
                self._stored.pop(row.name, None)
                self._stored_defs.pop(row.name, None)
                if self._hooks.entry(row.name) is not None:
                    sched.remove(row.name)
                self._own(lambda: self.store.declare(self.replica, row.name, None), "declare")
                self._log.info(
                    "stored schedule %r removed here",
                    row.name,
                    extra={"action": "stored_removed", "schedule": row.name},
                )
            return
        if running_fp == row.fingerprint:
            return
        if self._hooks.entry(row.name) is not None and running_fp is None:
            self._log.error(
                "stored schedule %r has the name of a code schedule here; ignored", row.name
            )
            return
        function = sched.handlers[row.handler]
        args = dict(row.args or {})
        handler = _bind(function, args)
        options: dict[str, Any] = dict(row.options)
        if options.get("exclusive", True) is not True:
            # Rows may come from other sdcore versions: a stored schedule runs on every replica
            # that registers its handler, so only the lease keeps each tick to one of them.
            self._log.warning(
                "stored schedule %r: its row says exclusive=%r; run exclusive (stored schedules "
                "always are)",
                row.name,
                options["exclusive"],
                extra={"action": "stored_forced_exclusive", "schedule": row.name},
            )
        options["exclusive"] = True
        try:
            self._hooks.put_stored(
                row.name,
                ScheduleKind(row.kind),
                row.expression,
                row.time_zone,
                row.day_rule,
                handler,
                options,
            )
        except (InvalidScheduleError, ValueError, TypeError) as exc:
            # The definition that ran here is not this row's: it stops too.
            if running_fp is not None and self._hooks.entry(row.name) is not None:
                sched.remove(row.name)
            self._stored.pop(row.name, None)
            self._stored_defs.pop(row.name, None)
            self._log.error("stored schedule %r cannot run here: %s", row.name, exc)
            return
        self._stored[row.name] = row.fingerprint
        definition = {
            "kind": row.kind,
            "expression": row.expression,
            "time_zone": row.time_zone,
            "day_rule": row.day_rule,
            "options": dict(row.options),
        }
        self._stored_defs[row.name] = definition
        fingerprint = row.fingerprint
        self._own(
            lambda: self.store.declare(self.replica, row.name, fingerprint, definition), "declare"
        )
        self._log.info(
            "stored schedule %r %s here: %s",
            row.name,
            "changed" if running_fp else "running",
            row.expression,
            extra={"action": "stored_applied", "schedule": row.name},
        )


def _digest(declared: Mapping[str, str]) -> str:
    """The digest a replica records for what it declares (schedule name -> fingerprint)."""
    lines = sorted(f"{name}\t{version}" for name, version in declared.items())
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]


def _bind(function: Callable[..., Any], args: Mapping[str, Any]) -> Handler:
    """A stored schedule's handler: ``function(tick, args)`` as a tick handler."""
    if inspect.iscoroutinefunction(function):

        async def bound(tick: Tick) -> Any:
            return await function(tick, dict(args))

        return bound

    def bound_sync(tick: Tick) -> Any:
        return function(tick, dict(args))

    return bound_sync
