"""``upgrade()``: apply one table's pending migrations and report what changed in the catalog.

What ``sdcore db upgrade`` prints ("created table … with 3 indexes", "created 1 missing index")
comes from the catalog read before and after :func:`~sdcore.postgres.migrate`, both under
sdcore's schema advisory lock held for the session, so the report is true even when several
replicas or operators upgrade at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection

from sdcore._internal.identifiers import qualified
from sdcore._internal.sql import queries
from sdcore.postgres._migrations import DEFAULT_TABLES, Component, Migration, migrate
from sdcore.postgres._schema import SCHEMA_LOCK_ID, check_identifier

__all__ = ["TableInventory", "UpgradeReport", "upgrade"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TableInventory:
    """What the catalog holds of one table."""

    schema_exists: bool
    table_exists: bool
    indexes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class UpgradeReport:
    """The outcome of :func:`upgrade` for one table."""

    component: Component
    table: str
    schema: str | None
    before: TableInventory
    after: TableInventory
    applied: tuple[Migration, ...]


async def upgrade(
    conn: AsyncConnection[Any],
    component: Component,
    *,
    table: str | None = None,
    schema: str | None = None,
) -> UpgradeReport:
    """Apply the pending migrations of one table and read the catalog before and after.

    Args:
        conn: An autocommit connection, not inside a transaction.
        component: ``"lease"``, ``"outbox"`` or ``"schedules"``.
        table: The table; the component's default name when omitted.
        schema: The schema; ``None`` means the connection's ``search_path``.

    Raises:
        InvalidIdentifierError: A bad table or schema name.
        psycopg.Error: The database refused a statement (see :func:`migrate`).
    """
    name = check_identifier("table", table if table is not None else DEFAULT_TABLES[component])
    if schema is not None:
        check_identifier("schema", schema)
    statements = queries("catalog")
    await conn.execute(statements["schema_lock"].encode(), (SCHEMA_LOCK_ID,))
    try:
        before = await _inventory(conn, name, schema)
        applied = await migrate(conn, component, table=name, schema=schema)
        after = await _inventory(conn, name, schema)
    finally:
        await conn.execute(statements["schema_unlock"].encode(), (SCHEMA_LOCK_ID,))
    return UpgradeReport(
        component=component,
        table=name,
        schema=schema,
        before=before,
        after=after,
        applied=tuple(applied),
    )


async def _one(conn: AsyncConnection[Any], statement: str, value: object) -> Any:
    cur = await conn.execute(queries("catalog")[statement].encode(), (value,))
    row = await cur.fetchone()
    return None if row is None else row[0]


async def _inventory(conn: AsyncConnection[Any], table: str, schema: str | None) -> TableInventory:
    schema_exists = schema is None or bool(await _one(conn, "schema_exists", schema))
    oid = None
    if schema_exists:
        oid = await _one(conn, "table_oid", qualified(table, schema).as_string(None))
    indexes = 0 if oid is None else int(await _one(conn, "index_count", oid) or 0)
    return TableInventory(
        schema_exists=schema_exists, table_exists=oid is not None, indexes=indexes
    )
