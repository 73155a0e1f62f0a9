"""Identifier rules for sdcore's tables and race-safe DDL (the DDL is in ``sql/migrations``)."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from sdcore._internal.identifiers import (
    MAX_IDENTIFIER_BYTES,
    InvalidIdentifierError,
    check_identifier,
    derived_name,
    qualified,
)

if TYPE_CHECKING:
    from psycopg import AsyncConnection
    from psycopg_pool import AsyncConnectionPool

# One advisory lock serializes every sdcore schema change: 16 replicas running
# CREATE TABLE IF NOT EXISTS at once otherwise fail on pg_type's unique index (RESEARCH.md).
SCHEMA_LOCK_ID = int.from_bytes(hashlib.sha256(b"sdcore/schema").digest()[:8], "big", signed=True)

__all__ = [
    "MAX_IDENTIFIER_BYTES",
    "SCHEMA_LOCK_ID",
    "InvalidIdentifierError",
    "apply_schema",
    "check_identifier",
    "derived_name",
    "qualified",
]


async def apply_schema(
    target: AsyncConnection[object] | AsyncConnectionPool[AsyncConnection[object]],
    script: str,
) -> None:
    """Run a DDL script in one transaction under sdcore's schema advisory lock.

    Args:
        target: A connection (must not be inside a transaction) or a pool.
        script: The DDL, e.g. from :func:`schema_sql`.
    """
    from psycopg import AsyncConnection as _Conn

    if isinstance(target, _Conn):
        await _apply(target, script)
        return
    async with target.connection() as conn:
        await _apply(conn, script)


async def _apply(conn: AsyncConnection[object], script: str) -> None:
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_ID,))
        await conn.execute(script.encode("utf-8"))
