"""``OutboxAdmin``: the operator's operations on an outbox table (list, retry, check).

``sdcore outbox list|retry``, the relay command's start-up check and the dashboard's outbox page
call these and hold no SQL of their own. The statements are ``list_rows`` and ``retry`` in
``sdcore/postgres/sql/outbox.sql``, rendered by :class:`~sdcore.outbox.Outbox`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from sdcore._internal.validation import field_error, int_between
from sdcore.outbox._model import InvalidOutboxRequestError, OutboxStatus
from sdcore.outbox._outbox import Outbox
from sdcore.outbox._store import database_errors

MAX_LIST_LIMIT = 10_000
_MAX_ID = 2**63 - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboxRow:
    """One outbox row as an operator sees it (never the payload or the claim token)."""

    id: int
    status: OutboxStatus
    queue: str
    name: str
    attempts: int
    max_attempts: int
    next_attempt_at: datetime
    idempotency_key: str
    job_id: str
    last_error: str | None
    created_at: datetime
    published_at: datetime | None
    claimed_until: datetime | None
    """Set while a relay holds the row (its claim expires then)."""


class OutboxAdmin:
    """Operator operations on one outbox table, over a connection the caller owns.

    Every method takes an autocommit ``psycopg.AsyncConnection``, validates its arguments
    before any SQL (:class:`InvalidOutboxRequestError`) and raises
    :class:`~sdcore.outbox.OutboxDatabaseError` (with ``.sqlstate``; the driver's error is its
    ``__cause__``) instead of a driver error.

    Args:
        outbox: The outbox table (default ``Outbox()``).
    """

    def __init__(self, outbox: Outbox | None = None) -> None:
        if outbox is not None and not isinstance(outbox, Outbox):
            raise TypeError(f"outbox must be an Outbox, got {type(outbox).__name__}")
        self.outbox = outbox or Outbox()

    async def list_rows(
        self,
        conn: psycopg.AsyncConnection[Any],
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
        return await self._rows(conn, self._list_request(statuses, limit), "list")

    async def check_table(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Check that the table exists and has the outbox's columns (reads no row).

        Raises:
            OutboxDatabaseError: It does not (``sqlstate`` 42P01: missing; 42703: another kind
                of table), or the database failed.
        """
        await self._rows(conn, self._check_request(), "table check")

    async def retry(self, conn: psycopg.AsyncConnection[Any], row_id: int) -> bool:
        """Make a DEAD (or PENDING) row due now with its attempts reset.

        Returns ``False`` when no DEAD or PENDING row has this id (none, or published).

        Raises:
            InvalidOutboxRequestError: ``row_id`` is not a positive 64-bit int.
            OutboxDatabaseError: The statement failed.
        """
        request = self._retry_request(row_id)
        with database_errors("retry"):
            cur = await conn.execute(*request)
            return await cur.fetchone() is not None

    async def _rows(
        self, conn: psycopg.AsyncConnection[Any], request: Request, action: str
    ) -> list[OutboxRow]:
        with database_errors(action):
            async with conn.cursor(row_factory=dict_row) as cur:
                await cur.execute(*request)
                found = await cur.fetchall()
        return outbox_rows(found)

    # The statement of each operation, validated, apart from its execution: the blocking admin
    # (sdcore.sync.OutboxAdmin) runs the same requests on a blocking connection.

    def _list_request(self, statuses: Iterable[OutboxStatus | str], limit: int) -> Request:
        int_between("limit", limit, 1, MAX_LIST_LIMIT, error=field_error(InvalidOutboxRequestError))
        return self.outbox.sql.list_rows, (_statuses(statuses), limit)

    def _check_request(self) -> Request:
        return self.outbox.sql.list_rows, ([], 0)

    def _retry_request(self, row_id: int) -> Request:
        int_between("row id", row_id, 1, _MAX_ID, error=field_error(InvalidOutboxRequestError))
        return self.outbox.sql.retry, (row_id,)


# One validated operation: its statement and parameters.
Request = tuple[bytes, tuple[Any, ...]]


def outbox_rows(found: Iterable[dict[str, Any]]) -> list[OutboxRow]:
    """The rows of ``list_rows`` (read with ``dict_row``) as :class:`OutboxRow` values."""
    return [OutboxRow(**{**row, "status": OutboxStatus(row["status"])}) for row in found]


def _statuses(statuses: Iterable[OutboxStatus | str]) -> list[str]:
    if isinstance(statuses, str | bytes):
        raise InvalidOutboxRequestError("statuses", "must be a list of statuses, not one str")
    try:
        given = list(statuses)
    except TypeError:
        raise InvalidOutboxRequestError("statuses", "must be a list of statuses") from None
    wanted: list[str] = []
    for status in given:
        if not isinstance(status, str) or status.upper() not in OutboxStatus.__members__:
            known = ", ".join(OutboxStatus.__members__)
            raise InvalidOutboxRequestError("status", f"{status!r:.40} is not one of {known}")
        if status.upper() not in wanted:
            wanted.append(status.upper())
    if not wanted:
        raise InvalidOutboxRequestError("statuses", "give at least one status")
    return wanted
