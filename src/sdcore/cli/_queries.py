"""Catalog reads behind the ``db upgrade`` report (the lease's own SQL is the library's)."""

from __future__ import annotations

from psycopg import sql

# Resolution exactly as a query would do it (search_path included); NULL when missing.
TABLE_OID = "SELECT to_regclass(%s)::oid"
SCHEMA_EXISTS = "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = %s)"
INDEX_COUNT = "SELECT count(*) FROM pg_index WHERE indrelid = %s::oid"
SCHEMA_LOCK = "SELECT pg_advisory_lock(%s)"
SCHEMA_UNLOCK = "SELECT pg_advisory_unlock(%s)"

def render(template: str, table: sql.Identifier, **fragments: str) -> sql.Composed:
    """Fill ``{table}`` and fixed SQL fragments into a statement; values stay parameters."""
    return sql.SQL(template).format(
        table=table, **{name: sql.SQL(text) for name, text in fragments.items()}
    )
