"""A few pool connections held for short autocommit statements, off the pool's hot path.

Checking a connection out of ``psycopg_pool`` for every statement costs a lock, a deque
operation and a status check each way; a lease cycle is two statements of about 0.4 ms each,
so that overhead alone is several percent. The holder takes up to ``size`` connections from the
pool once, configures their session for lease statements (autocommit, READ COMMITTED whatever
the role default, durable commits), and hands them out from a list. A broken connection goes
back to the pool, which replaces it. On close every session setting is reset before the
connection is returned, so a pool the application owns gets its connections back unchanged.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from psycopg import AsyncConnection, OperationalError, pq
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool

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

_IDLE = pq.TransactionStatus.IDLE


class HeldConnections:
    """Hand out up to ``size`` configured connections of ``pool``.

    Args:
        pool: The pool the connections come from and go back to.
        size: How many connections may be held at once.
        statement_timeout_ms: Server-side ``statement_timeout`` of the held sessions (0 = none).
    """

    def __init__(
        self, pool: AsyncConnectionPool[Any], *, size: int, statement_timeout_ms: int
    ) -> None:
        self._pool = pool
        self._idle: list[AsyncConnection[Any]] = []
        self._slots = asyncio.Semaphore(size)
        self._statement_timeout = f"{statement_timeout_ms}ms"
        # id(conn) -> (autocommit, row_factory, session settings) to give back unchanged.
        self._restore: dict[int, tuple[bool, Any, tuple[str, ...]]] = {}
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
            if not autocommit:
                await conn.set_autocommit(True)
            conn.row_factory = tuple_row
            cur = await conn.execute(_SESSION_SAVE)
            saved = await cur.fetchone()
            assert saved is not None  # noqa: S101 - a SELECT without FROM returns one row
            self._restore[id(conn)] = (autocommit, row_factory, tuple(saved))
            await conn.execute(
                _SESSION_SET, ("read committed", "on", self._statement_timeout, "UTC")
            )
        except BaseException:
            if conn.broken:
                self._restore.pop(id(conn), None)
                await self._pool.putconn(conn)
            else:
                await self._return(conn)
            raise
        return conn

    async def _return(self, conn: AsyncConnection[Any]) -> None:
        saved = self._restore.pop(id(conn), None)
        try:
            if saved is not None and not conn.closed and conn.pgconn.transaction_status == _IDLE:
                await conn.execute(_SESSION_SET, saved[2])
                conn.row_factory = saved[1]
                if conn.autocommit != saved[0]:
                    await conn.set_autocommit(saved[0])
        except Exception:
            logger.debug("could not reset a held connection", exc_info=True)
            await conn.close()
        finally:
            await self._pool.putconn(conn)
