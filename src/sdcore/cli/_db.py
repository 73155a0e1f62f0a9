"""Connections, driver-error translation and the ``sdcore db`` commands.

Every message that may contain the connection string or a driver error passes through
``redact_text`` before it is shown; the DSN itself is shown only through ``redact_dsn``.
"""

from __future__ import annotations

import asyncio
import os
import shlex
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from sdcore.cli import _queries as q
from sdcore.cli._format import json_line, one_line, render_table, utc_iso
from sdcore.cli._parser import DEFAULT_OUTBOX_TABLE, DEFAULT_TABLE, UsageError
from sdcore.job_scheduler import (
    JobSchedulerDatabaseError,
    JobSchedulerUnavailableError,
    LeaseAdmin,
)
from sdcore.postgres import (
    DEFAULT_TABLES,
    SCHEMA_LOCK_ID,
    Component,
    MigrationStatus,
    full_sql,
    migrate,
    migration_scripts,
    migration_status,
    redact_dsn,
    redact_text,
)

APPLICATION_NAME = "sdcore-cli"
_UNDEFINED_TABLE = pg_errors.UndefinedTable.sqlstate
_INVALID_SCHEMA = pg_errors.InvalidSchemaName.sqlstate
_INSUFFICIENT_PRIVILEGE = pg_errors.InsufficientPrivilege.sqlstate
DEFAULT_CONNECT_TIMEOUT_S = 10


class CliError(Exception):
    """An expected failure: printed as one ``sdcore: error: …`` line, exit status 1."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """Where a table lives: the connection string and the validated names.

    Attributes:
        dsn: The connection string.
        table: The table (the lease table, or the outbox table when ``outbox``).
        schema: Its schema, or ``None`` for the ``search_path``.
        outbox: Whether ``table`` is a transactional outbox table (changes the fix hints).
    """

    dsn: str
    table: str
    schema: str | None
    outbox: bool = False

    @property
    def identifier(self) -> sql.Identifier:
        """The quoted ``schema.table`` (or ``table``)."""
        if self.schema is None:
            return sql.Identifier(self.table)
        return sql.Identifier(self.schema, self.table)

    @property
    def shown(self) -> str:
        """The quoted name, for messages."""
        return self.identifier.as_string(None)

    def upgrade_command(self) -> str:
        """The ``sdcore db upgrade`` invocation that creates this table."""
        words = ["sdcore"]
        if not self.outbox and self.table != DEFAULT_TABLE:
            words += ["--table", self.table]
        if self.schema is not None:
            words += ["--schema", self.schema]
        words += ["db", "upgrade"]
        if self.outbox:
            words.append("--outbox")
            if self.table != DEFAULT_OUTBOX_TABLE:
                words += ["--outbox-table", self.table]
        return shlex.join(words)


def resolve_dsn(option: str | None, environ: Mapping[str, str]) -> str:
    """Return ``--database-url``, else ``$DATABASE_URL``, checked to be a parsable conninfo.

    Raises:
        UsageError: Neither is set (or both are empty), or the string cannot be parsed. The
            message never repeats the string: a parse error may quote a piece of a password.
    """
    dsn = option if option else environ.get("DATABASE_URL", "")
    if not dsn:
        raise UsageError(
            "no database: pass --database-url URL or set DATABASE_URL "
            "(use --database-url postgresql:// to rely on the PG* variables alone)"
        )
    source = "--database-url" if option else "DATABASE_URL"
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.Error:
        raise UsageError(
            f"{source} is not a valid libpq connection string (URL or key=value)"
        ) from None
    # libpq splits "postgresql://u:p@ss@host" at the first "@": the password's tail would be
    # shown as part of the host name in every connection error.
    if "@" in str(params.get("host", "")):
        raise UsageError(
            f"{source} has an '@' in its host name: percent-encode an '@' in the password as %40"
        )
    return dsn


def _connect_kwargs(dsn: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"application_name": APPLICATION_NAME, "autocommit": True}
    # An unreachable host must fail in seconds, unless the user chose a timeout.
    if "connect_timeout" not in conninfo_to_dict(dsn) and "PGCONNECT_TIMEOUT" not in os.environ:
        kwargs["connect_timeout"] = DEFAULT_CONNECT_TIMEOUT_S
    return kwargs


def describe_error(exc: psycopg.Error, target: Target) -> CliError:
    """Turn a driver error into one redacted, actionable message."""
    if isinstance(exc, pg_errors.UndefinedTable | pg_errors.InvalidSchemaName):
        return CliError(f"table {target.shown} does not exist; run `{target.upgrade_command()}`")
    detail = one_line(redact_text(str(exc), target.dsn))
    if isinstance(exc, pg_errors.UndefinedColumn):
        kind = "an sdcore outbox table" if target.outbox else "an sdcore lease table"
        return CliError(
            f"table {target.shown} is not {kind} ({detail}); check --schema"
            f"{' and --outbox-table' if target.outbox else ' and --table'}"
        )
    if isinstance(exc, pg_errors.InsufficientPrivilege):
        return CliError(f"permission denied: {detail}")
    state = f" ({exc.sqlstate})" if exc.sqlstate else ""
    return CliError(f"database error{state}: {detail}")


def _cannot_connect(exc: Exception, dsn: str) -> CliError:
    detail = one_line(redact_text(str(exc), dsn))
    return CliError(f"cannot connect to {one_line(redact_dsn(dsn))}: {detail}")


@contextmanager
def connection(target: Target) -> Iterator[psycopg.Connection[tuple[Any, ...]]]:
    """Open an autocommit connection: every statement is its own short transaction.

    Raises:
        CliError: The database cannot be reached, or a statement failed.
    """
    try:
        conn = psycopg.connect(target.dsn, **_connect_kwargs(target.dsn))
    except psycopg.Error as exc:
        raise _cannot_connect(exc, target.dsn) from None
    try:
        with conn:
            yield conn
    except psycopg.Error as exc:
        raise describe_error(exc, target) from None


def _tables(
    target: Target, outbox_table: str | None, schedules: bool = False
) -> list[tuple[Component, Target]]:
    tables: list[tuple[Component, Target]] = [("lease", target)]
    if outbox_table is not None:
        outbox = Target(dsn=target.dsn, table=outbox_table, schema=target.schema, outbox=True)
        tables.append(("outbox", outbox))
    if schedules:  # the control plane: pause, trigger, backfill, stored schedules, history
        control = Target(dsn=target.dsn, table=DEFAULT_TABLES["schedules"], schema=target.schema)
        tables.append(("schedules", control))
    return tables


AsyncConn = psycopg.AsyncConnection[Any]
T = TypeVar("T")


def run_admin(target: Target, operation: Callable[[LeaseAdmin, AsyncConn], Awaitable[T]]) -> T:
    """Run one :class:`LeaseAdmin` operation on a fresh autocommit connection.

    Raises:
        CliError: The database cannot be reached, the table is missing, or a statement failed
            (one redacted line, with the fix when there is one).
    """

    async def run() -> T:
        admin = LeaseAdmin(table=target.table, schema=target.schema)
        try:
            conn = await psycopg.AsyncConnection.connect(target.dsn, **_connect_kwargs(target.dsn))
        except psycopg.Error as exc:
            raise _cannot_connect(exc, target.dsn) from None
        async with conn:
            return await operation(admin, conn)

    try:
        return asyncio.run(run())
    except JobSchedulerDatabaseError as exc:
        if exc.sqlstate in (_UNDEFINED_TABLE, _INVALID_SCHEMA):
            raise CliError(
                f"table {target.shown} does not exist; run `{target.upgrade_command()}`"
            ) from None
        detail = one_line(redact_text(str(exc), target.dsn))
        if exc.sqlstate == _INSUFFICIENT_PRIVILEGE:
            raise CliError(f"permission denied: {detail}") from None
        raise CliError(f"database error ({exc.sqlstate}): {detail}") from None
    except JobSchedulerUnavailableError as exc:
        raise CliError(one_line(redact_text(str(exc), target.dsn))) from None


def db_sql(
    target: Target,
    outbox_table: str | None = None,
    *,
    per_migration: bool = False,
    schedules: bool = False,
) -> list[str]:
    """Return the DDL lines of the table(s) (what ``db upgrade`` applies to an empty database).

    With ``per_migration``, each migration's own script instead, each recording itself in
    ``sdcore_migrations`` so that ``db upgrade`` sees a database migrated by another tool as
    up to date.
    """
    lines: list[str] = []
    for component, table in _tables(target, outbox_table, schedules):
        if lines:
            lines.append("")
        if per_migration:
            for _, script in migration_scripts(component, table=table.table, schema=table.schema):
                lines += [*script.rstrip("\n").splitlines(), ""]
            lines.pop()
            continue
        lines += (
            full_sql(component, table=table.table, schema=table.schema).rstrip("\n").splitlines()
        )
    return lines


def db_upgrade(
    target: Target, outbox_table: str | None = None, *, schedules: bool = False
) -> list[str]:
    """Apply the pending migrations under sdcore's schema advisory lock and report them.

    Raises:
        CliError: The database cannot be reached or refused a migration.
    """
    lines: list[str] = []
    try:
        for component, table in _tables(target, outbox_table, schedules):
            lines += asyncio.run(_upgrade(table, component))
        return lines
    except psycopg.Error as exc:
        raise describe_error(exc, target) from None


def db_status(
    target: Target, outbox_table: str | None = None, *, schedules: bool = False
) -> list[MigrationStatus]:
    """Return the applied and pending migrations of the table(s); changes nothing.

    Raises:
        CliError: The database cannot be reached.
    """
    try:
        return [
            asyncio.run(_status(table, component))
            for component, table in _tables(target, outbox_table, schedules)
        ]
    except psycopg.Error as exc:
        raise describe_error(exc, target) from None


async def _status(target: Target, component: Component) -> MigrationStatus:
    try:
        conn = await psycopg.AsyncConnection.connect(target.dsn, **_connect_kwargs(target.dsn))
    except psycopg.Error as exc:
        raise _cannot_connect(exc, target.dsn) from None
    async with conn:
        return await migration_status(conn, component, table=target.table, schema=target.schema)


async def _upgrade(target: Target, component: Component) -> list[str]:
    try:
        conn = await psycopg.AsyncConnection.connect(target.dsn, **_connect_kwargs(target.dsn))
    except psycopg.Error as exc:
        raise _cannot_connect(exc, target.dsn) from None
    async with conn:
        # The session lock is the one migrate() takes per transaction (re-entrant for this
        # session): holding it across the before/after reads makes the report true even when
        # several replicas or operators upgrade at once.
        await conn.execute(q.SCHEMA_LOCK, (SCHEMA_LOCK_ID,))
        try:
            before = await _inventory(conn, target)
            applied = await migrate(conn, component, table=target.table, schema=target.schema)
            after = await _inventory(conn, target)
        finally:
            await conn.execute(q.SCHEMA_UNLOCK, (SCHEMA_LOCK_ID,))
    lines = _report(target, before, after, bool(applied))
    lines += [f"applied {component} migration {m.name} to {target.shown}" for m in applied]
    return lines


@dataclass(frozen=True, slots=True)
class _Inventory:
    schema_exists: bool
    table_exists: bool
    indexes: int


async def _inventory(conn: psycopg.AsyncConnection[Any], target: Target) -> _Inventory:
    schema_exists = True
    if target.schema is not None:
        cur = await conn.execute(q.SCHEMA_EXISTS, (target.schema,))
        row = await cur.fetchone()
        schema_exists = bool(row and row[0])
    oid = None
    if schema_exists:
        cur = await conn.execute(q.TABLE_OID, (target.shown,))
        row = await cur.fetchone()
        oid = row[0] if row else None
    indexes = 0
    if oid is not None:
        cur = await conn.execute(q.INDEX_COUNT, (oid,))
        row = await cur.fetchone()
        indexes = int(row[0]) if row else 0
    return _Inventory(schema_exists, oid is not None, indexes)


def _report(target: Target, before: _Inventory, after: _Inventory, migrated: bool) -> list[str]:
    lines: list[str] = []
    if target.schema is not None and not before.schema_exists:
        lines.append(f"created schema {sql.Identifier(target.schema).as_string(None)}")
    if not before.table_exists:
        lines.append(f"created table {target.shown} with {after.indexes} indexes")
    else:
        added = after.indexes - before.indexes
        if added > 0:
            noun = "index" if added == 1 else "indexes"
            lines.append(f"table {target.shown} exists; created {added} missing {noun}")
    if not lines and not migrated:
        lines.append(f"table {target.shown} is up to date; nothing to do")
    return lines


def format_migration_status(statuses: list[MigrationStatus], *, as_json: bool) -> list[str]:
    """Render ``db status``: one block per table, or one JSON object per table with ``--json``."""
    lines: list[str] = []
    for status in statuses:
        shown = Target(dsn="", table=status.table, schema=status.schema).shown
        if as_json:
            lines.append(
                json_line(
                    {
                        "component": status.component,
                        "table": status.table,
                        "schema": status.schema,
                        "up_to_date": status.up_to_date,
                        "applied": [
                            {"name": a.name, "applied_at": utc_iso(a.applied_at, precise=True)}
                            for a in status.applied
                        ],
                        "pending": [m.name for m in status.pending],
                        "modified": list(status.modified),
                        "unknown": list(status.unknown),
                    }
                )
            )
            continue
        rows = [[a.name, "applied", utc_iso(a.applied_at)] for a in status.applied]
        rows += [[m.name, "pending", ""] for m in status.pending]
        state = "up to date" if status.up_to_date else f"{len(status.pending)} pending"
        lines.append(f"{status.component} table {shown}: {state}")
        lines += ["  " + line for line in render_table(["migration", "state", "applied"], rows, {})]
        lines += [f"  warning: {name} changed since it was applied" for name in status.modified]
        lines += [f"  note: {name} was applied by a newer sdcore" for name in status.unknown]
    return lines
