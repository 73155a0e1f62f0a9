"""``LeaseAdmin`` for blocking code: the async admin's statements on a ``psycopg.Connection``.

The operations are :class:`sdcore.job_scheduler._admin.LeaseStatements` generators (validation,
SQL, results); this module only drives them on a blocking connection, in the caller's thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row

from sdcore._internal.steps import run_blocking
from sdcore.job_scheduler._admin import (
    FINISHED,
    LeaseRecord,
    LeaseStatements,
    Plan,
    PruneReport,
    ReleasedRun,
    Statement,
)
from sdcore.job_scheduler._model import JobSchedulerStatus

__all__ = ["LeaseAdmin"]

T = TypeVar("T")


class LeaseAdmin:
    """Operator operations on one lease table (list, release, prune), on a blocking connection.

    The async :class:`sdcore.job_scheduler.LeaseAdmin`'s statements, validation and results,
    run on a ``psycopg.Connection`` in the caller's thread (no portal): every method takes an
    autocommit connection (each statement its own short transaction), validates its arguments
    before any SQL, and raises :class:`~sdcore.job_scheduler.JobSchedulerDatabaseError` or
    :class:`~sdcore.job_scheduler.JobSchedulerUnavailableError` instead of a driver error.

    Args:
        table: The lease table.
        schema: Its schema; ``None`` means the connection's ``search_path``.

    Raises:
        InvalidIdentifierError: A bad table or schema name.
    """

    def __init__(self, *, table: str = "job_scheduler", schema: str | None = None) -> None:
        self.statements = LeaseStatements(table=table, schema=schema)
        self.table = self.statements.table
        self.schema = self.statements.schema

    @property
    def shown(self) -> str:
        """The quoted table name, for messages."""
        return self.statements.shown

    def list_runs(
        self,
        conn: psycopg.Connection[Any],
        *,
        code: str | None = None,
        status: JobSchedulerStatus | str | None = None,
        limit: int = 50,
    ) -> list[LeaseRecord]:
        """Return runs newest first (see the async ``LeaseAdmin.list_runs``).

        Raises:
            InvalidAdminRequestError: A bad filter or limit, before any SQL.
        """
        return self._run(conn, self.statements.list_runs(code, status, limit))

    def release(
        self, conn: psycopg.Connection[Any], job_id: str, *, reason: str | None = None
    ) -> ReleasedRun:
        """Mark a RUNNING run FAIL so that the next acquire takes it at once.

        Raises:
            InvalidAdminRequestError: A malformed id or reason, before any SQL.
            JobNotFoundError: No such row.
            JobNotRunningError: The row is not RUNNING.
        """
        return self._run(conn, self.statements.release(job_id, reason))

    def prune(
        self,
        conn: psycopg.Connection[Any],
        *,
        older_than: timedelta,
        statuses: Sequence[JobSchedulerStatus | str] = FINISHED,
        batch_size: int = 1_000,
        include_initial: bool = False,
        dry_run: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> PruneReport:
        """Delete finished rows last modified before the database's now minus ``older_than``,
        in batches (see the async ``LeaseAdmin.prune``).

        Raises:
            InvalidAdminRequestError: A bad age, status or batch size, before any SQL.
        """
        plan = self.statements.prune(
            older_than=older_than,
            statuses=statuses,
            batch_size=batch_size,
            include_initial=include_initial,
            dry_run=dry_run,
            progress=progress,
        )
        return self._run(conn, plan)

    def has_schedule_runs(self, conn: psycopg.Connection[Any], code: str) -> bool:
        """Whether the table holds any run of the schedule ``code``.

        Raises:
            InvalidAdminRequestError: ``code`` is not a str without NUL.
        """
        return self._run(conn, self.statements.has_schedule_runs(code))

    def _run(self, conn: psycopg.Connection[Any], plan: Plan[T]) -> T:
        """Drive ``plan`` on ``conn``: each statement's answer is sent back into it."""
        given: object = conn  # typed as a Connection; called by untyped code too
        if not isinstance(given, psycopg.Connection):
            plan.close()
            raise TypeError(
                "conn must be a blocking psycopg.Connection (for an AsyncConnection, use "
                f"sdcore.job_scheduler.LeaseAdmin), got {type(conn).__name__}"
            )

        def run(step: Statement) -> Any:
            if step.every_row:
                with conn.cursor(row_factory=dict_row) as cur:
                    cur.execute(step.query, step.params)
                    return cur.fetchall()
            return conn.execute(step.query, step.params).fetchone()

        with self.statements.errors():
            return run_blocking(plan, run)
