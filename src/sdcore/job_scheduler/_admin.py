"""``LeaseAdmin``: the operator's operations on a lease table (list, release, prune).

The CLI calls these and holds no SQL of its own, so what "release" or "prune" means is defined
once, next to the lease. The statements are in ``sdcore/postgres/sql/admin.sql``;
:class:`LeaseStatements` builds and validates each operation once, and :class:`LeaseAdmin` (on an
async connection) and ``sdcore.sync.LeaseAdmin`` (on a blocking one) only execute it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.rows import dict_row

from sdcore._internal.errors import FieldError
from sdcore._internal.identifiers import check_identifier, qualified
from sdcore._internal.sql import queries, render
from sdcore._internal.steps import run_async
from sdcore._internal.validation import field_error, int_between, positive_timedelta
from sdcore.job_scheduler._model import (
    _UUID,
    JobSchedulerError,
    JobSchedulerStatus,
    JobSchedulerUnavailableError,
)
from sdcore.job_scheduler._service import JobSchedulerDatabaseError

MAX_LIST_LIMIT = 10_000
MAX_BATCH_SIZE = 100_000
MAX_REASON_LENGTH = 1_000
MAX_AGE = timedelta(days=36_500)
FINISHED = (JobSchedulerStatus.SUCCESS, JobSchedulerStatus.FAIL)
# The earliest instant PostgreSQL's timestamptz holds: the first keyset bound of a prune.
_BEGINNING = datetime(1, 1, 1, tzinfo=UTC)


class InvalidAdminRequestError(FieldError, JobSchedulerError, ValueError):
    """An operator request that failed validation (raised before any SQL).

    Attributes:
        field: The offending argument.
        problem: What is wrong with it.
    """


class JobNotFoundError(JobSchedulerError, LookupError):
    """No row with this id in the table (``.job_id``)."""

    def __init__(self, job_id: str, table: str) -> None:
        self.job_id = job_id
        super().__init__(f"no such job {job_id} in {table}")


class JobNotRunningError(JobSchedulerError):
    """The row exists but is not RUNNING, so there is nothing to release (``.status``)."""

    def __init__(self, job_id: str, status: str) -> None:
        self.job_id = job_id
        self.status = status
        super().__init__(f"job {job_id} is not RUNNING (status {status}); nothing released")


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseRecord:
    """One row of the lease table as an operator sees it (:meth:`LeaseAdmin.list_runs`): never
    the owner token."""

    id: str
    code: str
    name: str | None
    type: str
    run_key: str | None
    status: str
    fencing_token: int
    lock_key: str
    idempotency_key: str
    data: Any
    created_at: datetime
    modified_at: datetime
    age: timedelta
    """How long ago the row was last modified, by the database clock."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleasedRun:
    """What :meth:`LeaseAdmin.release` marked FAIL."""

    id: str
    code: str
    type: str
    run_key: str | None
    fencing_token: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PruneReport:
    """What :meth:`LeaseAdmin.prune` deleted (or, in a dry run, would delete)."""

    cutoff: datetime
    """Rows last modified before this database instant matched."""
    statuses: tuple[str, ...]
    matching: int
    """Rows that matched when the prune started."""
    deleted: int
    kept_initial: int
    """INITIAL rows that matched but were kept (deleting one lets its job run again)."""
    batches: int
    dry_run: bool


@dataclass(frozen=True, slots=True)
class Statement:
    """One statement of an admin operation, and what its answer is: the first row (a tuple,
    or ``None``), or every row as a dict when ``every_row``."""

    query: str | sql.Composed
    params: Mapping[str, Any]
    every_row: bool = False


R = TypeVar("R")
# An admin operation: yields statements, is sent their answers, returns its result.
Plan = Generator[Statement, Any, R]


class LeaseStatements:
    """The operator operations on one lease table as statements, without a connection.

    Each operation is a generator: it validates its arguments before yielding its first
    :class:`Statement`, is sent each statement's answer, and returns the operation's result.
    :class:`LeaseAdmin` runs them on an async connection and ``sdcore.sync.LeaseAdmin`` on a
    blocking one, so the SQL, the validation and the results are defined once.

    Args:
        table: The lease table.
        schema: Its schema; ``None`` means the connection's ``search_path``.

    Raises:
        InvalidIdentifierError: A bad table or schema name.
    """

    def __init__(self, *, table: str = "job_scheduler", schema: str | None = None) -> None:
        self.table = check_identifier("table", table)
        self.schema = None if schema is None else check_identifier("schema", schema)
        self._identifier = qualified(self.table, self.schema)
        self._sql = queries("admin")

    @property
    def shown(self) -> str:
        """The quoted table name, for messages."""
        return self._identifier.as_string(None)

    def errors(self) -> DriverErrors:
        """A context manager that turns driver errors into the job scheduler's error tree."""
        return DriverErrors(self.shown)

    def list_runs(
        self, code: str | None, status: JobSchedulerStatus | str | None, limit: int
    ) -> Plan[list[LeaseRecord]]:
        """:meth:`LeaseAdmin.list_runs`: one statement, every row as a dict."""
        _check_int("limit", limit, 1, MAX_LIST_LIMIT)
        if code is not None and (not isinstance(code, str) or "\x00" in code):
            raise InvalidAdminRequestError("code", "must be a str without NUL")
        shown_status = None if status is None else _status("status", status).value
        conditions = [
            text
            for text, value in (("j.code = %(code)s", code), ("j.status = %(status)s", status))
            if value is not None
        ]
        query = render(
            self._sql["list_runs"], self._identifier, conditions=" AND ".join(conditions) or "TRUE"
        )
        params = {"code": code, "status": shown_status, "limit": limit}
        rows = yield Statement(query, params, every_row=True)
        return [LeaseRecord(**row) for row in rows]

    def release(self, job_id: str, reason: str | None) -> Plan[ReleasedRun]:
        """:meth:`LeaseAdmin.release`: the release, then (if it matched nothing) a status read."""
        if not isinstance(job_id, str) or _UUID.fullmatch(job_id) is None:
            raise InvalidAdminRequestError("job id", "must be a UUID like 0b5f…-…")
        if reason is not None and (
            not isinstance(reason, str) or "\x00" in reason or len(reason) > MAX_REASON_LENGTH
        ):
            raise InvalidAdminRequestError(
                "reason", f"must be a str without NUL, at most {MAX_REASON_LENGTH} characters"
            )
        params = {"id": job_id, "reason": reason}
        released = yield Statement(render(self._sql["release"], self._identifier), params)
        if released is not None:
            code, type_, run_key, fencing = released
            return ReleasedRun(
                id=job_id.lower(), code=code, type=type_, run_key=run_key, fencing_token=fencing
            )
        current = yield Statement(render(self._sql["status_of"], self._identifier), params)
        if current is None:
            raise JobNotFoundError(job_id, self.shown)
        raise JobNotRunningError(job_id, current[0])

    def prune(
        self,
        *,
        older_than: timedelta,
        statuses: Sequence[JobSchedulerStatus | str],
        batch_size: int,
        include_initial: bool,
        dry_run: bool,
        progress: Callable[[int], None] | None,
    ) -> Plan[PruneReport]:
        """:meth:`LeaseAdmin.prune`: the cutoff, the count, then one statement per batch."""
        positive_timedelta("older_than", older_than, at_most=MAX_AGE, error=_refused)
        _check_int("batch_size", batch_size, 1, MAX_BATCH_SIZE)
        if isinstance(statuses, str) or not statuses:
            raise InvalidAdminRequestError("statuses", "must be a non-empty sequence")
        chosen = tuple(dict.fromkeys(_status("statuses", s).value for s in statuses))
        if JobSchedulerStatus.RUNNING.value in chosen:
            raise InvalidAdminRequestError("statuses", "RUNNING rows are never pruned")
        params: dict[str, Any] = {
            "older_than": older_than,
            "include_initial": bool(include_initial),
            "batch": batch_size,
        }
        matching = kept = deleted = batches = 0
        row = yield Statement(self._sql["prune_cutoff"], params)
        assert row is not None  # noqa: S101 - a SELECT of one expression returns a row
        cutoff: datetime = row[0]
        params["cutoff"] = cutoff
        count_sql = render(self._sql["prune_count"], self._identifier)
        batch_sql = render(self._sql["prune_batch"], self._identifier)
        params["statuses"] = list(chosen)
        counts = yield Statement(count_sql, params)
        if counts is not None:
            matching, kept = counts
        params["after"] = _BEGINNING
        while not dry_run:
            done = yield Statement(batch_sql, params)
            count, last = (0, None) if done is None else done
            batches += 1
            deleted += count
            if progress is not None and count:
                progress(deleted)
            if count < batch_size or last is None:
                break
            params["after"] = last
        return PruneReport(
            cutoff=cutoff,
            statuses=chosen,
            matching=matching,
            deleted=deleted,
            kept_initial=kept,
            batches=batches,
            dry_run=bool(dry_run),
        )

    def has_schedule_runs(self, code: str) -> Plan[bool]:
        """:meth:`LeaseAdmin.has_schedule_runs`: one statement."""
        if not isinstance(code, str) or "\x00" in code:
            raise InvalidAdminRequestError("code", "must be a str without NUL")
        row = yield Statement(
            render(self._sql["has_schedule_runs"], self._identifier), {"code": code}
        )
        return bool(row and row[0])


class LeaseAdmin:
    """Operator operations on one lease table, over a connection the caller owns.

    Every method takes an autocommit ``psycopg.AsyncConnection`` (each statement its own short
    transaction), validates its arguments before any SQL, and raises
    :class:`~sdcore.job_scheduler.JobSchedulerDatabaseError` (with ``.sqlstate``) or
    :class:`~sdcore.job_scheduler.JobSchedulerUnavailableError` instead of a driver error.

    Args:
        table: The lease table.
        schema: Its schema; ``None`` means the connection's ``search_path``.
    """

    def __init__(self, *, table: str = "job_scheduler", schema: str | None = None) -> None:
        self.statements = LeaseStatements(table=table, schema=schema)
        self.table = self.statements.table
        self.schema = self.statements.schema

    @property
    def shown(self) -> str:
        """The quoted table name, for messages."""
        return self.statements.shown

    async def list_runs(
        self,
        conn: psycopg.AsyncConnection[Any],
        *,
        code: str | None = None,
        status: JobSchedulerStatus | str | None = None,
        limit: int = 50,
    ) -> list[LeaseRecord]:
        """Return runs newest first.

        Args:
            conn: An autocommit connection.
            code: Only this exact code (equality, never a pattern).
            status: Only this status.
            limit: At most this many rows (1 to 10,000).

        Raises:
            InvalidAdminRequestError: A bad filter or limit.
        """
        return await self._run(conn, self.statements.list_runs(code, status, limit))

    async def release(
        self, conn: psycopg.AsyncConnection[Any], job_id: str, *, reason: str | None = None
    ) -> ReleasedRun:
        """Mark a RUNNING run FAIL so that the next acquire takes it at once.

        The owner's next heartbeat (and its finalize) fails: both require the row to be RUNNING
        with the owner's token. The fencing token grows on the next acquire.

        Args:
            conn: An autocommit connection.
            job_id: The row's id (a UUID string).
            reason: Stored in ``data.reason`` (at most 1,000 characters).

        Raises:
            InvalidAdminRequestError: A malformed id or reason.
            JobNotFoundError: No such row.
            JobNotRunningError: The row is not RUNNING.
        """
        return await self._run(conn, self.statements.release(job_id, reason))

    async def prune(
        self,
        conn: psycopg.AsyncConnection[Any],
        *,
        older_than: timedelta,
        statuses: Sequence[JobSchedulerStatus | str] = FINISHED,
        batch_size: int = 1_000,
        include_initial: bool = False,
        dry_run: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> PruneReport:
        """Delete finished rows last modified before the database's now minus ``older_than``.

        The cutoff is read once from ``clock_timestamp()``. Each batch is its own short
        transaction on the ``created_at`` index (migration ``lease/0004``; a row is never
        modified before it was created) and starts where the previous one ended, so a prune keeps
        its speed on a table of millions of rows, never holds many locks, and an interruption
        keeps what was already deleted. RUNNING rows are never deleted; INITIAL rows only with
        ``include_initial`` (deleting one lets its job run again).

        Args:
            conn: An autocommit connection.
            older_than: Positive age, at most 36,500 days.
            statuses: ``SUCCESS`` and/or ``FAIL``.
            batch_size: Rows per batch (1 to 100,000).
            include_initial: Also delete INITIAL rows.
            dry_run: Count only.
            progress: Called with the running total after each batch.

        Raises:
            InvalidAdminRequestError: A bad age, status or batch size.
        """
        plan = self.statements.prune(
            older_than=older_than,
            statuses=statuses,
            batch_size=batch_size,
            include_initial=include_initial,
            dry_run=dry_run,
            progress=progress,
        )
        return await self._run(conn, plan)

    async def has_schedule_runs(self, conn: psycopg.AsyncConnection[Any], code: str) -> bool:
        """Whether the table holds any run of the schedule ``code`` (``type = 'SCHEDULE'``).

        A non-exclusive schedule writes no lease row, so "no run at all" tells it apart from a
        schedule whose ticks were all missed.

        Raises:
            InvalidAdminRequestError: ``code`` is not a str without NUL.
        """
        return await self._run(conn, self.statements.has_schedule_runs(code))

    async def _run(self, conn: psycopg.AsyncConnection[Any], plan: Plan[R]) -> R:
        """Drive ``plan`` on ``conn``: each statement's answer is sent back into it."""

        async def run(step: Statement) -> Any:
            if step.every_row:
                async with conn.cursor(row_factory=dict_row) as cur:
                    await cur.execute(step.query, step.params)
                    return await cur.fetchall()
            cur = await conn.execute(step.query, step.params)
            return await cur.fetchone()

        with self.statements.errors():
            return await run_async(plan, run)


class DriverErrors:
    """Turn a driver error into the job scheduler's error tree (``raise … from exc``)."""

    def __init__(self, shown: str) -> None:
        self._shown = shown

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if not isinstance(exc, psycopg.Error):
            return
        from sdcore.postgres import redact_text

        detail = redact_text(" ".join(str(exc).split()))
        if isinstance(exc, pg_errors.UndefinedTable | pg_errors.InvalidSchemaName):
            raise JobSchedulerDatabaseError(
                f"table {self._shown} does not exist: {detail}", exc.sqlstate
            ) from exc
        if isinstance(exc, psycopg.OperationalError) and not isinstance(
            exc, pg_errors.InsufficientPrivilege
        ):
            raise JobSchedulerUnavailableError(f"database unavailable: {detail}") from exc
        raise JobSchedulerDatabaseError(f"statement refused: {detail}", exc.sqlstate) from exc


_refused = field_error(InvalidAdminRequestError)


def _check_int(field: str, value: object, low: int, high: int) -> int:
    return int_between(field, value, low, high, error=_refused)


def _status(field: str, value: object) -> JobSchedulerStatus:
    try:
        return JobSchedulerStatus(value.upper() if isinstance(value, str) else str(value))
    except ValueError:
        allowed = ", ".join(s.value for s in JobSchedulerStatus)
        raise InvalidAdminRequestError(field, f"{value!r} is not one of {allowed}") from None


__all__ = [
    "FINISHED",
    "DriverErrors",
    "InvalidAdminRequestError",
    "JobNotFoundError",
    "JobNotRunningError",
    "LeaseAdmin",
    "LeaseRecord",
    "LeaseStatements",
    "Plan",
    "PruneReport",
    "ReleasedRun",
    "Statement",
]
