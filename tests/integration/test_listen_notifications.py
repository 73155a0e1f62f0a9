"""``sdcore.postgres.notifications``: a LISTEN connection's notifications without polling."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest

from sdcore.postgres import notifications


async def test_each_notification_is_yielded_and_a_killed_connection_raises(pg_dsn: str) -> None:
    channel = f"sdcore_test_{uuid.uuid4().hex[:12]}"
    listener = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True)
    other = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True)
    async with listener, other:
        await listener.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel)))
        received: list[None] = []
        stream = notifications(listener)

        async def take(n: int) -> None:
            async for _ in stream:
                received.append(None)
                if len(received) == n:
                    return

        for _ in range(3):
            await other.execute("SELECT pg_notify(%s, 'x')", (channel,))
        await asyncio.wait_for(take(3), 5.0)
        # Two in one transaction arrive together: both are yielded.
        async with other.transaction():
            await other.execute("SELECT pg_notify(%s, 'a')", (channel,))
            await other.execute("SELECT pg_notify(%s, 'b')", (channel,))
        await asyncio.wait_for(take(5), 5.0)
        pid = listener.info.backend_pid
        await other.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(psycopg.OperationalError):
            await asyncio.wait_for(take(6), 5.0)
        await stream.aclose()
