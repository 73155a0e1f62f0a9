"""The relay's LISTEN connection: every notification on the outbox channel sets a wake-up flag."""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any

import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from sdcore._internal.errors import error_text
from sdcore._internal.redact import redact_text


class Notifications:
    """Keeps one LISTEN connection open and sets ``wake`` on every notification.

    The connection is made from ``listen_dsn`` when given (a direct connection, e.g. past a
    transaction-pooling proxy), otherwise from the pool's own conninfo and kwargs (not from the
    pool: a LISTEN session must stay one session). It reconnects after a failure; polling covers
    the gap.

    Args:
        pool: The relay's pool (for its connection settings).
        channel: The NOTIFY channel.
        wake: The relay's wake-up flag.
        listen_dsn: Connect here instead of where the pool connects.
        logger: Where to log a lost connection.
    """

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        *,
        channel: str,
        wake: asyncio.Event,
        listen_dsn: str | None,
        logger: logging.Logger,
    ) -> None:
        self._pool = pool
        self._statement = sql.SQL("LISTEN {}").format(sql.Identifier(channel))
        self._wake = wake
        self._listen_dsn = listen_dsn
        self._log = logger
        self.listening = False
        """True while the LISTEN is in place (a health check's "can be woken")."""

    async def _connect_args(self) -> tuple[str, dict[str, Any]]:
        if self._listen_dsn is not None:
            return self._listen_dsn, {"autocommit": True}
        # psycopg_pool accepts a str or a (possibly async) callable for both.
        conninfo: Any = self._pool.conninfo
        kwargs: Any = self._pool.kwargs
        if callable(conninfo):
            conninfo = conninfo()
        if callable(kwargs):
            kwargs = kwargs()
        if inspect.isawaitable(conninfo):
            conninfo = await conninfo
        if inspect.isawaitable(kwargs):
            kwargs = await kwargs
        return str(conninfo), {**(kwargs or {}), "autocommit": True}

    async def run(self) -> None:
        """LISTEN until cancelled; reconnect a second after a failure."""
        while True:
            try:
                conninfo, kwargs = await self._connect_args()
                conn = await psycopg.AsyncConnection.connect(conninfo, **kwargs)
                async with conn:
                    await conn.execute(self._statement)
                    self.listening = True
                    self._wake.set()  # catch up on anything committed while not listening
                    async for _ in conn.notifies():
                        self._wake.set()
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
