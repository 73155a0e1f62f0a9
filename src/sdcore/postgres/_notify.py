"""Notifications on an idle LISTEN connection, without polling.

psycopg's ``AsyncConnection.notifies()`` waits in rounds of 100 ms (it checks for interrupts between
them): ten wake-ups a second for each listening connection, a few milliseconds of CPU a second
whether anything is notified or not, in every replica (the control plane's and the relay's
listeners; ``docs/benchmarks.md#scheduling``). :func:`notifications` waits for the socket to become
readable instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import psycopg
from psycopg import pq

__all__ = ["notifications"]


async def notifications(conn: psycopg.AsyncConnection[Any]) -> AsyncGenerator[None, None]:
    """Yield once per notification received on ``conn``, which has sent its ``LISTEN`` and is
    used for nothing else; the loop wakes only when the server sends something.

    Raises:
        psycopg.OperationalError: The connection broke (the server closed it, the network).
    """
    loop = asyncio.get_running_loop()
    pgconn = conn.pgconn
    fd = pgconn.socket
    readable = asyncio.Event()
    loop.add_reader(fd, readable.set)
    try:
        while True:
            while pgconn.notifies() is not None:
                yield None
            await readable.wait()
            readable.clear()
            pgconn.consume_input()  # raises OperationalError once the connection is gone
            if pgconn.status != pq.ConnStatus.OK:
                raise psycopg.OperationalError("the LISTEN connection was lost")
    finally:
        loop.remove_reader(fd)
