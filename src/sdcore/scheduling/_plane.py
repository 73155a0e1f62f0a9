"""``ScheduleControl``: one replica's side of the control plane.

It syncs the scheduler's schedules to the store, keeps each schedule's paused state (the
supervisor's gate), runs stored schedules whose handler this process registers, executes open
trigger and backfill actions through the supervisor's one start path, and records the run history.
Changes arrive by notification (PostgreSQL LISTEN) and by polling every ``poll_interval_ms``.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import os
import socket
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from sdcore._internal.errors import error_text
from sdcore.job_scheduler import JobAcquireOptions, JobSchedulerStatus, TickRecord
from sdcore.scheduling._catch_up import MAX_CATCH_UP, MAX_RANGE_TICKS, latest_instants, lock_key
from sdcore.scheduling._control import (
    BACKFILL_PREFIX,
    TRIGGER_PREFIX,
    ActionKind,
    ControlAction,
    Declared,
    Replica,
    RunStart,
    ScheduleRow,
    ScheduleStore,
    fingerprint,
    policy_options,
)
from sdcore.scheduling._cron import InvalidScheduleError
from sdcore.scheduling._policy import CatchUp, Overlap, StartPath
from sdcore.scheduling._runner import Handler, TickOutcome, tick_options
from sdcore.scheduling._scheduler import Scheduler
from sdcore.scheduling._supervisor import Entry
from sdcore.scheduling._triggers import (
    CronTrigger,
    IntervalTrigger,
    ScheduleKind,
    Tick,
    expected_instants,
)

__all__ = ["ScheduleControl"]

_SOURCE: contextvars.ContextVar[str] = contextvars.ContextVar("sdcore_run_source", default="tick")
_RECORD_TIMEOUT_S = 5.0


def _expression(entry: Entry) -> str:
    trigger = entry.trigger
    if isinstance(trigger, CronTrigger):
        return trigger.spec.expression
    if isinstance(trigger, IntervalTrigger):
        return str(trigger.every_ms)
    return trigger.describe()


def _declared(entry: Entry) -> Declared:
    options = policy_options(entry.policy)
    expression = _expression(entry)
    return Declared(
        name=entry.name,
        kind=entry.kind.value,
        expression=expression,
        time_zone=entry.zone.key,
        options=options,
        fingerprint=fingerprint(entry.kind.value, expression, entry.zone.key, options),
    )


def _done(record: TickRecord | None) -> bool:
    """A backfilled tick needs nothing more: succeeded, or failed since the backfill began."""
    if record is None:
        return False
    if record.status is JobSchedulerStatus.SUCCESS:
        return True
    return record.status is JobSchedulerStatus.FAIL and record.attempts > 0 and not record.released


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
        logger_name: Logger.

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
        logger_name: str = "sdcore.scheduling.control",
    ) -> None:
        for label, value in (
            ("poll_interval_ms", poll_interval_ms),
            ("heartbeat_ms", heartbeat_ms),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 10 <= value <= 3_600_000
            ):
                raise ValueError(f"{label} must be an int between 10 and 3600000, got {value!r}")
        self.scheduler = scheduler
        self.store = store
        self._poll_s = poll_interval_ms / 1000
        self._heartbeat_s = heartbeat_ms / 1000
        self._listen = listen
        self._host = host if host is not None else socket.gethostname()
        self._pid = pid if pid is not None else os.getpid()
        self._log = logging.getLogger(logger_name)
        self.replica = Replica(replica_id=str(uuid.uuid4()), host=self._host, pid=self._pid)
        self._paused: dict[str, bool] = {}
        self._resumed: dict[str, datetime] = {}
        self._stored: dict[str, str] = {}  # stored schedule name -> fingerprint running here
        self._declared: set[str] = set()
        self._busy: set[int] = set()
        self._revision = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._listen_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._originals: dict[str, Handler] = {}
        self._last_beat = 0.0
        self._closing = False
        self._joined = False
        self._since = datetime.now(UTC)

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
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._closing = False
        self._since = datetime.now(UTC) - timedelta(seconds=5)  # clock skew with the database
        sched = self.scheduler
        sched._sup.gate = self._gate
        sched._wrap = self._wrap_handler
        for entry in sched._entries.values():
            if entry.name not in self._originals:
                self._originals[entry.name] = entry.handler
                entry.handler = self._wrap_handler(entry.name, entry.handler)
        self.replica = Replica(
            replica_id=self.replica.replica_id,
            host=self._host,
            pid=self._pid,
            handlers=tuple(sorted(sched.handlers)),
        )
        await self._sync()
        self._joined = True
        self._revision = await self.store.revision()
        for row in await self.store.rows(None):
            self._apply(row, initial=True)
        self._loop_task = asyncio.create_task(self._run(), name="sdcore-schedule-control")
        if self._listen and hasattr(self.store, "listen"):
            self._listen_task = asyncio.create_task(self._listener(), name="sdcore-control-listen")

    async def aclose(self) -> None:
        """Stop polling, cancel coordinators (another replica takes a backfill over), leave."""
        self._closing = True
        self._wake.set()
        for task in (self._loop_task, self._listen_task, *self._tasks):
            if task is not None:
                task.cancel()
        pending = {t for t in (self._loop_task, self._listen_task, *self._tasks) if t is not None}
        if pending:
            await asyncio.wait(pending)
        self._loop_task = self._listen_task = None
        self._tasks.clear()
        self._busy.clear()
        sched = self.scheduler
        sched._sup.gate = None
        sched._wrap = None
        for name, handler in self._originals.items():
            entry = sched._entries.get(name)
            if entry is not None:
                entry.handler = handler
        self._originals.clear()
        for name in list(self._stored):
            if name in sched._entries:
                sched.remove(name)
        self._stored.clear()
        if not self._joined:
            return
        self._joined = False
        try:
            await self.store.leave(self.replica)
        except Exception as exc:  # noqa: BLE001 - the row expires by itself
            self._log.warning("could not leave the control plane: %s", exc)

    async def _sync(self) -> None:
        entries = list(self.scheduler._entries.values())
        declared = [_declared(e) for e in entries if e.name not in self._stored]
        self._declared = {d.name for d in declared}
        mixed = await self.store.sync(self.replica, declared)
        for name in mixed:
            self._log.warning(
                "schedule %r: live replicas declare different definitions of it (code versions "
                "differ); see `sdcore schedules list`",
                name,
                extra={"action": "schedule_versions_mixed", "schedule": name},
            )
        for name, fp in self._stored.items():
            await self.store.declare(self.replica, name, fp)

    # --- hooks -----------------------------------------------------------------------------

    def _gate(self, name: str) -> str | None:
        return "paused" if self._paused.get(name, False) else None

    def _wrap_handler(self, name: str, handler: Handler) -> Handler:
        """Record every run of ``handler`` in the history (start, end, error)."""
        control = self
        if inspect.iscoroutinefunction(handler):

            async def recorded(tick: Tick) -> Any:
                run_id = await control._started(tick)
                try:
                    result = await handler(tick)
                except BaseException as exc:
                    await control._finished(run_id, exc)
                    raise
                await control._finished(run_id, None)
                return result

            return recorded

        def recorded_sync(tick: Tick) -> Any:
            # Runs in a worker thread (the runner's to_thread); the writes go through the loop.
            run_id = control._from_thread(control._started(tick))
            try:
                result = handler(tick)
            except BaseException as exc:
                control._from_thread(control._finished(run_id, exc))
                raise
            control._from_thread(control._finished(run_id, None))
            return result

        return recorded_sync

    def _from_thread(self, coro: Any) -> Any:
        loop = self._loop
        if loop is None:
            coro.close()
            return None
        try:
            return asyncio.run_coroutine_threadsafe(coro, loop).result(_RECORD_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - history must never fail a run
            return None

    async def _started(self, tick: Tick) -> int | None:
        source = _SOURCE.get()
        if tick.run_key is not None and tick.run_key.startswith(TRIGGER_PREFIX):
            source = "trigger"
        lease = tick.lease
        try:
            return await self.store.run_started(
                RunStart(
                    schedule=tick.schedule,
                    run_key=tick.run_key or "initial",
                    source=source,
                    scheduled_at=tick.scheduled_at,
                    attempt=tick.attempt,
                    fencing_token=None if lease is None else lease.fencing_token,
                    replica=self.replica,
                )
            )
        except Exception as exc:  # noqa: BLE001 - history must never fail a run
            self._log.warning("schedule %r: run history not recorded: %s", tick.schedule, exc)
            return None

    async def _finished(self, run_id: int | None, exc: BaseException | None) -> None:
        if run_id is None:
            return
        if exc is None:
            status, error = "SUCCESS", None
        else:
            status = "FAIL"
            error = "cancelled" if isinstance(exc, asyncio.CancelledError) else error_text(exc)
        try:
            await asyncio.shield(self.store.run_finished(run_id, status, error))
        except Exception as exc2:  # noqa: BLE001
            self._log.warning("run history not finished: %s", exc2)

    # --- the loop --------------------------------------------------------------------------

    def wake(self) -> None:
        """Poll now (called per notification)."""
        self._wake.set()

    async def _listener(self) -> None:
        listen = getattr(self.store, "listen")  # noqa: B009 - optional capability
        while True:
            try:
                await listen(self.wake)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - polling goes on meanwhile
                self._log.warning("control plane LISTEN failed (polling meanwhile): %s", exc)
            await asyncio.sleep(max(self._poll_s, 1.0))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        self._last_beat = loop.time()
        while not self._closing:
            # Cleared before the poll: a notification arriving during it wakes the next one.
            self._wake.clear()
            try:
                await self.poll()
                if loop.time() - self._last_beat >= self._heartbeat_s:
                    self._last_beat = loop.time()
                    if not await self.store.heartbeat(self.replica):
                        await self._sync()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must outlive a bad round
                self._log.exception("control plane poll failed", extra={"action": "poll_failed"})
            # Not asyncio.timeout: on Python 3.11 a cancel() racing its expiry is swallowed as
            # a TimeoutError, and aclose() would wait for this loop forever.
            waiter = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({waiter}, timeout=self._poll_s)
            finally:
                waiter.cancel()

    async def poll(self) -> None:
        """Apply every change since the last poll and start the open actions this replica can."""
        for row in await self.store.rows(self._revision):
            self._revision = max(self._revision, row.revision)
            self._apply(row, initial=False)
        names = sorted(self._local_names())
        if not names or not self.scheduler.running:
            return
        for action in await self.store.open_actions(names):
            if action.id in self._busy:
                continue
            if action.action is ActionKind.TRIGGER:
                self._spawn(action, self._trigger(action))
            elif action.action is ActionKind.BACKFILL:
                self._spawn(action, self._backfill(action))

    def _local_names(self) -> set[str]:
        return set(self.scheduler._entries)

    def _spawn(self, action: ControlAction, coro: Any) -> None:
        self._busy.add(action.id)
        task = asyncio.create_task(coro, name=f"sdcore-control:{action.action.value}:{action.id}")
        self._tasks.add(task)

        def done(task: asyncio.Task[Any]) -> None:
            self._tasks.discard(task)
            self._busy.discard(action.id)
            if not task.cancelled() and task.exception() is not None:
                self._log.error(
                    "control action %d (%s of %r) failed here: %s",
                    action.id,
                    action.action.value,
                    action.schedule,
                    task.exception(),
                    extra={"action": "control_action_failed", "schedule": action.schedule},
                )

        task.add_done_callback(done)

    # --- applying rows ---------------------------------------------------------------------

    def _apply(self, row: ScheduleRow, *, initial: bool) -> None:
        if row.origin == "stored":
            self._apply_stored(row)
        was = self._paused.get(row.name, False)
        now_paused = row.paused and row.removed_at is None
        self._paused[row.name] = now_paused
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
                entry = self.scheduler._entries.get(row.name)
                if entry is not None and entry.catches_up:
                    self._own(self._resume_catch_up(entry, row.paused_at, row.resumed_at))
        elif row.resumed_at is not None:
            self._resumed[row.name] = row.resumed_at

    def _own(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _apply_stored(self, row: ScheduleRow) -> None:
        sched = self.scheduler
        running_fp = self._stored.get(row.name)
        if row.removed_at is not None or row.handler is None or row.handler not in sched.handlers:
            if running_fp is not None:
                self._stored.pop(row.name, None)
                if row.name in sched._entries:
                    sched.remove(row.name)
                self._own(self.store.declare(self.replica, row.name, None))
                self._log.info(
                    "stored schedule %r removed here",
                    row.name,
                    extra={"action": "stored_removed", "schedule": row.name},
                )
            return
        if running_fp == row.fingerprint:
            return
        if row.name in sched._entries and running_fp is None:
            self._log.error(
                "stored schedule %r has the name of a code schedule here; ignored", row.name
            )
            return
        function = sched.handlers[row.handler]
        args = dict(row.args or {})
        handler = _bind(function, args)
        options: dict[str, Any] = dict(row.options)
        try:
            if running_fp is not None:
                sched.remove(row.name)
            if row.kind == ScheduleKind.CRON.value:
                sched.add_cron(
                    row.name, row.expression, handler, time_zone=row.time_zone, **options
                )
            else:
                sched.add_interval(row.name, int(row.expression), handler, **options)
        except (InvalidScheduleError, ValueError, TypeError) as exc:
            self._stored.pop(row.name, None)
            self._log.error("stored schedule %r cannot run here: %s", row.name, exc)
            return
        self._stored[row.name] = row.fingerprint
        self._own(self.store.declare(self.replica, row.name, row.fingerprint))
        self._log.info(
            "stored schedule %r %s here: %s",
            row.name,
            "changed" if running_fp else "running",
            row.expression,
            extra={"action": "stored_applied", "schedule": row.name},
        )

    # --- actions ---------------------------------------------------------------------------

    def _entry(self, name: str) -> Entry | None:
        return self.scheduler._entries.get(name)

    async def _records(self, keys: list[str]) -> dict[str, TickRecord]:
        jobs = self.scheduler._jobs
        if jobs is None:
            return {}
        return await jobs.tick_records(keys)

    async def _trigger(self, action: ControlAction) -> None:
        entry = self._entry(action.schedule)
        if entry is None:
            return
        run_key = f"{TRIGGER_PREFIX}{action.id}"
        at = action.created_at.astimezone(UTC)
        tick = Tick(
            schedule=entry.name,
            scheduled_at=at,
            local_time=at.astimezone(entry.zone),
            run_key=run_key,
        )
        token = _SOURCE.set("trigger")
        try:
            task = self.scheduler._sup.launch(
                entry, at, StartPath.TRIGGER, deadline=None, tick=tick
            )
        finally:
            _SOURCE.reset(token)
        if task is not None:
            await asyncio.shield(task)
        key = tick_options(entry.name, entry.kind, entry.policy, run_key).lock_key
        record = (await self._records([key])).get(key)
        outcome = None
        if record is not None and record.status is JobSchedulerStatus.SUCCESS:
            outcome = "SUCCESS"
        elif (
            record is not None
            and record.status is JobSchedulerStatus.FAIL
            and not record.released
            and record.attempts >= entry.policy.retries + 1
        ):
            outcome = "FAIL"
        if outcome is not None:
            await self.store.finish_action(action.id, outcome, None)
            self._log.info(
                "schedule %r: trigger %d finished: %s",
                entry.name,
                action.id,
                outcome,
                extra={"action": "trigger_finished", "schedule": entry.name},
            )

    async def _backfill(self, action: ControlAction) -> None:
        entry = self._entry(action.schedule)
        jobs = self.scheduler._jobs
        if entry is None or jobs is None:
            return
        options = JobAcquireOptions(
            code=entry.name,
            run_key=f"{BACKFILL_PREFIX}{action.id}",
            lease_ms=entry.policy.lease_ms,
            heartbeat_ms=entry.policy.heartbeat_ms,
        )

        async def coordinate(_lease: object) -> str:
            return await self._coordinate(action, entry)

        result = await jobs.run_exclusive(options, coordinate)
        if result.acquired:
            return
        # Not ours: finished elsewhere (SUCCESS row), or another replica coordinates it now.
        record = (await jobs.tick_records([options.lock_key])).get(options.lock_key)
        if record is not None and record.status is JobSchedulerStatus.SUCCESS:
            await self.store.finish_action(action.id, "SUCCESS", None)

    async def _coordinate(self, action: ControlAction, entry: Entry) -> str:
        params = action.params
        start = datetime.fromisoformat(str(params["from"]))
        end = datetime.fromisoformat(str(params["to"]))
        concurrency = int(params.get("concurrency", 1))
        if entry.policy.overlap is not Overlap.ALLOW:
            concurrency = 1
        instants = expected_instants(
            entry.trigger, start, end + timedelta(microseconds=1), limit=MAX_RANGE_TICKS
        )
        keys = [lock_key(entry.name, entry.trigger, t)[0] for t in instants]
        await self.store.release_failed(keys, action.created_at, f"backfill:{action.id}")
        self._log.info(
            "schedule %r: backfill %d of %d tick(s) coordinated here",
            entry.name,
            action.id,
            len(instants),
            extra={"action": "backfill_started", "schedule": entry.name},
        )
        pause_s = min(1.0, entry.policy.lease_ms / 3000)
        while True:
            records = await self._records(keys)
            todo = [t for t, k in zip(instants, keys, strict=True) if not _done(records.get(k))]
            progress = self._progress(instants, keys, records)
            await self.store.set_progress(action.id, progress)
            if not todo:
                break
            started = await self._run_ticks(entry, todo, concurrency)
            if not started:
                await asyncio.sleep(pause_s)  # running elsewhere: its lease decides
        outcome = "SUCCESS" if progress["failed"] == 0 else "FAIL"
        await self.store.finish_action(action.id, outcome, progress)
        self._log.info(
            "schedule %r: backfill %d finished: %s",
            entry.name,
            action.id,
            progress,
            extra={"action": "backfill_finished", "schedule": entry.name},
        )
        return outcome

    @staticmethod
    def _progress(
        instants: list[datetime], keys: list[str], records: Mapping[str, TickRecord]
    ) -> dict[str, int]:
        succeeded = failed = 0
        for key in keys:
            record = records.get(key)
            if record is not None and record.status is JobSchedulerStatus.SUCCESS:
                succeeded += 1
            elif _done(record):
                failed += 1
        return {
            "total": len(instants),
            "succeeded": succeeded,
            "failed": failed,
            "remaining": len(instants) - succeeded - failed,
        }

    async def _run_ticks(self, entry: Entry, todo: list[datetime], concurrency: int) -> int:
        """Offer each tick once, oldest first, at most ``concurrency`` at a time; return how
        many ran here."""
        launched: list[asyncio.Task[TickOutcome]] = []
        sup = self.scheduler._sup
        for instant in todo:
            while True:
                if entry.removed or not entry.active:
                    break
                active = {t for t in launched if not t.done()}
                if len(active) < concurrency:
                    token = _SOURCE.set("backfill")
                    try:
                        task = sup.launch(entry, instant, StartPath.BACKFILL, deadline=None)
                    finally:
                        _SOURCE.reset(token)
                    if task is not None:
                        launched.append(task)
                        break
                    if instant in entry.in_flight:
                        break  # already running here (a regular fire): its row decides
                busy: set[asyncio.Task[Any]] = set(active) or set(entry.running)
                if busy:
                    await asyncio.wait(busy, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                else:
                    await asyncio.sleep(0.05)
        pending = [t for t in launched if not t.done()]
        if pending:
            await asyncio.wait(pending)
        return sum(
            1 for t in launched if not t.cancelled() and t.exception() is None and t.result().ran
        )

    async def _resume_catch_up(
        self, entry: Entry, paused_at: datetime, resumed_at: datetime
    ) -> None:
        """On resume: the schedule's catch-up policy over the ticks the pause skipped."""
        now = datetime.now(UTC)
        start = max(paused_at, now - timedelta(milliseconds=entry.policy.catch_up_window_ms))
        if resumed_at <= start:
            return
        instants = latest_instants(entry.trigger, start, resumed_at, MAX_CATCH_UP)
        keys = {lock_key(entry.name, entry.trigger, t)[0]: t for t in instants}
        records = await self._records(list(keys))
        chosen = []
        for key, instant in keys.items():
            record = records.get(key)
            if (
                record is None
                or record.released
                or (record.attempts == 0 and record.skipped == "paused")
            ):
                chosen.append(instant)
        if entry.policy.catch_up is CatchUp.LATEST:
            chosen = chosen[-1:]
        if not chosen or entry.removed:
            return
        self.scheduler._sup._start_pending(
            entry, chosen, StartPath.CATCH_UP, log_level=logging.INFO
        )


def _bind(function: Callable[..., Any], args: Mapping[str, Any]) -> Handler:
    """A stored schedule's handler: ``function(tick, args)`` as a tick handler."""
    if inspect.iscoroutinefunction(function):

        async def bound(tick: Tick) -> Any:
            return await function(tick, dict(args))

        return bound

    def bound_sync(tick: Tick) -> Any:
        return function(tick, dict(args))

    return bound_sync
