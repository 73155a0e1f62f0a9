"""Statements that keep their promises behind a transaction-mode pooler (PgBouncer).

Behind ``pool_mode=transaction`` a client's session is not its own: each transaction may run on
another server connection, which another client may have ``SET synchronous_commit = off`` or a
``statement_timeout`` on, and whatever sdcore ``SET`` would reach them in turn. So, in that mode,
each statement sdcore runs outside a transaction is sent as one simple-protocol message::

    SET TRANSACTION ISOLATION LEVEL READ COMMITTED, READ WRITE;
    SELECT set_config('synchronous_commit', 'on', true), set_config('statement_timeout', …, true),
           set_config('lock_timeout', '0', true), set_config('search_path', …, true);
    <the statement>

A multi-statement message is one implicit transaction: the pooler keeps it on one server connection,
the ``LOCAL`` settings hold for exactly that transaction (and are gone when it commits), the commit
waits as ``synchronous_commit = on`` says, and PostgreSQL restarts the statement timer for each
statement of the message, so the statement gets sdcore's timeout. One round trip, no prepared
statement, nothing left behind, and cheaper than a pipeline of separate statements, which adds a
Parse/Bind/Execute per statement (``docs/benchmarks.md#pgbouncer-transaction-pooling``). Parameters
are bound on the client (psycopg's ``ClientCursor``). Inside an explicit transaction (the
migrations) the ``set_config`` part is sent ahead of each statement instead.

Both cursors also name the likely cause of the protocol errors a transaction-mode pooler produces
when a client uses server-side prepared statements.
"""

from __future__ import annotations

from typing import Any, Self

import psycopg
from psycopg import AsyncClientCursor, AsyncCursor, pq, sql
from psycopg.abc import Params

# 08P01 "bind message supplies 8 parameters, but prepared statement requires 4";
# 26000 "prepared statement "_pg3_0" does not exist"; 42P05 "… already exists".
POOLER_SQLSTATES = frozenset({"08P01", "26000", "42P05"})
_IDLE = pq.TransactionStatus.IDLE
# What sdcore passes; psycopg 3.3 also accepts t-string templates, which sdcore never sends.
_Query = str | bytes | sql.SQL | sql.Composed


def pooler_error(exc: psycopg.Error, *, transaction_pooling: bool) -> psycopg.Error | None:
    """Return ``exc`` re-worded with its likely cause, or ``None`` if it is not a pooler symptom.

    The result has the same class (and so the same SQLSTATE) as ``exc``.
    """
    if exc.sqlstate not in POOLER_SQLSTATES:
        return None
    if transaction_pooling:
        hint = (
            "sdcore sends no prepared statement in transaction_pooling mode: does another client "
            "of the same pooler use server-side prepared statements?"
        )
    else:
        hint = (
            "this is what a transaction-mode pooler (PgBouncer pool_mode=transaction, RDS "
            "Proxy, …) does to server-side prepared statements: use "
            "PoolSettings(transaction_pooling=True) (sdcore CLI: --transaction-pooling or "
            "SDCORE_TRANSACTION_POOLING=1)"
        )
    return type(exc)(f"{str(exc).strip()} — {hint}")


def _as_bytes(query: _Query, conn: psycopg.AsyncConnection[Any]) -> bytes:
    if isinstance(query, bytes):
        return query
    if isinstance(query, str):
        return query.encode(conn.info.encoding)
    if isinstance(query, sql.Composable):
        return query.as_bytes(conn)
    raise TypeError(f"unsupported query type {type(query).__name__}")


class GuardedCursor(AsyncCursor[Any]):
    """The ordinary cursor, whose pooler-shaped errors name their likely cause."""

    async def execute(  # type: ignore[override]  # no t-string templates
        self,
        query: _Query,
        params: Params | None = None,
        *,
        prepare: bool | None = None,
        binary: bool | None = None,
    ) -> Self:
        try:
            return await super().execute(query, params, prepare=prepare, binary=binary)
        except psycopg.Error as exc:
            better = pooler_error(exc, transaction_pooling=False)
            if better is None:
                raise
            raise better from exc


def statement_prelude(
    conn: psycopg.AsyncConnection[Any], *, statement_timeout_ms: int, search_path: str | None
) -> bytes:
    """Return the settings sent ahead of each statement in transaction-pooling mode."""
    settings: list[tuple[str, str]] = [
        ("synchronous_commit", "on"),
        ("statement_timeout", f"{statement_timeout_ms}ms"),
        # A lock wait is bounded by statement_timeout; a client's small lock_timeout must not
        # turn a contended heartbeat into an error.
        ("lock_timeout", "0"),
    ]
    if search_path is not None:
        settings.append(("search_path", search_path))
    calls = sql.SQL(", ").join(
        sql.SQL("set_config({}, {}, true)").format(sql.Literal(name), sql.Literal(value))
        for name, value in settings
    )
    return sql.SQL("SELECT {}; ").format(calls).as_bytes(conn)


_ISOLATION = b"SET TRANSACTION ISOLATION LEVEL READ COMMITTED, READ WRITE; "


class PoolerSafeCursor(AsyncClientCursor[Any]):
    """Runs each statement outside a transaction as one self-contained implicit transaction.

    Use a subclass from :func:`pooler_safe_cursor`, which sets ``prelude``. Inside an explicit
    transaction (``conn.transaction()``, e.g. migrations) the settings are re-applied ahead of
    each statement (``SET LOCAL`` semantics, isolation as the transaction began): the
    transaction is already pinned to one server connection.
    """

    prelude: bytes = b""

    async def execute(  # type: ignore[override]  # no t-string templates
        self,
        query: _Query,
        params: Params | None = None,
        *,
        prepare: bool | None = None,
        binary: bool | None = None,
    ) -> Self:
        conn = self.connection
        status = conn.pgconn.transaction_status
        if status == _IDLE:
            prelude, skip = _ISOLATION + self.prelude, 2
        elif status == pq.TransactionStatus.INTRANS:
            prelude, skip = self.prelude, 1
        else:  # a failed transaction: let the server say so
            prelude, skip = b"", 0
        if params is not None:
            # The whole message goes through client-side %s interpolation.
            prelude = prelude.replace(b"%", b"%%")
        try:
            await super().execute(
                prelude + _as_bytes(query, conn), params, prepare=False, binary=binary
            )
        except psycopg.Error as exc:
            better = pooler_error(exc, transaction_pooling=True)
            if better is None:
                raise
            raise better from exc
        for _ in range(skip):
            self.nextset()
        return self


def pooler_safe_cursor(prelude: bytes) -> type[PoolerSafeCursor]:
    """Return a :class:`PoolerSafeCursor` class that sends ``prelude`` (a cursor_factory)."""
    return type("PoolerSafeCursor", (PoolerSafeCursor,), {"prelude": prelude})
