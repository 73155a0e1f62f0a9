"""Versioned migrations for every table sdcore owns.

A migration is a file ``sql/migrations/<component>/<NNNN>_<slug>.sql`` in this package. Its
placeholders are filled for one concrete table (a deployment may have several lease tables):

- ``{table}``: the schema-qualified, quoted table;
- ``{name:SUFFIX}``: the quoted bare name derived from the table for a constraint or an index
  (``{name:pkey}`` → ``"job_scheduler_pkey"``), clipped and hashed past 63 bytes like every
  derived name (:func:`~sdcore.postgres.derived_name`);
- ``{object:SUFFIX}``: the same derived name, schema-qualified, for sequences, functions or
  companion tables.

Any other brace is left alone, so ``'{}'::jsonb`` needs no escaping.

What was applied is recorded in ``sdcore_migrations`` (in the table's schema): one row per
component, table and version. Each pending migration runs in its own transaction under sdcore's
schema advisory lock, after re-reading what is applied, so N replicas or CI jobs upgrading at
once apply each migration exactly once. ``0001_initial`` of each component is the 0.1.0 DDL,
written idempotently: a database created by 0.1.0 (the table, no bookkeeping) takes it as a
no-op and then the later migrations.
"""

from __future__ import annotations

import hashlib
import re
import warnings
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any, Literal

from psycopg import sql

from sdcore._internal.steps import run_async, run_blocking
from sdcore.exceptions import SdcoreError
from sdcore.postgres._schema import (
    SCHEMA_LOCK_ID,
    InvalidIdentifierError,
    check_identifier,
    derived_name,
    qualified,
)

if TYPE_CHECKING:
    from psycopg import AsyncConnection, Connection
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

Component = Literal["lease", "outbox", "schedules"]
COMPONENTS: tuple[Component, ...] = ("lease", "outbox", "schedules")
DEFAULT_TABLES: dict[Component, str] = {
    "lease": "job_scheduler",
    "outbox": "outbox",
    "schedules": "sdcore_schedules",
}
BOOKKEEPING_TABLE = "sdcore_migrations"

_FILE = re.compile(r"(?P<version>[0-9]{4})_(?P<slug>[a-z0-9_]+)\.sql")
_PLACEHOLDER = re.compile(r"\{(?:table|(?:name|object):[a-z0-9_]+)\}")

_BOOKKEEPING_DDL = """\
CREATE TABLE IF NOT EXISTS {bookkeeping} (
    component  text        NOT NULL,
    target     text        NOT NULL,
    version    integer     NOT NULL,
    name       text        NOT NULL,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (component, target, version)
)"""

_APPLIED = "SELECT version, name, checksum, applied_at FROM {bookkeeping} "
_APPLIED_WHERE = "WHERE component = %s AND target = %s ORDER BY version"
_RECORD = "INSERT INTO {bookkeeping} (component, target, version, name, checksum) "
_RECORD_VALUES = "VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING"


class MigrationError(SdcoreError, RuntimeError):
    """The migrations on disk or in the database are not what this sdcore expects."""

    def __init__(self, problem: str) -> None:
        self.problem = problem
        super().__init__(problem)


@dataclass(frozen=True, slots=True, kw_only=True)
class Migration:
    """One migration of one component, not yet bound to a table."""

    component: Component
    version: int
    slug: str
    template: str

    @property
    def name(self) -> str:
        """``0002_owner_lease``: the file name without ``.sql``."""
        return f"{self.version:04d}_{self.slug}"

    @property
    def checksum(self) -> str:
        """SHA-256 of the template, recorded when applied (detects an edited migration)."""
        return hashlib.sha256(self.template.encode("utf-8")).hexdigest()

    def render(self, *, table: str, schema: str | None = None) -> str:
        """Return the SQL of this migration for one table.

        Raises:
            InvalidIdentifierError: A bad table or schema name.
        """
        target = qualified(table, schema)

        def fill(match: re.Match[str]) -> str:
            placeholder = match.group(0)[1:-1]
            if placeholder == "table":
                return target.as_string(None)
            kind, suffix = placeholder.split(":", 1)
            name = derived_name(table, suffix)
            if kind == "object" and schema is not None:
                return sql.Identifier(schema, name).as_string(None)
            return sql.Identifier(name).as_string(None)

        return _PLACEHOLDER.sub(fill, self.template)


@dataclass(frozen=True, slots=True, kw_only=True)
class MigrationScript:
    """One migration as a self-recording script (:func:`migration_scripts`).

    Attributes:
        migration: The migration it applies.
        sql: Its SQL for one table, with the statements that create ``sdcore_migrations`` if
            missing and record the migration there.
    """

    migration: Migration
    sql: str

    def __iter__(self) -> Iterator[Any]:
        """Unpack as the former ``(migration, script)`` pair (deprecated: read the attributes)."""
        warnings.warn(
            "unpacking a MigrationScript is deprecated and goes away in the next release: "
            "read .migration and .sql",
            DeprecationWarning,
            stacklevel=2,
        )
        yield self.migration
        yield self.sql


@dataclass(frozen=True, slots=True, kw_only=True)
class AppliedMigration:
    """A row of ``sdcore_migrations``."""

    component: str
    version: int
    name: str
    checksum: str
    applied_at: datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class MigrationStatus:
    """What is applied and what is pending for one table."""

    component: Component
    table: str
    schema: str | None
    applied: tuple[AppliedMigration, ...]
    pending: tuple[Migration, ...]
    modified: tuple[str, ...]
    """Names of applied migrations whose file changed since (checksum mismatch)."""
    unknown: tuple[str, ...]
    """Names recorded in the database that this sdcore does not ship (a newer sdcore ran)."""

    @property
    def up_to_date(self) -> bool:
        """No pending migration."""
        return not self.pending


@cache
def migrations(component: Component) -> tuple[Migration, ...]:
    """Return the component's migrations in version order (read once from the package).

    Raises:
        ValueError: An unknown component.
        MigrationError: A badly named file or two files with one version.
    """
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}: use one of {', '.join(COMPONENTS)}")
    folder = resources.files("sdcore.postgres").joinpath("sql", "migrations", component)
    found: dict[int, Migration] = {}
    for entry in folder.iterdir():
        if not entry.name.endswith(".sql"):
            continue
        match = _FILE.fullmatch(entry.name)
        if match is None:
            raise MigrationError(f"migration file {component}/{entry.name} is not NNNN_slug.sql")
        version = int(match["version"])
        if version in found:
            raise MigrationError(f"two {component} migrations have version {version:04d}")
        found[version] = Migration(
            component=component,
            version=version,
            slug=match["slug"],
            template=entry.read_text(encoding="utf-8"),
        )
    if 1 not in found:
        raise MigrationError(f"{component} has no 0001 migration")
    return tuple(found[v] for v in sorted(found))


def check_table_name(table: str) -> str:
    """Validate a configurable table name, which must not be the bookkeeping table's."""
    check_identifier("table", table)
    if table == BOOKKEEPING_TABLE:
        raise InvalidIdentifierError("table", f"{BOOKKEEPING_TABLE!r} is reserved for sdcore")
    return table


def schema_sql(*, table: str = "job_scheduler", schema: str | None = None) -> str:
    """Return the current DDL of the job scheduler table (every lease migration, in order).

    Args:
        table: Table name.
        schema: Schema name; ``None`` means the connection's default (``search_path``).

    Raises:
        InvalidIdentifierError: A bad table or schema name.
    """
    return full_sql("lease", table=table, schema=schema)


def outbox_schema_sql(*, table: str = "outbox", schema: str | None = None) -> str:
    """Return the current DDL of the outbox table (arguments as :func:`schema_sql`)."""
    return full_sql("outbox", table=table, schema=schema)


def full_sql(component: Component, *, table: str, schema: str | None = None) -> str:
    """Return the current DDL of one table: every migration, in order, as one script.

    Safe to run more than once only through :func:`migrate`; run by hand on an empty database it
    builds the same table.
    """
    check_table_name(table)
    parts = []
    if schema is not None:
        parts.append(
            sql.SQL("CREATE SCHEMA IF NOT EXISTS {};\n")
            .format(sql.Identifier(check_identifier("schema", schema)))
            .as_string(None)
        )
    parts.extend(m.render(table=table, schema=schema) for m in migrations(component))
    return "".join(parts)


def migration_scripts(
    component: Component, *, table: str, schema: str | None = None
) -> list[MigrationScript]:
    """Return each migration's SQL with the bookkeeping statements, for an external tool.

    Each script creates ``sdcore_migrations`` if missing and records itself, so a database
    migrated by Alembic, Flyway or a DBA is seen as up to date by :func:`migrate`.
    """
    check_table_name(table)
    bookkeeping = _bookkeeping(schema)
    out = []
    for migration in migrations(component):
        record = sql.SQL(_RECORD + "VALUES ({}, {}, {}, {}, {}) ON CONFLICT DO NOTHING").format(
            sql.Literal(component),
            sql.Literal(table),
            sql.Literal(migration.version),
            sql.Literal(migration.name),
            sql.Literal(migration.checksum),
            bookkeeping=bookkeeping,
        )
        script = [
            f"-- sdcore {component} migration {migration.name}\n",
            _schema_prefix(schema),
            sql.SQL(_BOOKKEEPING_DDL).format(bookkeeping=bookkeeping).as_string(None) + ";\n",
            migration.render(table=table, schema=schema),
            record.as_string(None) + ";\n",
        ]
        out.append(MigrationScript(migration=migration, sql="".join(script)))
    return out


def _schema_prefix(schema: str | None) -> str:
    if schema is None:
        return ""
    return (
        sql.SQL("CREATE SCHEMA IF NOT EXISTS {};\n").format(sql.Identifier(schema)).as_string(None)
    )


def _bookkeeping(schema: str | None) -> sql.Identifier:
    if schema is None:
        return sql.Identifier(BOOKKEEPING_TABLE)
    return sql.Identifier(check_identifier("schema", schema), BOOKKEEPING_TABLE)


async def migrate(
    target: AsyncConnection[Any] | AsyncConnectionPool[Any],
    component: Component,
    *,
    table: str | None = None,
    schema: str | None = None,
    through: int | None = None,
) -> list[Migration]:
    """Apply the pending migrations of one table, race-safe, and return what this call applied.

    Args:
        target: A connection that is not inside a transaction, or a pool.
        component: ``"lease"`` or ``"outbox"``.
        table: The table; the component's default name when omitted.
        schema: The schema; ``None`` means the connection's ``search_path``.
        through: Apply only the migrations up to this version (``None``: all of them). A tool
            that runs one step at a time (Django's ``migrate``) passes each step's version.

    Returns:
        The migrations this call applied, in order (empty when already up to date, or when a
        concurrent caller applied them first).

    Raises:
        InvalidIdentifierError: A bad table or schema name.
        ValueError: ``through`` names no migration of the component.
        psycopg.Error: The database refused a statement; the failing migration is rolled back
            and the ones before it stay applied.
    """
    name = check_table_name(table if table is not None else DEFAULT_TABLES[component])
    bookkeeping = _bookkeeping(schema)
    chosen = migrations(component)
    if through is not None:
        if isinstance(through, bool) or not isinstance(through, int):
            raise TypeError(f"through must be an int or None, got {through!r:.40}")
        if through not in {m.version for m in chosen}:
            raise ValueError(f"{component} has no migration {through:04d}")
        chosen = tuple(m for m in chosen if m.version <= through)
    from psycopg import AsyncConnection as _Conn

    if isinstance(target, _Conn):
        return await _migrate(target, chosen, name, schema, bookkeeping)
    async with target.connection() as conn:
        return await _migrate(conn, chosen, name, schema, bookkeeping)


async def _migrate(
    conn: AsyncConnection[Any],
    chosen: tuple[Migration, ...],
    table: str,
    schema: str | None,
    bookkeeping: sql.Identifier,
) -> list[Migration]:
    async def run(step: _Statement) -> list[Any]:
        cur = await conn.execute(*step)
        return await cur.fetchall() if cur.description is not None else []

    applied_now: list[Migration] = []
    for migration in chosen:
        component = migration.component
        async with conn.transaction():
            if await run_async(_apply_one(migration, component, table, schema, bookkeeping), run):
                applied_now.append(migration)
    return applied_now


def migrate_blocking(
    target: Connection[Any] | ConnectionPool[Any],
    component: Component,
    *,
    table: str | None = None,
    schema: str | None = None,
) -> list[Migration]:
    """:func:`migrate` on a blocking psycopg connection or pool (for ``sdcore.sync``).

    The same statements in the same transactions: each migration is the sequence of
    :func:`_apply_one`, run here with blocking calls.
    """
    name = check_table_name(table if table is not None else DEFAULT_TABLES[component])
    bookkeeping = _bookkeeping(schema)
    from psycopg import Connection as _Conn

    if isinstance(target, _Conn):
        return _migrate_blocking(target, component, name, schema, bookkeeping)
    with target.connection() as conn:
        return _migrate_blocking(conn, component, name, schema, bookkeeping)


def _migrate_blocking(
    conn: Connection[Any],
    component: Component,
    table: str,
    schema: str | None,
    bookkeeping: sql.Identifier,
) -> list[Migration]:
    def run(step: _Statement) -> list[Any]:
        cur = conn.execute(*step)
        return cur.fetchall() if cur.description is not None else []

    applied_now: list[Migration] = []
    for migration in migrations(component):
        with conn.transaction():
            if run_blocking(_apply_one(migration, component, table, schema, bookkeeping), run):
                applied_now.append(migration)
    return applied_now


# One statement of a migration's transaction, with its parameters (or None).
_Statement = tuple[Any, Any]


def _apply_one(
    migration: Migration,
    component: Component,
    table: str,
    schema: str | None,
    bookkeeping: sql.Identifier,
) -> Generator[_Statement, list[Any], bool]:
    """The statements of one migration's transaction; sent each one's rows, returns whether it
    applied the migration (``False``: already recorded, by an earlier call or a replica)."""
    yield "SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_ID,)
    # Re-read under the lock: a replica may have applied it since this call started.
    if schema is not None:
        yield sql.SQL(_schema_prefix(schema)), None
    yield sql.SQL(_BOOKKEEPING_DDL).format(bookkeeping=bookkeeping), None
    done = yield (
        sql.SQL("SELECT version FROM {} WHERE component = %s AND target = %s").format(bookkeeping),
        (component, table),
    )
    if migration.version in {int(row[0]) for row in done}:
        return False
    yield migration.render(table=table, schema=schema).encode("utf-8"), None
    yield (
        sql.SQL(_RECORD + _RECORD_VALUES).format(bookkeeping=bookkeeping),
        (component, table, migration.version, migration.name, migration.checksum),
    )
    return True


async def migration_status(
    conn: AsyncConnection[Any],
    component: Component,
    *,
    table: str | None = None,
    schema: str | None = None,
) -> MigrationStatus:
    """Return what is applied and pending for one table, without changing anything.

    Args:
        conn: A connection (autocommit or not; nothing is written).
        component: ``"lease"`` or ``"outbox"``.
        table: The table; the component's default name when omitted.
        schema: The schema; ``None`` means the connection's ``search_path``.
    """
    name = check_table_name(table if table is not None else DEFAULT_TABLES[component])
    bookkeeping = _bookkeeping(schema)
    where = bookkeeping.as_string(None)
    cur = await conn.execute("SELECT to_regclass(%s) IS NOT NULL", (where,))
    row = await cur.fetchone()
    rows: list[Any] = []
    if row is not None and row[0]:
        cur = await conn.execute(
            sql.SQL(_APPLIED + _APPLIED_WHERE).format(bookkeeping=bookkeeping), (component, name)
        )
        rows = list(await cur.fetchall())
    shipped = {m.version: m for m in migrations(component)}
    applied = tuple(
        AppliedMigration(
            component=component, version=int(r[0]), name=r[1], checksum=r[2], applied_at=r[3]
        )
        for r in rows
    )
    done = {a.version for a in applied}
    modified = tuple(
        a.name
        for a in applied
        if a.version in shipped and shipped[a.version].checksum != a.checksum
    )
    unknown = tuple(a.name for a in applied if a.version not in shipped)
    return MigrationStatus(
        component=component,
        table=name,
        schema=schema,
        applied=applied,
        pending=tuple(m for v, m in shipped.items() if v not in done),
        modified=modified,
        unknown=unknown,
    )
