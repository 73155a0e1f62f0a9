"""A few pool connections held for short autocommit statements, off the pool's hot path.

Checking a connection out of ``psycopg_pool`` for every statement costs a lock, a deque operation
and a status check each way; a lease cycle is two sub-millisecond statements, so that overhead alone
is several percent (``docs/benchmarks.md#lease-cycles``). The holder takes up to ``size``
connections from the pool once, configures their session for lease statements (autocommit, READ
COMMITTED whatever the role default, durable commits), and hands them out from a list. A broken
connection goes back to the pool, which replaces it. On close every session setting is reset before
the connection is returned, so a pool the application owns gets its connections back unchanged.

Behind a transaction-mode pooler (``transaction_pooling=True``) a session setting would reach other
clients and theirs would reach us, so nothing is set on the session: every statement carries its
own settings (:mod:`sdcore.postgres._pooling`) and no statement is prepared on the server.

The first connection also tells whether the server's, database's or role's ``synchronous_commit``
is weaker than ``on``; that is logged once (sdcore's own lease writes still commit with ``on``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from psycopg import AsyncConnection, AsyncCursor, OperationalError, pq
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool

from sdcore.postgres._pooling import GuardedCursor, pooler_safe_cursor, statement_prelude

logger = logging.getLogger(__name__)

# Pinned per session, never per transaction: lease statements run in autocommit, so they read
# clock_timestamp() at statement time, and a REPEATABLE READ / SERIALIZABLE role default would
# make losing contenders raise serialization failures instead of returning "not acquired".
_SESSION_SAVE = (
    b"SELECT current_setting('default_transaction_isolation'),"
    b" current_setting('synchronous_commit'),"
    b" current_setting('statement_timeout'), current_setting('TimeZone')"
)
_SESSION_SET = (
    b"SELECT set_config('default_transaction_isolation', %s, false),"
    b" set_config('synchronous_commit', %s, false),"
    b" set_config('statement_timeout', %s, false),"
    b" set_config('TimeZone', %s, false)"
)

# What RESET would restore: the server / database / role value, whatever another client of a
# pooler SET on the session we happen to be given.
_DEFAULTS = (
    b"SELECT (SELECT reset_val FROM pg_settings WHERE name = 'synchronous_commit'),"
    b" (SELECT reset_val FROM pg_settings WHERE name = 'search_path')"
)
# Commit levels that do not wait for the local flush and the synchronous standbys.
_WEAK_COMMIT = frozenset({"off", "local", "remote_write"})

_IDLE = pq.TransactionStatus.IDLE


class HeldConnections:
    """Hand out up to ``size`` configured connections of ``pool``.

    Args:
        pool: The pool the connections come from and go back to.
        size: How many connections may be held at once.
        statement_timeout_ms: Server-side ``statement_timeout`` of each statement (0 = none).
        transaction_pooling: ``pool`` reaches PostgreSQL through a transaction-mode pooler:
            no session settings, no server-side prepared statements.
    """

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        *,
        size: int,
        statement_timeout_ms: int,
        transaction_pooling: bool = False,
    ) -> None:
        self._pool = pool
        self._idle: list[AsyncConnection[Any]] = []
        self._slots = asyncio.Semaphore(size)
        self._statement_timeout_ms = statement_timeout_ms
        self._statement_timeout = f"{statement_timeout_ms}ms"
        self.transaction_pooling = transaction_pooling
        self._cursor_class: type[AsyncCursor[Any]] | None = None
        # id(conn) -> (autocommit, row_factory, cursor_factory, prepare_threshold, session
        # settings or None) to give back unchanged.
        self._restore: dict[int, tuple[bool, Any, Any, int | None, tuple[str, ...] | None]] = {}
        self._closed = False
        self._returning: set[asyncio.Task[None]] = set()

    async def get(self) -> AsyncConnection[Any]:
        """Return a held connection, waiting for a free slot if all are busy."""
        await self._slots.acquire()
        if self._idle:
            return self._idle.pop()
        try:
            return await self._open()
        except BaseException:
            self._slots.release()
            raise

    def release(self, conn: AsyncConnection[Any]) -> None:
        """Give back a connection after a statement that succeeded (the hot path: no await).

        A connection that is not idle (or the holder closed meanwhile) is handed to :meth:`put`
        in the background, which returns it to the pool.
        """
        if self._closed or conn.closed or conn.pgconn.transaction_status != _IDLE:
            task = asyncio.get_running_loop().create_task(self.put(conn, broken=True))
            self._returning.add(task)
            task.add_done_callback(self._returning.discard)
            return
        self._idle.append(conn)
        self._slots.release()

    async def put(self, conn: AsyncConnection[Any], *, broken: bool = False) -> None:
        """Give a connection back; a broken or non-idle one returns to the pool for replacement."""
        try:
            if broken or self._closed or conn.closed or conn.pgconn.transaction_status != _IDLE:
                await self._return(conn)
            else:
                self._idle.append(conn)
        finally:
            self._slots.release()

    async def close(self) -> None:
        """Return every idle connection to the pool, with its session settings reset."""
        self._closed = True
        if self._returning:
            await asyncio.wait(set(self._returning))
        idle, self._idle = self._idle, []
        for conn in idle:
            await self._return(conn)

    async def reset_idle(self) -> None:
        """Close every idle held connection (after one broke, the others are suspect too).

        A server restart or ``pg_terminate_backend`` kills every session at once; retrying on the
        next idle one would only fail again. The pool replaces closed connections.
        """
        idle, self._idle = self._idle, []
        for conn in idle:
            self._restore.pop(id(conn), None)
            await conn.close()
            await self._pool.putconn(conn)

    async def _open(self) -> AsyncConnection[Any]:
        # The session set-up doubles as a liveness check: a pooled connection that the server
        # already closed fails it, goes back to the pool (which discards it), and we try again.
        for _ in range(2):
            try:
                return await self._open_one()
            except OperationalError:
                continue
        return await self._open_one()

    async def _open_one(self) -> AsyncConnection[Any]:
        conn: AsyncConnection[Any] = await self._pool.getconn()
        try:
            if conn.pgconn.transaction_status != _IDLE:
                await conn.rollback()
            autocommit, row_factory = conn.autocommit, conn.row_factory
            cursor_factory, prepare_threshold = conn.cursor_factory, conn.prepare_threshold
            if not autocommit:
                await conn.set_autocommit(True)
            conn.row_factory = tuple_row
            saved: tuple[str, ...] | None = None
            if self.transaction_pooling:
                conn.prepare_threshold = None
                self._restore[id(conn)] = (
                    autocommit,
                    row_factory,
                    cursor_factory,
                    prepare_threshold,
                    None,
                )
            cursor_class = self._cursor_class or await self._first_connection(conn)
            if not self.transaction_pooling:
                cur = await conn.execute(_SESSION_SAVE)
                row = await cur.fetchone()
                assert row is not None  # noqa: S101 - a SELECT without FROM returns one row
                saved = tuple(row)
                self._restore[id(conn)] = (
                    autocommit,
                    row_factory,
                    cursor_factory,
                    prepare_threshold,
                    saved,
                )
            if not self.transaction_pooling:
                await conn.execute(
                    _SESSION_SET, ("read committed", "on", self._statement_timeout, "UTC")
                )
            conn.cursor_factory = cursor_class
        except BaseException:
            if conn.broken:
                self._restore.pop(id(conn), None)
                await self._pool.putconn(conn)
            else:
                await self._return(conn)
            raise
        return conn

    async def _first_connection(self, conn: AsyncConnection[Any]) -> type[AsyncCursor[Any]]:
        """Read the server's defaults once: warn about weak commits, build the cursor class."""
        cur = await conn.execute(_DEFAULTS)
        row = await cur.fetchone()
        assert row is not None  # noqa: S101 - a SELECT without FROM returns one row
        commit, search_path = row
        if commit in _WEAK_COMMIT:
            logger.warning(
                "synchronous_commit is %r for this server, database or role: commits may return "
                "before they are durable (or on the synchronous standby), so a crash or failover "
                "can lose them. sdcore's own lease writes commit with synchronous_commit=on; "
                "your transactions (complete_in, outbox rows) do not. See "
                "docs/how-to/production-topologies.md",
                commit,
                extra={"action": "synchronous_commit_weak", "synchronous_commit": commit},
            )
        if self.transaction_pooling:
            prelude = statement_prelude(
                conn, statement_timeout_ms=self._statement_timeout_ms, search_path=search_path
            )
            self._cursor_class = pooler_safe_cursor(prelude)
        else:
            self._cursor_class = GuardedCursor
        return self._cursor_class

    async def _return(self, conn: AsyncConnection[Any]) -> None:
        saved = self._restore.pop(id(conn), None)
        try:
            if saved is not None and not conn.closed and conn.pgconn.transaction_status == _IDLE:
                autocommit, row_factory, cursor_factory, prepare_threshold, settings = saved
                conn.cursor_factory = cursor_factory
                conn.prepare_threshold = prepare_threshold
                if settings is not None:
                    await conn.execute(_SESSION_SET, settings)
                conn.row_factory = row_factory
                if conn.autocommit != autocommit:
                    await conn.set_autocommit(autocommit)
        except Exception:
            logger.debug("could not reset a held connection", exc_info=True)
            await conn.close()
        finally:
            await self._pool.putconn(conn)
