"""Which missed ticks catch-up and the sweep may start, and what ``missed_ticks`` reports.

Rules (docs/explanation/scheduling.md, "Catch-up"):

- A tick is *settled* when its row is ``SUCCESS``, a ``FAIL`` the retry policy owns (not
  released by an operator, nor given back unstarted by the acquire that won it), or recorded as
  skipped. Catch-up never starts a settled tick, except that a resume's catch-up starts the
  ticks the pause recorded as skipped (``"paused"``, never attempted), and the sweep keeps those
  among the pending ticks it replaces.
- Start-up catch-up looks back ``catch_up_window_ms`` from the start, but never before the
  schedule's first row in the lease table: a schedule never seen before has nothing to catch up.
  For a schedule resumed within that window it also starts the ticks the pause recorded as
  skipped (written since the pause began): the resume's catch-up of the replicas that applied
  it may have stopped with them before it reached them.
- ``latest`` considers only the most recent instant of its range, found by walking back from the
  range's end (any frequency); ``all`` the most recent :data:`MAX_CATCH_UP` instants.
- The sweep considers only ticks fired since the schedule became active on this scheduler, plus the
  ticks start-up catch-up found ``RUNNING`` (maybe abandoned): never ticks from before, except
  that the first sweep of a replica that left its start-up catch-up to the schedule's owners and
  owns it now does that start-up catch-up.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from datetime import datetime, timedelta

from sdcore.job_scheduler import (
    BaseJobScheduler,
    JobAcquireOptions,
    JobSchedulerStatus,
    TickRecord,
)
from sdcore.scheduling._policy import CatchUp
from sdcore.scheduling._triggers import Trigger, expected_instants

MAX_CATCH_UP = 1_000
MAX_RANGE_TICKS = 10_000
_MS = timedelta(milliseconds=1)
# The clock skew allowed between a replica and the database when comparing their instants.
PAUSE_SKEW = timedelta(seconds=5)


@dataclass(frozen=True, slots=True)
class Resumed:
    """A schedule's latest pause, ended by a resume (the control plane's row)."""

    paused_at: datetime
    resumed_at: datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class MissedTick:
    """An expected tick without a ``SUCCESS`` row.

    Attributes:
        scheduled_at: The scheduled instant (UTC).
        run_key: Its run key.
        status: The row's status, ``None`` when it never started (no row).
        attempts: Runs started for it (``None``: no row; 0: recorded as skipped, or given back
            before its first run).
        skipped: Why it was skipped on purpose (``"overlap"``), or ``None``.
        given_back: Why the replica that won it gave it back unstarted (``"acquire answered
            too late"``, ``"cancelled"``), or ``None``. Its ``FAIL`` is no handler's failure:
            any replica's next acquire, a retry or catch-up, takes it at once.
    """

    scheduled_at: datetime
    run_key: str
    status: JobSchedulerStatus | None
    attempts: int | None = None
    skipped: str | None = None
    given_back: str | None = None


def latest_instants(trigger: Trigger, start: datetime, end: datetime, count: int) -> list[datetime]:
    """Return the last ``count`` fire instants in ``[start, end)``, walking back from ``end``.

    The window starts as the narrowest that can hold ``count`` instants (``count`` times the
    trigger's spacing, a lower bound on the gap between two) and doubles until it holds them or
    reaches ``start``, so the cost follows the ticks returned, not the ticks in ``[start, end)``
    (a 1 ms interval over a 1 hour window is cheap), and a window shorter than that is walked
    once.
    """
    span = max(trigger.spacing or _MS, _MS) * count
    while True:
        low = start if end - start <= span else end - span
        found = expected_instants(trigger, low, end, limit=4 * count + 64, keep_last=True)
        if len(found) >= count or low <= start:
            return found[-count:]
        span *= 2


def lock_key(name: str, trigger: Trigger, instant: datetime) -> tuple[str, str]:
    """Return the lock key and run key of the tick of ``name`` at ``instant``."""
    run_key = trigger.run_key(instant)
    assert run_key is not None  # noqa: S101 - cron and interval ticks always have one
    return JobAcquireOptions(code=name, run_key=run_key).lock_key, run_key


def settled(record: TickRecord | None) -> bool:
    """Is the tick done for catch-up purposes (see the module rules)?"""
    if record is None:
        return False
    if record.status is JobSchedulerStatus.SUCCESS:
        return True
    if record.status is JobSchedulerStatus.FAIL:
        return not (record.released or record.given_back)
    return False


async def missed(
    jobs: BaseJobScheduler, name: str, trigger: Trigger, instants: list[datetime]
) -> list[MissedTick]:
    """Return the ticks among ``instants`` that have no ``SUCCESS`` row, oldest first."""
    keys = {lock_key(name, trigger, instant)[0]: instant for instant in instants}
    records = await jobs.tick_records(list(keys))
    result = []
    for key, instant in keys.items():
        record = records.get(key)
        if record is not None and record.status is JobSchedulerStatus.SUCCESS:
            continue
        returned = None
        attempts = None if record is None else record.attempts
        if record is not None and record.given_back:
            # The row keeps the number of the attempt it gave back, which never started.
            returned = record.given_back_reason or "given back"
            attempts = max(record.attempts - 1, 0)
        result.append(
            MissedTick(
                scheduled_at=instant,
                run_key=lock_key(name, trigger, instant)[1],
                status=None if record is None else record.status,
                attempts=attempts,
                skipped=None if record is None else record.skipped,
                given_back=returned,
            )
        )
    return result


def candidates(mode: CatchUp, trigger: Trigger, start: datetime, end: datetime) -> list[datetime]:
    """The instants catch-up considers in ``[start, end)``: the latest one, or the latest N."""
    if end <= start:
        return []
    count = 1 if mode is CatchUp.LATEST else MAX_CATCH_UP
    return latest_instants(trigger, start, end, count)


async def at_start(
    jobs: BaseJobScheduler,
    name: str,
    trigger: Trigger,
    mode: CatchUp,
    window_start: datetime,
    now: datetime,
    resumed: Resumed | None = None,
) -> list[datetime]:
    """The ticks start-up catch-up starts: unsettled, and from after the schedule existed.

    A tick *existed* if it has a row, or falls after the schedule's first row was created. A
    schedule with no row at all was never run anywhere: nothing to catch up. With ``resumed``
    (within the window), a tick its pause recorded as skipped is not settled either.
    """
    first = await jobs.first_seen(name)
    if first is None:
        return []
    keys = start_keys(name, trigger, window_start, now)
    records = await jobs.tick_records(list(keys))
    return started_at_start(first, records, keys, mode, window_start, now, resumed)


def start_keys(
    name: str, trigger: Trigger, window_start: datetime, now: datetime
) -> dict[str, datetime]:
    """The ticks :func:`at_start` looks at: lock key -> instant."""
    return tick_keys(name, trigger, latest_instants(trigger, window_start, now, MAX_CATCH_UP))


def started_at_start(
    first: datetime,
    records: Mapping[str, TickRecord],
    keys: Mapping[str, datetime],
    mode: CatchUp,
    window_start: datetime,
    now: datetime,
    resumed: Resumed | None,
) -> list[datetime]:
    """:func:`at_start`'s choice among the ticks of ``keys`` (:func:`start_keys`) of a schedule
    that first ran at ``first``, given the ``records`` read for them."""
    existing = [t for k, t in keys.items() if t >= first or k in records]
    if mode is CatchUp.LATEST:
        existing = existing[-1:]
    by_instant = {t: records.get(k) for k, t in keys.items()}
    paused_at = None if resumed is None or resumed.resumed_at < window_start else resumed.paused_at
    return [
        t
        for t in existing
        if not settled(by_instant[t])
        or (paused_at is not None and skipped_by_pause(by_instant[t], paused_at, now))
    ]


def skipped_paused(record: TickRecord | None) -> bool:
    """Was the tick recorded as skipped by a pause, never attempted (resume catch-up's own)?"""
    return record is not None and record.attempts == 0 and record.skipped == "paused"


def skipped_by_pause(record: TickRecord | None, paused_at: datetime, now: datetime) -> bool:
    """Was the tick recorded as skipped by the pause that began at ``paused_at`` (a skip written
    since then, by the row's age), never attempted?"""
    return (
        record is not None
        and skipped_paused(record)
        and now - timedelta(milliseconds=record.age_ms) >= paused_at - PAUSE_SKEW
    )


def tick_keys(name: str, trigger: Trigger, instants: Iterable[datetime]) -> dict[str, datetime]:
    """The lock key of each of ``instants``' ticks of ``name``: lock key -> instant."""
    return {lock_key(name, trigger, instant)[0]: instant for instant in instants}


def unsettled(
    records: Mapping[str, TickRecord],
    keys: Mapping[str, datetime],
    chosen: AbstractSet[datetime] = frozenset(),
) -> list[datetime]:
    """The ticks of ``keys`` (lock key -> instant) to start, given the ``records`` read for
    them: unsettled ones (never started, released, or ``RUNNING``: the lease decides whether it
    expired).

    ``chosen``: instants a catch-up already decided to start (the schedule's pending ones). A
    resume's catch-up chooses ticks *because* the pause skipped them, so a ``"paused"`` skip row
    does not settle those: it did not settle them when they were chosen either.
    """
    return [
        instant
        for key, instant in keys.items()
        if not settled(record := records.get(key)) or (instant in chosen and skipped_paused(record))
    ]
