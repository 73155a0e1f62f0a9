"""The tables (SQLAlchemy 2 declarative, async) and how they are created.

``create_schema`` is ``metadata.create_all`` under an advisory lock, good enough for an example
(a real service runs Alembic migrations, which can also carry sdcore's tables: see the
SQLAlchemy/Alembic how-to).
"""

from __future__ import annotations

import enum
import uuid
from datetime import date, datetime

from sqlalchemy import (
    Boolean,
    Date,
    DateTime,
    Enum,
    ForeignKey,
    Index,
    Integer,
    String,
    func,
    text,
)
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Any constant shared by the replicas; it only has to differ from other advisory locks in the DB.
_SCHEMA_LOCK = 0x7461736B666C6F77  # "taskflow"


class TaskStatus(enum.StrEnum):
    """Where a task stands. ``OVERDUE`` is set by the nightly job, never by a client."""

    TODO = "TODO"
    IN_PROGRESS = "IN_PROGRESS"
    DONE = "DONE"
    OVERDUE = "OVERDUE"


class Base(DeclarativeBase):
    """Declarative base of TaskFlow's tables."""


class User(Base):
    """Someone who holds a token; created on first use (the token's ``sub`` is the id)."""

    __tablename__ = "users"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String(320))


class Project(Base):
    """A project: its owner and its members may see and change its tasks."""

    __tablename__ = "projects"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    name: Mapped[str] = mapped_column(String(200))
    owner_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("users.id"))


class ProjectMember(Base):
    """A user who belongs to a project without owning it."""

    __tablename__ = "project_members"

    project_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("projects.id", ondelete="CASCADE"), primary_key=True
    )
    user_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("users.id"), primary_key=True)


class Task(Base):
    """A task. ``version`` counts status changes; it names each change's notification."""

    __tablename__ = "tasks"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    project_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    title: Mapped[str] = mapped_column(String(500))
    status: Mapped[TaskStatus] = mapped_column(
        Enum(TaskStatus, name="task_status", native_enum=False, length=20),
        default=TaskStatus.TODO,
    )
    due_date: Mapped[date | None] = mapped_column(Date, default=None)
    archived: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))
    version: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))

    __table_args__ = (
        # What the overdue job scans: open tasks by due date.
        Index(
            "tasks_open_due_idx",
            "due_date",
            postgresql_where=text("NOT archived AND status IN ('TODO', 'IN_PROGRESS')"),
        ),
    )


class OverdueRun(Base):
    """The ledger of ``mark-overdue-tasks``: one row per execution, written with its UPDATE.

    Deliberately without a unique constraint on ``run_key``: a second execution of a tick would
    show up here instead of failing, which is what the multi-replica test looks for.
    """

    __tablename__ = "overdue_runs"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    run_key: Mapped[str] = mapped_column(String(64), index=True)
    business_day: Mapped[date] = mapped_column(Date)
    marked: Mapped[int] = mapped_column(Integer)
    replica: Mapped[str] = mapped_column(String(200))
    fencing_token: Mapped[int | None] = mapped_column(Integer)
    ran_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.clock_timestamp()
    )


async def create_schema(engine: AsyncEngine) -> None:
    """Create the tables if missing; safe when several replicas start at once.

    ``CREATE TABLE IF NOT EXISTS`` is not safe under concurrency (two sessions can both see the
    table missing and one fails on the catalog's unique index), hence the transaction-scoped
    advisory lock.
    """
    async with engine.begin() as conn:
        await conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SCHEMA_LOCK})
        await conn.run_sync(Base.metadata.create_all)


def session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    """Sessions that keep loaded attributes after commit (the response is built after it)."""
    return async_sessionmaker(engine, expire_on_commit=False)
