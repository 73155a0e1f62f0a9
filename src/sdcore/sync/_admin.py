"""The operator APIs without ``await``: ``OutboxAdmin`` and ``ScheduleAdmin``.

``OutboxAdmin`` works on the caller's blocking connection: each operation is the async admin's
validated request (statement and parameters), executed here. ``ScheduleAdmin`` works over a
store and its pool, which live on an event loop: it calls the async admin on a
:class:`~sdcore.sync._portal.Portal`, so each method is the async one, blocking.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, Self

import psycopg
from psycopg.rows import dict_row

from sdcore.outbox import Outbox, OutboxRow, OutboxStatus
from sdcore.outbox import OutboxAdmin as AsyncOutboxAdmin
from sdcore.outbox._admin import outbox_rows
from sdcore.outbox._store import database_errors
from sdcore.postgres import DEFAULT_TABLES, PoolSettings
from sdcore.runtime import Runtime
from sdcore.scheduling import ControlAction, RunRecord, ScheduleState
from sdcore.scheduling import ScheduleAdmin as AsyncScheduleAdmin
from sdcore.sync._portal import Portal

__all__ = ["OutboxAdmin", "ScheduleAdmin"]

_ADMIN_POOL = PoolSettings(min_size=1, max_size=2, application_name="sdcore-admin")


class OutboxAdmin:
    """Operator operations on one outbox table, over a blocking connection the caller owns.

    The methods of :class:`sdcore.outbox.OutboxAdmin` with a ``psycopg.Connection``
    (autocommit): the same validation before any SQL (:class:`InvalidOutboxRequestError`),
    the same statements, and :class:`~sdcore.outbox.OutboxDatabaseError` instead of a driver
    error.

    Args:
        outbox: The outbox table: an :class:`sdcore.outbox.Outbox`, an ``sdcore.sync.Outbox``
            (its table), or ``None`` for ``Outbox()``.

    Raises:
        TypeError: ``outbox`` is neither.
    """

    def __init__(self, outbox: Any = None) -> None:
        from sdcore.sync._outbox import Outbox as SyncOutbox

        table: Outbox | None = outbox.outbox if isinstance(outbox, SyncOutbox) else outbox
        self.admin = AsyncOutboxAdmin(table)
        """The async admin whose requests this one runs."""

    @property
    def outbox(self) -> Outbox:
        """The outbox table (an :class:`sdcore.outbox.Outbox`)."""
        return self.admin.outbox

    def list_rows(
        self,
        conn: psycopg.Connection[Any],
        *,
        statuses: Iterable[OutboxStatus | str] = (OutboxStatus.PENDING, OutboxStatus.DEAD),
        limit: int = 50,
    ) -> list[OutboxRow]:
        """Return rows of these statuses, newest first.

        Args:
            conn: An autocommit connection.
            statuses: Any of ``PENDING``, ``DEAD``, ``PUBLISHED`` (case-insensitive; at least one).
            limit: At most this many rows (1 to 10,000).

        Raises:
            InvalidOutboxRequestError: An unknown or missing status, or a bad limit.
            OutboxDatabaseError: The statement failed (a missing table: ``sqlstate`` 42P01).
        """
        request = self.admin._list_request(statuses, limit)
        return self._rows(conn, request, "list")

    def check_table(self, conn: psycopg.Connection[Any]) -> None:
        """Check that the table exists and has the outbox's columns (reads no row).

        Raises:
            OutboxDatabaseError: It does not (``sqlstate`` 42P01: missing; 42703: another kind
                of table), or the database failed.
        """
        self._rows(conn, self.admin._check_request(), "table check")

    def retry(self, conn: psycopg.Connection[Any], row_id: int) -> bool:
        """Make a DEAD (or PENDING) row due now with its attempts reset.

        Returns ``False`` when no DEAD or PENDING row has this id (none, or published).

        Raises:
            InvalidOutboxRequestError: ``row_id`` is not a positive 64-bit int.
            OutboxDatabaseError: The statement failed.
        """
        request = self.admin._retry_request(row_id)
        _check_conn(conn)
        with database_errors("retry"):
            return conn.execute(*request).fetchone() is not None

    @staticmethod
    def _rows(
        conn: psycopg.Connection[Any], request: tuple[bytes, tuple[Any, ...]], action: str
    ) -> list[OutboxRow]:
        _check_conn(conn)
        with database_errors(action), conn.cursor(row_factory=dict_row) as cur:
            found = cur.execute(*request).fetchall()
        return outbox_rows(found)


def _check_conn(conn: object) -> None:
    if not isinstance(conn, psycopg.Connection):
        hint = ""
        if isinstance(conn, psycopg.AsyncConnection):
            hint = " (an AsyncConnection: use sdcore.outbox.OutboxAdmin)"
        raise TypeError(f"conn must be a psycopg Connection, got {type(conn).__name__}{hint}")


class ScheduleAdmin:
    """The schedules' operator API for blocking code: pause, resume, trigger, backfill, stored
    schedules, list, history.

    Each method is :class:`sdcore.scheduling.ScheduleAdmin`'s, run on ``portal``: the same
    arguments, results and errors (:class:`~sdcore.scheduling.ScheduleControlError`,
    :class:`~sdcore.scheduling.InvalidScheduleError`,
    :class:`~sdcore.scheduling.ControlWriteUncertainError`, ``psycopg`` errors).

    Args:
        admin: The async admin, whose store lives on ``portal``'s loop.
        portal: The running portal the admin's store (its pool) belongs to.

    Raises:
        TypeError: ``admin`` is no :class:`sdcore.scheduling.ScheduleAdmin`, or ``portal`` no
            ``Portal``.
    """

    def __init__(self, admin: AsyncScheduleAdmin, portal: Portal) -> None:
        if not isinstance(admin, AsyncScheduleAdmin):
            raise TypeError(
                f"admin must be an sdcore.scheduling.ScheduleAdmin, got {type(admin).__name__}"
            )
        if not isinstance(portal, Portal):
            raise TypeError(f"portal must be an sdcore.sync Portal, got {type(portal).__name__}")
        self.admin = admin
        self.portal = portal

    @classmethod
    @contextmanager
    def connect(
        cls,
        dsn: str,
        *,
        schema: str | None = None,
        lease_table: str = DEFAULT_TABLES["lease"],
        pool: PoolSettings = _ADMIN_POOL,
    ) -> Iterator[Self]:
        """Open a pool for ``dsn`` on a portal of its own and an admin over it; close all on exit.

        The pool belongs to an async ``sdcore.Runtime`` that runs nothing (no scheduler, no
        relay, no migration): the one way sdcore builds pools.

        Args:
            dsn: libpq connection string or URL.
            schema: The schema of the schedules and lease tables (``None``: ``search_path``).
            lease_table: The lease table (backfill reopens failed ticks in it).
            pool: The pool's settings (at least 2 connections; default ``max_size=2``,
                ``application_name="sdcore-admin"``).

        Yields:
            The admin.

        Raises:
            RuntimeStateError: The database cannot be reached (the reason, password redacted).
            ValueError: A bad option, before any connection.
            TypeError: ``pool`` is not a ``PoolSettings``.
        """
        runtime = Runtime(
            database_url=dsn,
            schema=schema,
            lease_table=lease_table,
            pool=pool,
            scheduling=None,
            ensure_schema=False,
            logger_name="sdcore.sync.admin",
        )
        portal = Portal(name="sdcore-schedule-admin")
        portal.start()
        try:
            portal.call(runtime.start)
            try:
                yield cls(AsyncScheduleAdmin(runtime.schedule_store), portal)
            finally:
                portal.call(runtime.stop)
        finally:
            portal.stop()

    def pause(self, name: str, *, actor: str, reason: str | None = None) -> ControlAction:
        """Pause a schedule on every replica (see ``sdcore.scheduling.ScheduleAdmin.pause``)."""
        return self.portal.call(self.admin.pause, name, actor=actor, reason=reason)

    def resume(self, name: str, *, actor: str, reason: str | None = None) -> ControlAction:
        """Resume a paused schedule (see ``sdcore.scheduling.ScheduleAdmin.resume``)."""
        return self.portal.call(self.admin.resume, name, actor=actor, reason=reason)

    def trigger(
        self,
        name: str,
        *,
        actor: str,
        reason: str | None = None,
        request_id: str | None = None,
    ) -> ControlAction:
        """Run a schedule once now on one replica (see ``ScheduleAdmin.trigger``)."""
        return self.portal.call(
            self.admin.trigger, name, actor=actor, reason=reason, request_id=request_id
        )

    def backfill(
        self,
        name: str,
        start: datetime,
        end: datetime,
        *,
        actor: str,
        reason: str | None = None,
        concurrency: int = 1,
        request_id: str | None = None,
        rerun_succeeded: bool = False,
    ) -> ControlAction:
        """Run every expected tick in ``[start, end]`` without ``SUCCESS`` (see
        ``ScheduleAdmin.backfill``)."""
        return self.portal.call(
            self.admin.backfill,
            name,
            start,
            end,
            actor=actor,
            reason=reason,
            concurrency=concurrency,
            request_id=request_id,
            rerun_succeeded=rerun_succeeded,
        )

    def create(
        self,
        name: str,
        *,
        handler: str,
        cron: str | None = None,
        every_ms: int | None = None,
        time_zone: str = "UTC",
        args: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
        actor: str,
        reason: str | None = None,
    ) -> ControlAction:
        """Create a stored schedule run by a registered handler (see ``ScheduleAdmin.create``)."""
        return self.portal.call(
            self.admin.create,
            name,
            handler=handler,
            cron=cron,
            every_ms=every_ms,
            time_zone=time_zone,
            args=args,
            options=options,
            actor=actor,
            reason=reason,
        )

    def update(
        self,
        name: str,
        *,
        handler: str | None = None,
        cron: str | None = None,
        every_ms: int | None = None,
        time_zone: str | None = None,
        args: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
        expected_version: int | None = None,
        actor: str,
        reason: str | None = None,
    ) -> ControlAction:
        """Change the given fields of a stored schedule (see ``ScheduleAdmin.update``)."""
        return self.portal.call(
            self.admin.update,
            name,
            handler=handler,
            cron=cron,
            every_ms=every_ms,
            time_zone=time_zone,
            args=args,
            options=options,
            expected_version=expected_version,
            actor=actor,
            reason=reason,
        )

    def remove(self, name: str, *, actor: str, reason: str | None = None) -> ControlAction:
        """Remove a stored schedule (see ``ScheduleAdmin.remove``)."""
        return self.portal.call(self.admin.remove, name, actor=actor, reason=reason)

    def list_schedules(self) -> list[ScheduleState]:
        """Every schedule with its state (see ``ScheduleAdmin.list_schedules``)."""
        return self.portal.call(self.admin.list_schedules)

    def history(self, name: str, *, limit: int = 50) -> list[RunRecord]:
        """Runs of one schedule, newest first (see ``ScheduleAdmin.history``)."""
        return self.portal.call(self.admin.history, name, limit=limit)

    def actions(self, name: str, *, limit: int = 50) -> list[ControlAction]:
        """The control-action log of one schedule, newest first (see ``ScheduleAdmin.actions``)."""
        return self.portal.call(self.admin.actions, name, limit=limit)

    def action(self, action_id: int) -> ControlAction:
        """One action by id (see ``ScheduleAdmin.action``)."""
        return self.portal.call(self.admin.action, action_id)

    def prune(self, older_than: timedelta, *, batch_size: int = 10_000) -> int:
        """Delete history runs and finished actions older than ``older_than`` (see
        ``ScheduleAdmin.prune``)."""
        return self.portal.call(self.admin.prune, older_than, batch_size=batch_size)
