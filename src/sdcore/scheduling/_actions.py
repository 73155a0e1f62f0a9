"""Control actions on one replica: trigger, backfill, and the catch-up of a resumed schedule.

Every tick they start goes through the scheduler's one start path (overlap, gate, lease), so each
stays exactly once: a trigger runs under its own run key (``trigger:<action id>``); a backfill is
coordinated by the replica holding the lease ``backfill:<action id>`` and runs each tick under
the tick's own run key, ticks already done being refused by their own rows.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta

from sdcore.job_scheduler import JobAcquireOptions, JobSchedulerStatus, TickRecord
from sdcore.scheduling._catch_up import (
    MAX_CATCH_UP,
    MAX_RANGE_TICKS,
    latest_instants,
    lock_key,
    settled,
    skipped_by_pause,
    skipped_paused,
)
from sdcore.scheduling._control import (
    BACKFILL_PREFIX,
    TRIGGER_PREFIX,
    ControlAction,
    ScheduleStore,
)
from sdcore.scheduling._entry import Entry
from sdcore.scheduling._hooks import SchedulerHooks
from sdcore.scheduling._policy import CatchUp, Overlap, StartPath
from sdcore.scheduling._runner import TickOutcome, tick_options, utcnow
from sdcore.scheduling._triggers import Tick, expected_instants

__all__ = ["CANCELLED", "ActionRunner"]

# The outcome of a backfill whose ticks no longer exist (its schedule was removed, or updated to
# other ticks) or that cannot run where it is coordinated.
CANCELLED = "CANCELLED"
# How often a backfill's coordinator writes its progress while its ticks run.
PROGRESS_EVERY_S = 1.0
# A resume's catch-up reads its ticks' rows again, up to this many times in all, while another
# catch-up keeps replacing the schedule's pending ticks under it.
_READS = 3


def _done(record: TickRecord | None) -> bool:
    """A backfilled tick needs nothing more: succeeded, or failed since the backfill began."""
    if record is None:
        return False
    if record.status is JobSchedulerStatus.SUCCESS:
        return True
    return (
        record.status is JobSchedulerStatus.FAIL
        and record.attempts > 0
        and not record.released
        and not record.given_back
    )


class ActionRunner:
    """Executes the open control actions this replica can take part in.

    Args:
        hooks: The scheduler, as the control plane sees it.
        store: The control plane's store.
        logger: The control plane's logger.
        clock: The replica's wall clock (aware UTC).
    """

    def __init__(
        self,
        hooks: SchedulerHooks,
        store: ScheduleStore,
        logger: logging.Logger,
        *,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.hooks = hooks
        self.store = store
        self._log = logger
        self._clock = clock

    async def _records(self, keys: list[str]) -> dict[str, TickRecord]:
        jobs = self.hooks.jobs
        if jobs is None:
            return {}
        return await jobs.tick_records(keys)

    async def trigger(self, action: ControlAction) -> None:
        """Run the trigger's tick here if this replica wins it; finish the action once decided."""
        entry = self.hooks.entry(action.schedule)
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
        # The trigger's identity among this process's runs of the schedule (``in_flight``) is
        # never a fire instant (those are whole milliseconds): a regular tick due at the very
        # instant the trigger was requested must not be refused as "already running here".
        slot = at.replace(microsecond=at.microsecond // 1000 * 1000 + 1)
        task = self.hooks.launch(entry, slot, StartPath.TRIGGER, tick=tick)
        # Refused while a run of the schedule goes on here (overlap): offered again as soon as
        # that run ends. Waiting for the next poll instead can starve it for good: the polls
        # keep their phase against the schedule's grid, so they can land in every run. The
        # catch-up ticks pending here wait for it (they would otherwise start first each time).
        if task is None and entry.running:
            entry.actions_waiting += 1
            try:
                while task is None and entry.running and self.hooks.entry(entry.name) is entry:
                    await asyncio.wait(set(entry.running), return_when=asyncio.FIRST_COMPLETED)
                    task = self.hooks.launch(entry, slot, StartPath.TRIGGER, tick=tick)
            finally:
                entry.actions_waiting -= 1
                if task is None:
                    self.hooks.drain(entry)  # refused for good: the catch-up goes on
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
            and not record.given_back
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

    async def backfill(self, action: ControlAction) -> None:
        """Coordinate the backfill here if this replica wins its lease (see ``_coordinate``)."""
        entry = self.hooks.entry(action.schedule)
        jobs = self.hooks.jobs
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
        tick_keys = list(keys)  # the ticks' own keys; ``keys`` holds each re-run's instead
        await self.store.release_failed(keys, action.created_at, f"backfill:{action.id}")
        already, reruns = await self._reruns(action, entry, instants, keys)
        self._log.info(
            "schedule %r: backfill %d of %d tick(s) coordinated here",
            entry.name,
            action.id,
            len(instants),
            extra={"action": "backfill_started", "schedule": entry.name},
        )
        pause_s = min(1.0, entry.policy.lease_ms / 3000)
        cancelled: str | None = None
        before = {"rerun" if reruns else "already_succeeded": len(reruns or already)}

        async def report() -> None:
            # The progress moves while a round runs (one round offers every tick left):
            # `backfill --wait` and a remove's CANCELLED show how far it got.
            while True:
                await asyncio.sleep(PROGRESS_EVERY_S)
                try:
                    done = self._progress(instants, keys, await self._records(keys))
                    await self.store.set_progress(action.id, {**done, **before})
                except Exception as exc:  # noqa: BLE001 - the round's end writes it anyway
                    self._log.debug("backfill %d: progress not written: %s", action.id, exc)

        while True:
            records = await self._records(keys)
            todo = [t for t, k in zip(instants, keys, strict=True) if not _done(records.get(k))]
            progress = {**self._progress(instants, keys, records), **before}
            await self.store.set_progress(action.id, progress)
            if not todo:
                break
            # An update replaces the registry entry and a remove drops it: the coordinator
            # follows the schedule as it is now, and ends the action once the ticks it was asked
            # for no longer exist, instead of offering them to an entry that refuses them.
            entry, cancelled = self._current(action, entry, instants, tick_keys)
            if cancelled is not None:
                break
            reporter = asyncio.create_task(report())
            try:
                started = await self._run_ticks(entry, todo, concurrency, reruns)
            finally:
                reporter.cancel()
                await asyncio.wait({reporter})  # its cancellation is not this task's
            if not started:
                await asyncio.sleep(pause_s)  # running elsewhere: its lease decides
        if cancelled is not None:
            await self.store.finish_action(action.id, CANCELLED, progress)
            self._log.warning(
                "schedule %r: backfill %d cancelled (%s): %s",
                action.schedule,
                action.id,
                cancelled,
                progress,
                extra={"action": "backfill_cancelled", "schedule": action.schedule},
            )
            return CANCELLED
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

    async def _reruns(
        self, action: ControlAction, entry: Entry, instants: list[datetime], keys: list[str]
    ) -> tuple[set[str], dict[datetime, str]]:
        """The ticks that had succeeded when the backfill was requested, and (with
        ``rerun_succeeded``) the run key each of them runs again under, its lock key replacing
        the tick's in ``keys``.

        The re-run key (``backfill:<action id>:<tick's run key>``) never equals the tick's, so
        its own row keeps it to one run per backfill, whoever coordinates.
        """
        already = await self.store.succeeded_before(keys, action.created_at)
        reruns: dict[datetime, str] = {}
        if not action.params.get("rerun_succeeded"):
            return already, reruns
        for index, (instant, key) in enumerate(zip(instants, keys, strict=True)):
            if key in already:
                tick_key = lock_key(entry.name, entry.trigger, instant)[1]
                run_key = f"{BACKFILL_PREFIX}{action.id}:{tick_key}"
                reruns[instant] = run_key
                keys[index] = tick_options(entry.name, entry.kind, entry.policy, run_key).lock_key
        return already, reruns

    def _current(
        self, action: ControlAction, entry: Entry, instants: list[datetime], tick_keys: list[str]
    ) -> tuple[Entry, str | None]:
        """The schedule's entry now, or why the backfill cannot go on (``(entry, reason)``)."""
        current = self.hooks.entry(action.schedule)
        if current is None or current.removed:
            return entry, "the schedule was removed"
        if current is not entry:
            fresh = [lock_key(current.name, current.trigger, t)[0] for t in instants]
            if fresh != tick_keys:
                return entry, "the schedule's ticks changed"
        if not current.active:
            return entry, "the schedule is stopped on the coordinating replica"
        return current, None

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

    async def _run_ticks(
        self,
        entry: Entry,
        todo: list[datetime],
        concurrency: int,
        reruns: Mapping[datetime, str] | None = None,
    ) -> int:
        """Offer each tick once, oldest first, at most ``concurrency`` at a time; return how
        many ran here. A tick in ``reruns`` runs under the run key given there."""
        launched: list[asyncio.Task[TickOutcome]] = []
        for instant in todo:
            while True:
                if entry.removed or not entry.active:
                    self.hooks.drain(entry)  # a live fire that waited here is dropped, logged
                    break
                active = {t for t in launched if not t.done()}
                if len(active) < concurrency:
                    rerun = (reruns or {}).get(instant)
                    tick = None
                    if rerun is not None:
                        local = instant.astimezone(entry.zone)
                        tick = Tick(
                            schedule=entry.name,
                            scheduled_at=instant.astimezone(UTC),
                            local_time=local,
                            run_key=rerun,
                        )
                    task = self.hooks.launch(entry, instant, StartPath.BACKFILL, tick=tick)
                    if task is not None:
                        launched.append(task)
                        break
                    if instant in entry.in_flight:
                        break  # already running here (a regular fire): its row decides
                if active:
                    await asyncio.wait(active, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                elif entry.running:
                    # Refused for the runs of the schedule in its way: it goes before a live fire
                    # waiting for a live run on the database (TickStarter._start_deferred).
                    entry.actions_waiting += 1
                    try:
                        await asyncio.wait(
                            set(entry.running), timeout=1.0, return_when=asyncio.FIRST_COMPLETED
                        )
                    except BaseException:
                        entry.actions_waiting -= 1
                        self.hooks.drain(entry)  # a live fire waiting behind it starts now
                        raise
                    entry.actions_waiting -= 1
                else:
                    await asyncio.sleep(0.05)
        pending = [t for t in launched if not t.done()]
        if pending:
            await asyncio.wait(pending)
        return sum(
            1 for t in launched if not t.cancelled() and t.exception() is None and t.result().ran
        )

    async def resume_catch_up(
        self, entry: Entry, paused_at: datetime, resumed_at: datetime
    ) -> None:
        """On resume: the schedule's catch-up policy over the ticks the pause skipped.

        The range ends when this replica applied the resume (now), not at ``resumed_at``: until
        it applied it, its gate still skipped ticks as paused, and those ticks are the pause's
        as much as the ones before the resume's commit. Ticks another replica ran meanwhile
        have rows (not chosen); a tick in flight here is refused by the start path.
        """
        now = self._clock()
        window_start = now - timedelta(milliseconds=entry.policy.catch_up_window_ms)
        start = max(paused_at, window_start)
        # Inclusive of the instant this replica applied the resume: a tick due at that very
        # instant may have been skipped as paused just before, in the same turn of the loop.
        end = max(now, resumed_at) + timedelta(microseconds=1)
        if end <= start:
            return
        instants = latest_instants(entry.trigger, start, end, MAX_CATCH_UP)
        # Ticks before the pause the pause still kept from running: the last one may have
        # failed with its retries held back; a fire admitted before it may have started late
        # (deferred behind a backfill or catch-up run, or its acquire waiting) and met it.
        before = latest_instants(entry.trigger, window_start, start, MAX_CATCH_UP)
        before_set = set(before)
        earlier = set(before[:-1])  # all but the last tick before the pause
        # Ticks an earlier catch-up chose and this pause held back (a resume's, say, paused
        # again before it reached them, or an abandoned one a sweep chose during the pause):
        # starting this catch-up replaces the pending set, so they are chosen again here, or
        # they would be dropped. Read again if another catch-up replaced that set meanwhile.
        late: set[datetime] = set()
        for _ in range(_READS):
            pending = entry.pending
            held = {t for t in pending if window_start <= t}
            ordered = sorted({*before, *held, *instants})
            keys = {lock_key(entry.name, entry.trigger, t)[0]: t for t in ordered}
            records = await self._records(list(keys))
            if entry.pending is pending:
                break
        else:
            # Still replaced under the last read: the set's ticks are kept unread (the lease
            # decides whether any of them still runs).
            late = {t for t in entry.pending if window_start <= t}
        chosen = []
        budget = entry.policy.retries + 1
        for key, instant in keys.items():
            record = records.get(key)
            if record is not None and record.given_back:
                # Won and given back unstarted (the pause reached this replica while the
                # tick's acquire waited, or the acquire answered too late): it never ran.
                chosen.append(instant)
            elif (
                record is not None
                and skipped_paused(record)
                and (
                    instant not in before_set
                    # Before the pause: only a skip this pause wrote (not one of an earlier
                    # pause or of the schedule stopped here), by the row's age.
                    or skipped_by_pause(record, paused_at, now)
                )
            ):
                chosen.append(instant)  # skipped by the pause
            elif (
                record is not None
                and instant not in earlier
                and record.status is JobSchedulerStatus.FAIL
                and 0 < record.attempts < budget
                and record.skipped is None
                and not record.released
            ):
                chosen.append(instant)  # a failed tick whose retries the pause held back
            elif instant in held and not settled(record):
                # An earlier catch-up chose it and it is still unsettled (RUNNING: its lease
                # decides whether it was abandoned).
                chosen.append(instant)
            elif instant in before_set and instant not in held:
                continue  # before the pause: the schedule's own policies had it
            elif record is None or record.released or skipped_paused(record):
                chosen.append(instant)
        if late:
            chosen = sorted({*chosen, *late})
        if entry.policy.catch_up is CatchUp.LATEST:
            chosen = chosen[-1:]
        if not chosen or entry.removed:
            return
        self.hooks.catch_up(entry, chosen)
