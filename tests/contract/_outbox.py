"""The outbox store contract's implementations: memory, and PostgreSQL on a fresh database."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

import sdcore.sync
from sdcore.outbox import Outbox, OutboxStore, PostgresOutboxStore
from sdcore.testing import FakeClock, MemoryOutboxStore

# ``postgres-sync-writer``: the PostgreSQL store, its rows written by ``sdcore.sync.Outbox`` on a
# blocking connection (the write path the store must read the same).
STORES = ["memory", "postgres", "postgres-sync-writer"]
MAX_ATTEMPTS = 3


def contract_outbox() -> Outbox:
    """One outbox for both stores: an explicit namespace gives both the same job ids."""
    return Outbox(namespace="contract", max_attempts=MAX_ATTEMPTS, dedup_window_ms=3_600_000)


@dataclass
class StoreBackend:
    """One implementation of the store port, with the test's back doors into its rows."""

    name: str
    store: OutboxStore
    outbox: Outbox
    enqueue: Callable[..., Awaitable[bool]]
    age: Callable[[int], Awaitable[None]]
    """Let ``ms`` pass for every row (the memory clock moves; PostgreSQL's rows move back)."""
    read: Callable[[int], Awaitable[dict[str, Any]]]


async def memory_store() -> StoreBackend:
    clock = FakeClock()
    outbox = contract_outbox()
    store = MemoryOutboxStore(outbox=outbox, clock=clock)

    async def enqueue(key: str, **kwargs: Any) -> bool:
        kwargs.setdefault("queue", "q")
        kwargs.setdefault("name", "n")
        kwargs.setdefault("payload", {"key": key})
        return store.enqueue(idempotency_key=key, **kwargs)

    async def age(ms: int) -> None:
        clock.advance(ms=ms)

    async def read(row_id: int) -> dict[str, Any]:
        row = store.get(row_id)
        assert row is not None
        return {
            "status": row.status.value,
            "attempts": row.attempts,
            "last_error": row.last_error,
            "claimed": row.claim_token is not None,
            "payload": row.payload,
            "options": row.options,
            "pruned": row.pruned_at is not None,
            "job_id": row.job_id,
        }

    return StoreBackend("memory", store, outbox, enqueue, age, read)


def _connect(dsn: str) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn)


async def postgres_store(dsn: str, *, sync_writer: bool = False) -> AsyncIterator[StoreBackend]:
    outbox = contract_outbox()
    async with AsyncConnectionPool(dsn, min_size=1, max_size=4, open=False) as pool:
        await pool.open()
        await outbox.ensure_schema(pool)
        store = PostgresOutboxStore(pool, outbox=outbox)
        writer: psycopg.Connection[Any] | None = None
        if sync_writer:
            writer = await asyncio.to_thread(_connect, dsn)
        blocking = sdcore.sync.Outbox.of(outbox)

        def write(key: str, kwargs: dict[str, Any]) -> bool:
            assert writer is not None
            with writer.transaction():
                return blocking.enqueue_once(writer, idempotency_key=key, **kwargs)

        async def enqueue(key: str, **kwargs: Any) -> bool:
            kwargs.setdefault("queue", "q")
            kwargs.setdefault("name", "n")
            kwargs.setdefault("payload", {"key": key})
            if writer is not None:
                return await asyncio.to_thread(write, key, kwargs)
            async with pool.connection() as conn:
                return await outbox.enqueue_once(conn, idempotency_key=key, **kwargs)

        async def age(ms: int) -> None:
            async with pool.connection() as conn:
                await conn.execute(
                    "UPDATE outbox SET created_at = created_at - %(d)s * interval '1 ms',"
                    " next_attempt_at = next_attempt_at - %(d)s * interval '1 ms',"
                    " claimed_until = claimed_until - %(d)s * interval '1 ms',"
                    " published_at = published_at - %(d)s * interval '1 ms'",
                    {"d": ms},
                )

        async def read(row_id: int) -> dict[str, Any]:
            async with pool.connection() as conn:
                cur = await conn.execute(
                    "SELECT status, attempts, last_error, claim_token IS NOT NULL, payload,"
                    " options, pruned_at IS NOT NULL, job_id FROM outbox WHERE id = %s",
                    (row_id,),
                )
                row = await cur.fetchone()
            assert row is not None
            names = ("status", "attempts", "last_error", "claimed", "payload", "options")
            return dict(zip((*names, "pruned", "job_id"), row, strict=True))

        try:
            yield StoreBackend("postgres", store, outbox, enqueue, age, read)
        finally:
            if writer is not None:
                await asyncio.to_thread(writer.close)
