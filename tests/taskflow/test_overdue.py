"""``mark-overdue-tasks`` against PostgreSQL with a fixed tick: the right tasks, once."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, date, datetime
from zoneinfo import ZoneInfo

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from taskflow.db import OverdueRun, Project, Task, TaskStatus, User, create_schema, session_factory
from taskflow.overdue import SCHEDULE, OverdueJob, is_overdue, mark_overdue

from sdcore.scheduling import Tick, format_run_key

# 01:00 in Paris on July 1st, 2026 — still June 30 in UTC.
TICK_AT = datetime(2026, 6, 30, 23, 0, tzinfo=UTC)
OWNER = uuid.UUID(int=1)

SEED: list[tuple[str, TaskStatus, date | None, bool]] = [
    ("due yesterday in Paris (today in UTC)", TaskStatus.TODO, date(2026, 6, 30), False),
    ("in progress, long late", TaskStatus.IN_PROGRESS, date(2026, 1, 2), False),
    ("late by a day, in progress", TaskStatus.IN_PROGRESS, date(2026, 6, 30), False),
    ("due today in Paris", TaskStatus.TODO, date(2026, 7, 1), False),
    ("due tomorrow", TaskStatus.TODO, date(2026, 7, 2), False),
    ("no due date", TaskStatus.TODO, None, False),
    ("late but done", TaskStatus.DONE, date(2026, 6, 1), False),
    ("late but archived", TaskStatus.TODO, date(2026, 6, 1), True),
    ("already overdue", TaskStatus.OVERDUE, date(2026, 6, 1), False),
]


@pytest.fixture
async def sessions(database_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = create_async_engine(database_url.replace("postgresql://", "postgresql+psycopg://"))
    try:
        await create_schema(engine)
        yield session_factory(engine)
    finally:
        await engine.dispose()


async def _seed(sessions: async_sessionmaker[AsyncSession]) -> dict[str, Task]:
    async with sessions() as session, session.begin():
        session.add(User(id=OWNER, email="owner@example.com"))
        await session.flush()  # no relationship() between the models: flush in FK order
        project = Project(id=uuid.uuid4(), name="P", owner_id=OWNER)
        session.add(project)
        await session.flush()
        tasks = {
            title: Task(
                id=uuid.uuid4(),
                project_id=project.id,
                title=title,
                status=status,
                due_date=due,
                archived=archived,
                version=0,
            )
            for title, status, due, archived in SEED
        }
        session.add_all(tasks.values())
    return tasks


async def _statuses(sessions: async_sessionmaker[AsyncSession]) -> dict[str, tuple[str, int]]:
    async with sessions() as session:
        rows = await session.execute(select(Task.title, Task.status, Task.version))
        return {title: (status.value, version) for title, status, version in rows}


def _tick(at: datetime) -> Tick:
    return Tick(
        schedule=SCHEDULE,
        scheduled_at=at,
        local_time=at.astimezone(ZoneInfo("Europe/Paris")),
        run_key=format_run_key(at),
    )


async def test_the_job_marks_exactly_the_late_open_tasks_once(
    sessions: async_sessionmaker[AsyncSession], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="taskflow")
    await _seed(sessions)
    today = date(2026, 7, 1)
    expected = {
        title: (
            "OVERDUE" if is_overdue(status=s, due_date=d, archived=a, today=today) else s.value,
            1 if is_overdue(status=s, due_date=d, archived=a, today=today) else 0,
        )
        for title, s, d, a in SEED
    }
    job = OverdueJob(sessions, replica="replica-test")

    assert await job(_tick(TICK_AT)) == 3
    after_first = await _statuses(sessions)
    assert after_first == expected
    assert after_first["due yesterday in Paris (today in UTC)"] == ("OVERDUE", 1)
    assert after_first["due today in Paris"] == ("TODO", 0)

    # Idempotent: the same tick again (a retry, a second replica past its lease) changes nothing.
    assert await job(_tick(TICK_AT)) == 0
    assert await _statuses(sessions) == after_first

    assert [m for m in caplog.messages if "marked OVERDUE" in m] == [
        "3 task(s) marked OVERDUE",
        "0 task(s) marked OVERDUE",
    ]
    async with sessions() as session:
        runs = (await session.scalars(select(OverdueRun).order_by(OverdueRun.id))).all()
    assert [(r.run_key, r.business_day, r.marked, r.replica) for r in runs] == [
        ("2026-06-30T23:00:00Z", today, 3, "replica-test"),
        ("2026-06-30T23:00:00Z", today, 0, "replica-test"),
    ]


async def test_the_day_turns_at_midnight_in_paris(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    await _seed(sessions)
    job = OverdueJob(sessions, replica="r")
    # 23:59:59 on June 30 in Paris: only what was due before June 30 is late.
    assert await job(_tick(datetime(2026, 6, 30, 21, 59, 59, tzinfo=UTC))) == 1
    # One second later it is July 1st in Paris (22:00 UTC): the June 30 tasks turn late too.
    assert await job(_tick(datetime(2026, 6, 30, 22, 0, tzinfo=UTC))) == 2
    async with sessions() as session, session.begin():
        assert await mark_overdue(session, date(2026, 7, 1)) == 0
