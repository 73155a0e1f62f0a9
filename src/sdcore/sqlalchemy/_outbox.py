"""``enqueue_once`` through a SQLAlchemy session: the outbox's adapter for SQLAlchemy 2 (async).

The outbox knows psycopg only; this module drives it through :meth:`Outbox.enqueue_via`. Every
statement goes through the session (``session.execute``), never through a raw driver connection
taken before the session's first statement: that one is not yet inside the session's
transaction. psycopg's ``%(name)s`` placeholders become ``text()`` binds (``:name``), which the
psycopg dialect compiles back to the same text, so both paths send the server the same
statements.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from sdcore.outbox import Outbox, OutboxTransactionRequiredError

__all__ = ["enqueue_once"]

_PYFORMAT = re.compile(r"%\((\w+)\)s")


@functools.lru_cache(maxsize=64)
def _clause(statement: str) -> TextClause:
    """psycopg's ``%(name)s`` as ``text()``'s ``:name`` (nothing else changes)."""
    return text(_PYFORMAT.sub(r":\1", statement))


class _SessionDriver:
    """An :class:`~sdcore.outbox._outbox.OutboxDriver` over a SQLAlchemy session or connection."""

    def __init__(self, session: AsyncSession | AsyncConnection, *, allow_autocommit: bool) -> None:
        self._session = session
        self._allow_autocommit = allow_autocommit

    async def begin(self) -> Hashable:
        session = self._session
        # session.connection() joins (or autobegins) the session's transaction.
        bound = await session.connection() if isinstance(session, AsyncSession) else session
        if not self._allow_autocommit:
            # Only the driver knows whether that transaction is real or AUTOCOMMIT.
            raw = await bound.get_raw_connection()
            if getattr(raw.dbapi_connection, "autocommit", False):
                raise OutboxTransactionRequiredError(f"SQLAlchemy {type(session).__name__}")
        url = bound.engine.url
        return (url.host, url.port, url.database)

    async def first(self, statement: str, params: Mapping[str, Any]) -> Sequence[Any] | None:
        row = (await self._session.execute(_clause(statement), dict(params))).first()
        return None if row is None else tuple(row)


async def enqueue_once(
    outbox: Outbox,
    session: AsyncSession | AsyncConnection,
    *,
    idempotency_key: str,
    queue: str,
    name: str,
    payload: Mapping[str, Any],
    options: Mapping[str, Any] | None = None,
    allow_autocommit: bool = False,
) -> bool:
    """Write one outbox message in a SQLAlchemy session's transaction (see ``Outbox.enqueue_once``).

    The message is validated before any SQL; the statement joins the session's transaction
    (autobegun if none is open), so a rollback publishes nothing and a commit makes the row
    visible to relays. The same message under the same key again is a no-op.

    Args:
        outbox: The outbox (its table, namespace and notify settings).
        session: A SQLAlchemy ``AsyncSession`` or ``AsyncConnection`` on the psycopg driver.
        idempotency_key: Unique per message, e.g. a run's ``lease.idempotency_key``.
        queue: BullMQ queue name (``[A-Za-z0-9_.-]``, 1–100).
        name: BullMQ job name.
        payload: The job's data, a JSON object.
        options: BullMQ job options (see :func:`sdcore.outbox.check_options`).
        allow_autocommit: Accept a session whose driver connection is in autocommit mode (the
            message then commits at once, on its own).

    Returns:
        ``True`` if the row was inserted, ``False`` if this key already holds the same message.

    Raises:
        InvalidOutboxMessageError: A bad key, queue, name or option.
        JsonTypeError: ``payload`` is not JSON.
        JsonValueError: ``payload`` cannot be stored in jsonb.
        OutboxKeyConflictError: The key holds a different message (nothing was written).
        OutboxTransactionRequiredError: The driver connection is in autocommit mode (and
            ``allow_autocommit`` is false); nothing was written.
        TypeError: ``outbox`` is no ``Outbox``, or ``session`` no SQLAlchemy ``AsyncSession`` /
            ``AsyncConnection``.
    """
    if not isinstance(outbox, Outbox):
        raise TypeError(f"outbox must be an sdcore.outbox.Outbox, got {type(outbox).__name__}")
    if not isinstance(session, AsyncSession | AsyncConnection):
        raise TypeError(
            "session must be a SQLAlchemy AsyncSession or AsyncConnection, got"
            f" {type(session).__name__} (a psycopg connection: await outbox.enqueue_once(conn, …))"
        )
    return await outbox.enqueue_via(
        _SessionDriver(session, allow_autocommit=allow_autocommit),
        idempotency_key=idempotency_key,
        queue=queue,
        name=name,
        payload=payload,
        options=options,
    )
