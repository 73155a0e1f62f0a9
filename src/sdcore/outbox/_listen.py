"""The relay's wake-ups: PostgreSQL's LISTEN connection, and the loop that follows any store's.

:func:`pg_notifications` is :meth:`PostgresOutboxStore.notifications`: one LISTEN connection,
made from ``listen_dsn`` when given (a direct connection, e.g. past a transaction-pooling proxy),
otherwise from the pool's own conninfo and kwargs (not from the pool: a LISTEN session must stay
one session). :class:`Notifications` is the relay's side: it follows a store's notifications,
sets the wake-up flag on each, and subscribes again after a failure (polling covers the gap).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from sdcore._internal.errors import error_text
from sdcore._internal.redact import redact_text
from sdcore._internal.sql import queries
from sdcore.postgres import notifications


async def _connect_args(
    pool: AsyncConnectionPool[Any], listen_dsn: str | None
) -> tuple[str, dict[str, Any]]:
    if listen_dsn is not None:
        return listen_dsn, {"autocommit": True}
    # psycopg_pool accepts a str or a (possibly async) callable for both.
    conninfo: Any = pool.conninfo
    kwargs: Any = pool.kwargs
    if callable(conninfo):
        conninfo = conninfo()
    if callable(kwargs):
        kwargs = kwargs()
    if inspect.isawaitable(conninfo):
        conninfo = await conninfo
    if inspect.isawaitable(kwargs):
        kwargs = await kwargs
    return str(conninfo), {**(kwargs or {}), "autocommit": True}


async def pg_notifications(
    pool: AsyncConnectionPool[Any], *, channel: str, listen_dsn: str | None
) -> AsyncIterator[None]:
    """LISTEN on ``channel``; yield once when listening, then once per notification.

    Raises:
        psycopg.Error: The connection could not be made, or broke.
    """
    text = queries("outbox")["listen"].strip()
    statement = sql.SQL(text).format(channel=sql.Identifier(channel))
    conninfo, kwargs = await _connect_args(pool, listen_dsn)
    conn = await psycopg.AsyncConnection.connect(conninfo, **kwargs)
    async with conn:
        await conn.execute(statement)
        yield None
        async for _ in notifications(conn):
            yield None


class Notifications:
    """Follows a store's notifications and sets ``wake`` on every one.

    Args:
        source: The store's ``notifications`` method (called again after each failure).
        wake: The relay's wake-up flag.
        logger: Where to log a lost subscription.
    """

    def __init__(
        self,
        source: Callable[[], AsyncIterator[None]],
        *,
        wake: asyncio.Event,
        logger: logging.Logger,
    ) -> None:
        self._source = source
        self._wake = wake
        self._log = logger
        self.listening = False
        """True while the LISTEN is in place (a health check's "can be woken")."""

    async def run(self) -> None:
        """Listen until cancelled; subscribe again a second after a failure."""
        while True:
            try:
                async for _ in self._source():
                    self.listening = True
                    self._wake.set()  # the first: catch up on anything committed meanwhile
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - polling covers the gap; log and reconnect
                self._log.info(
                    "outbox relay: LISTEN connection lost (%s); polling until it is back",
                    redact_text(error_text(exc)[:200]),
                    extra={"action": "relay_listen_lost"},
                )
            finally:
                self.listening = False
            await asyncio.sleep(1.0)
