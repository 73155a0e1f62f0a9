"""Bounding lease statements: a statement that outlives its limit has its socket shut down."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any

import psycopg


class _Abandoned(Exception):
    """A statement did not answer in time; its connection was shut down under it."""


def _shut_down(conn: psycopg.AsyncConnection[Any]) -> None:
    """Shut a connection's socket down under its pending statement.

    Cancelling the awaiting task instead would run psycopg's cancellation: a cancel request with
    its own 5 s timeout, then up to 5 s more waiting for the server, which is no bound at all when
    the network is cut. After a shutdown the pending read returns at once; the connection is then
    broken and goes back to the pool, which replaces it.
    """
    try:
        sock = socket.socket(fileno=os.dup(conn.pgconn.socket))
    except (OSError, psycopg.Error):
        return  # already closed: the statement is failing anyway
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


class _Watchdog:
    """Abandons statements that outlive their limit; one timer per service, not per statement.

    A timer per statement (``call_later`` + ``cancel``) would put two timer-heap operations on every
    lease statement's hot path. Here a statement costs a dict insert and a pop; a sweep every
    ``TICK`` seconds runs only while statements are in flight. A statement is abandoned between
    ``limit - TICK`` and ``limit`` after it started, never later.
    """

    TICK = 0.05

    __slots__ = ("_fired", "_handle", "_inflight")

    def __init__(self) -> None:
        self._inflight: dict[int, tuple[psycopg.AsyncConnection[Any], float]] = {}
        self._fired: set[int] = set()
        self._handle: asyncio.TimerHandle | None = None

    def watch(self, conn: psycopg.AsyncConnection[Any], limit: float) -> None:
        self._inflight[id(conn)] = (conn, time.monotonic() + limit - self.TICK)
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_later(self.TICK, self._sweep)

    def done(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Stop watching ``conn``; ``True`` if its statement was abandoned."""
        key = id(conn)
        self._inflight.pop(key, None)
        if self._fired and key in self._fired:
            self._fired.discard(key)
            return True
        return False

    def _sweep(self) -> None:
        now = time.monotonic()
        for key, (conn, until) in list(self._inflight.items()):
            if until <= now:
                del self._inflight[key]
                self._fired.add(key)
                _shut_down(conn)
        self._handle = (
            asyncio.get_running_loop().call_later(self.TICK, self._sweep)
            if self._inflight
            else None
        )
