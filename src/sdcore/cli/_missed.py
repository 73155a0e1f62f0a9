"""``sdcore schedules missed NAME``: expected ticks without a ``SUCCESS`` row, and why.

With ``--app`` the schedule is the application's (a Scheduler, or a Runtime's); without it, the
definition the control plane stores for ``NAME`` (what ``schedules list`` shows), read from the
database as ``history`` does. Either way the ticks come from the same calendar the replicas
fire on, and each missed tick says why it did not run when the lease table recorded a reason:
skipped on purpose (paused, overlap) or any reason the scheduling layer reports.
"""

from __future__ import annotations

import asyncio
import difflib
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import errors as pg_errors

from sdcore.cli._format import escape, json_line, render_table, utc_iso
from sdcore.cli._target import CliError, Target, describe_error, run_admin, started_runtime
from sdcore.job_scheduler import LeaseAdmin

if TYPE_CHECKING:
    from sdcore.scheduling import MissedTick, Scheduler

Emit = Callable[[str], None]
DEFAULT_SPAN = timedelta(hours=24)
MISSED_KEYS = (
    "run_key",
    "scheduled_at",
    "status",
    "attempts",
    "skipped",
    "given_back",
    "reason",
)


def given_back_of(tick: MissedTick) -> str | None:
    """Why the replica that won ``tick`` gave it back unstarted, when the lease says so."""
    return tick.given_back or None


def reason_of(tick: MissedTick) -> str | None:
    """Why ``tick`` did not run, as recorded (``None``: no reason was recorded)."""
    if tick.skipped is not None:
        return f"skipped ({tick.skipped})"
    given_back = given_back_of(tick)
    if given_back is not None:
        return f"given back, never ran ({given_back})"
    return None


def state_of(tick: MissedTick) -> str:
    """The table's ``state`` column: the reason if there is one, else the row's status."""
    why = reason_of(tick)
    if why is not None:
        return why
    return "never started" if tick.status is None else tick.status.value


def did_you_mean(name: str, known: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest known name, or nothing."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {escape(close[0])!r}?)" if close else ""


def stored_scheduler(target: Target, name: str) -> Scheduler:
    """A never-started Scheduler holding the control plane's stored definition of ``name``.

    Raises:
        CliError: No such schedule (with the closest name), not a cron/interval schedule, the
            tables are missing, or the database failed.
    """
    from sdcore.scheduling import (
        InvalidScheduleError,
        ScheduleAdmin,
        ScheduleKind,
        Scheduler,
    )

    async def read() -> tuple[Any, list[str]]:
        async with started_runtime(target) as runtime:
            store = runtime.schedule_store
            row = await store.row(name)
            if row is not None and row.removed_at is None:
                return row, []
            names = [s.name for s in await ScheduleAdmin(store).list_schedules()]
            return None, names

    try:
        row, names = asyncio.run(read())
    except (pg_errors.UndefinedTable, pg_errors.InvalidSchemaName):
        words = "sdcore db upgrade --schedules"
        if target.schema:
            words += f" --schema {target.schema}"
        raise CliError(f"the schedules tables do not exist; run `{words}`") from None
    except psycopg.Error as exc:
        raise describe_error(exc, target) from None
    if row is None:
        hint = did_you_mean(name, names)
        if not names:
            hint = (
                "; no replica has joined the control plane (a bare Scheduler does not: use a "
                "Runtime or a ScheduleControl), or name the application with --app"
            )
        raise CliError(f"no such schedule {escape(name)!r}{hint}")
    # A calendar only: never started, so no job scheduler and nothing exclusive.
    scheduler = Scheduler()
    try:
        if row.kind == ScheduleKind.CRON.value:
            scheduler.add_cron(
                row.name, row.expression, _noop, time_zone=row.time_zone, exclusive=False
            )
        elif row.kind == ScheduleKind.INTERVAL.value:
            scheduler.add_interval(row.name, int(row.expression), _noop, exclusive=False)
        else:
            raise CliError(
                f"{escape(name)!r} is a {row.kind} schedule: missed ticks are computed for cron "
                "and interval schedules"
            )
    except (InvalidScheduleError, ValueError, TypeError) as exc:
        raise CliError(f"the stored definition of {escape(name)!r} is not usable: {exc}") from None
    return scheduler


def _noop(_: object) -> None:
    return None


def missed_ticks(
    target: Target,
    scheduler: Scheduler,
    name: str,
    since: datetime | None,
    end: datetime,
    emit: Emit,
    *,
    as_json: bool = False,
    where: str,
    stored: bool = False,
) -> int:
    """Print the expected ticks of ``name`` in ``[since, end)`` that have no SUCCESS row.

    A schedule with no lease row at all is refused rather than listed tick by tick: a
    non-exclusive schedule never writes one, so its ticks cannot be told apart from ticks that
    never ran.

    Args:
        target: The lease table.
        scheduler: Holds ``name`` (the application's, or :func:`stored_scheduler`'s).
        name: The schedule.
        since: Range start (``None``: the schedule's first recorded run, at most
            :data:`DEFAULT_SPAN` before ``end``).
        end: Range end.
        emit: Writes one line.
        as_json: One JSON object per tick (keys :data:`MISSED_KEYS`).
        where: Where the definition came from, for messages.
        stored: The definition is the control plane's (its calendar says nothing of
            exclusivity).

    Returns:
        How many ticks are missed.

    Raises:
        CliError: Unknown schedule, bad range, no recorded run at all, database failure.
    """
    from sdcore.job_scheduler import JobSchedulerError
    from sdcore.scheduling import InvalidScheduleError, ScheduleNotFoundError

    if since is not None and since >= end:
        raise CliError("--since must be before --until")
    try:
        info = scheduler.get(name)
    except ScheduleNotFoundError:
        known = [s.name for s in scheduler.schedules()]
        hint = did_you_mean(name, known)
        raise CliError(f"no schedule named {escape(name)!r} in {where}{hint}") from None

    async def recorded(admin: LeaseAdmin, conn: Any) -> bool:
        return await admin.has_schedule_runs(conn, name)

    if not run_admin(target, recorded):
        how = (
            "it is not exclusive (no jobs= or exclusive=False)"
            if not info.exclusive and not stored
            else "it never ran against this table"
        )
        raise CliError(
            f"no run of {escape(name)!r} is recorded in {target.shown}; {how}. Non-exclusive "
            "schedules write no lease rows, so their missed ticks cannot be checked "
            "(check --table/--schema if it does run exclusively)"
        )

    async def query() -> tuple[datetime, list[MissedTick]]:
        async with started_runtime(target) as runtime:
            start = since
            if start is None:
                first = await runtime.jobs.first_seen(name)
                start = max(end - DEFAULT_SPAN, first or end - DEFAULT_SPAN)
            return start, await scheduler.missed_ticks(name, start, end, jobs=runtime.jobs)

    try:
        since, found = asyncio.run(query())
    except (InvalidScheduleError, JobSchedulerError, ValueError) as exc:
        raise CliError(str(exc)) from None
    if as_json:
        for tick in found:
            emit(
                json_line(
                    {
                        "run_key": tick.run_key,
                        "scheduled_at": utc_iso(tick.scheduled_at),
                        "status": None if tick.status is None else tick.status.value,
                        "attempts": tick.attempts,
                        "skipped": tick.skipped,
                        "given_back": given_back_of(tick),
                        "reason": reason_of(tick),
                    }
                )
            )
        return len(found)
    rows = [[m.run_key, state_of(m)] for m in found]
    for line in render_table(["run_key", "state"], rows, {}):
        emit(line)
    skipped = sum(1 for m in found if m.skipped is not None)
    tail = f" ({skipped} skipped on purpose)" if skipped else ""
    emit(
        f"{len(found)} missed tick(s) of {escape(name)!r} in "
        f"[{utc_iso(since)}, {utc_iso(end)}){tail}"
    )
    return len(found)
