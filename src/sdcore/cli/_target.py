"""Where a CLI command works (:class:`Target`), its connections, and driver-error translation.

Every message that may contain the connection string or a driver error passes through
``redact_text`` before it is shown; the DSN itself is shown only through ``redact_dsn``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from sdcore.cli._format import one_line
from sdcore.cli._options import DEFAULT_OUTBOX_TABLE, DEFAULT_TABLE, UsageError
from sdcore.job_scheduler import (
    JobSchedulerDatabaseError,
    JobSchedulerUnavailableError,
    LeaseAdmin,
)
from sdcore.postgres import PoolSettings, redact_dsn, redact_text

if TYPE_CHECKING:
    from sdcore.runtime import Runtime

APPLICATION_NAME = "sdcore-cli"
# A command's pool: the job scheduler holds at most half of it, one connection stays free.
RUNTIME_POOL_SIZE = 2
_UNDEFINED_TABLE = pg_errors.UndefinedTable.sqlstate
_INVALID_SCHEMA = pg_errors.InvalidSchemaName.sqlstate
_INSUFFICIENT_PRIVILEGE = pg_errors.InsufficientPrivilege.sqlstate
DEFAULT_CONNECT_TIMEOUT_S = 10


class CliError(Exception):
    """An expected failure: printed as one ``sdcore: error: …`` line, exit status 1."""


class MissedTicksError(CliError):
    """``schedules missed --check`` found missed ticks (exit status 3)."""


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


def target_of(args: argparse.Namespace, environ: Mapping[str, str]) -> Target:
    """The lease table the command line names, with the connection string resolved.

    Raises:
        UsageError: No usable database URL.
    """
    dsn = resolve_dsn(args.database_url, environ)
    return Target(dsn=dsn, table=args.table, schema=args.schema)


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


async def connect_async(target: Target) -> psycopg.AsyncConnection[Any]:
    """Open an autocommit async connection (use it as ``async with await connect_async(t)``).

    Raises:
        CliError: The database cannot be reached.
    """
    try:
        return await psycopg.AsyncConnection.connect(target.dsn, **_connect_kwargs(target.dsn))
    except psycopg.Error as exc:
        raise _cannot_connect(exc, target.dsn) from None


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
        async with await connect_async(target) as conn:
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


@asynccontextmanager
async def started_runtime(
    target: Target,
    *,
    pool_max_size: int = RUNTIME_POOL_SIZE,
    application_name: str = APPLICATION_NAME,
) -> AsyncIterator[Runtime]:
    """A started :class:`~sdcore.runtime.Runtime` on ``target`` for one command, stopped after.

    Only its pool, job scheduler and schedule store are used: no scheduler runs, no migration
    is applied, no Redis is touched. It is the one place a command gets a pool.

    Raises:
        CliError: The database cannot be reached (one redacted line).
    """
    from sdcore.runtime import Runtime, RuntimeStateError

    runtime = Runtime(
        database_url=target.dsn,
        lease_table=target.table,
        schema=target.schema,
        pool=PoolSettings(max_size=pool_max_size, application_name=application_name),
        scheduling=None,
        ensure_schema=False,
        logger_name="sdcore.cli",
    )
    try:
        await runtime.start()
    except RuntimeStateError as exc:
        raise CliError(one_line(str(exc))) from None
    try:
        yield runtime
    finally:
        await runtime.stop()
