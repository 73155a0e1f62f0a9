"""``mark-overdue-tasks``: every night at 01:00 Paris time, on exactly one replica.

One ``UPDATE`` marks every open task (``TODO``/``IN_PROGRESS``, not archived) whose due date is
before *today in Paris* as ``OVERDUE``. It is idempotent (already ``OVERDUE`` tasks are not
open), and sdcore's lease makes it exclusive: every replica fires the tick, one runs it.
"Today" comes from the tick's *scheduled* instant, not from the wall clock, so every replica, a
retry and a catch-up run all compute the same day.

The change does not go through ``TasksService.update_status``: no ``task.status.changed`` is
emitted for it (emit one per task after the commit if those need notifying).
"""

from __future__ import annotations

import logging
from datetime import date
from typing import Any

from sdcore.scheduling import Scheduler, Tick
from sqlalchemy import CursorResult, Update, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from taskflow.clock import APP_TIME_ZONE, business_day
from taskflow.db import OverdueRun, Task, TaskStatus
from taskflow.settings import Settings

SCHEDULE = "mark-overdue-tasks"
OPEN_STATUSES = (TaskStatus.TODO, TaskStatus.IN_PROGRESS)
_log = logging.getLogger(__name__)


def is_overdue(*, status: TaskStatus, due_date: date | None, archived: bool, today: date) -> bool:
    """The rule :func:`mark_overdue_statement` applies, for one task (tests compare the two)."""
    return not archived and status in OPEN_STATUSES and due_date is not None and due_date < today


def mark_overdue_statement(today: date) -> Update:
    """The one ``UPDATE`` of the job (``version`` counts every status change)."""
    return (
        update(Task)
        .where(
            Task.archived.is_(False),
            Task.status.in_(OPEN_STATUSES),
            Task.due_date < today,
        )
        .values(status=TaskStatus.OVERDUE, version=Task.version + 1)
        .execution_options(synchronize_session=False)
    )


async def mark_overdue(session: AsyncSession, today: date) -> int:
    """Run the ``UPDATE`` in ``session``'s transaction; return how many tasks it marked."""
    result: CursorResult[Any] = await session.execute(mark_overdue_statement(today))  # type: ignore[assignment]
    return int(result.rowcount)


class OverdueJob:
    """The handler of ``mark-overdue-tasks``; also callable directly with any :class:`Tick`.

    Args:
        sessions: Session factory of the application's engine.
        replica: This replica's name, recorded in the ``overdue_runs`` ledger.
    """

    def __init__(self, sessions: async_sessionmaker[AsyncSession], *, replica: str) -> None:
        self._sessions = sessions
        self._replica = replica

    async def __call__(self, tick: Tick) -> int:
        """Mark the overdue tasks of the tick's Paris day and record the run; return the count.

        An error propagates: sdcore logs it with the schedule and run key, marks the tick
        ``FAIL`` and retries it (``retries``), never past the next tick.
        """
        today = business_day(tick.scheduled_at)
        async with self._sessions() as session, session.begin():
            marked = await mark_overdue(session, today)
            session.add(
                OverdueRun(
                    run_key=tick.run_key or tick.scheduled_at.isoformat(),
                    business_day=today,
                    marked=marked,
                    replica=self._replica,
                    fencing_token=tick.lease.fencing_token if tick.lease is not None else None,
                )
            )
        _log.info(
            "%d task(s) marked OVERDUE",
            marked,
            extra={
                "action": "tasks_marked_overdue",
                "schedule": tick.schedule,
                "run_key": tick.run_key,
                "business_day": today.isoformat(),
                "marked": marked,
            },
        )
        return marked


def register_overdue_job(scheduler: Scheduler, job: OverdueJob, settings: Settings) -> None:
    """Declare the schedule (NestJS ``@Cron(EVERY_DAY_AT_1AM, {name, timeZone})``).

    ``retries=2`` re-runs a tick that failed (database blip); ``catch_up="latest"`` runs the
    last tick missed while every replica was down (within ``overdue_catch_up_ms``).
    """
    catch_up: dict[str, Any] = {}
    if settings.overdue_catch_up_ms:
        catch_up = {"catch_up": "latest", "catch_up_window_ms": settings.overdue_catch_up_ms}

    @scheduler.cron(
        settings.overdue_cron, name=SCHEDULE, time_zone=APP_TIME_ZONE, retries=2, **catch_up
    )
    async def mark_overdue_tasks(tick: Tick) -> None:
        await job(tick)
