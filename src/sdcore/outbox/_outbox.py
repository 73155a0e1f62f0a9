"""``Outbox``: write messages in the caller's transaction; one row per idempotency key."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from sdcore._json import dump_json_object
from sdcore.job_scheduler import JobLease, bullmq_job_id
from sdcore.outbox._model import InvalidOutboxMessageError, check_identity, check_options
from sdcore.outbox._sql import OutboxStatements
from sdcore.postgres import check_identifier, migrate, outbox_schema_sql
from sdcore.postgres._schema import qualified

if TYPE_CHECKING:
    from sdcore.job_scheduler import JobSchedulerService

DEFAULT_CHANNEL = "sdcore_outbox"


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboxEntry:
    """One message to enqueue (for :meth:`Outbox.complete_and_enqueue`)."""

    idempotency_key: str
    queue: str
    name: str
    payload: Mapping[str, Any]
    options: Mapping[str, Any] | None = field(default=None)


@dataclass(frozen=True, slots=True)
class _Prepared:
    key: str
    queue: str
    name: str
    job_id: str
    payload: str
    options: str


class Outbox:
    """The transactional outbox table and how to write to it.

    Args:
        table: Table name (default ``outbox``).
        schema: Schema, or ``None`` for the connection's ``search_path``.
        channel: ``NOTIFY`` channel that wakes relays.
        max_attempts: Publish attempts before a row becomes ``DEAD``.
        notify: Send ``NOTIFY`` with each insert so relays wake at once. PostgreSQL serializes
            the commits of notifying transactions (a server-wide lock held until the commit is
            flushed), so many concurrent writers enqueue faster with ``notify=False`` and a
            relay ``poll_interval_ms`` of 100–250 ms.

    Raises:
        InvalidIdentifierError: A bad table, schema or channel name.
        ValueError: ``max_attempts`` out of range.
    """

    def __init__(
        self,
        *,
        table: str = "outbox",
        schema: str | None = None,
        channel: str = DEFAULT_CHANNEL,
        max_attempts: int = 10,
        notify: bool = True,
    ) -> None:
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int):
            raise TypeError("max_attempts must be an int")
        if not 1 <= max_attempts <= 1000:
            raise ValueError(f"max_attempts must be from 1 to 1000, got {max_attempts}")
        self.table = table
        self.schema = schema
        self.channel = check_identifier("channel", channel)
        self.max_attempts = max_attempts
        self.notify = bool(notify)
        self.sql = OutboxStatements.render(qualified(table, schema))

    def schema_sql(self) -> str:
        """Return the DDL of this outbox table."""
        return outbox_schema_sql(table=self.table, schema=self.schema)

    async def ensure_schema(
        self, target: psycopg.AsyncConnection[Any] | AsyncConnectionPool[Any]
    ) -> None:
        """Apply the outbox table's pending migrations (race-safe; a 0.1.0 table is upgraded)."""
        await migrate(target, "outbox", table=self.table, schema=self.schema)

    def _prepare(
        self,
        idempotency_key: object,
        queue: object,
        name: object,
        payload: object,
        options: object,
    ) -> _Prepared:
        key, queue_name, job_name = check_identity(idempotency_key, queue, name)
        if payload is None:
            raise InvalidOutboxMessageError("payload", "must be a JSON object, got None")
        text = dump_json_object(payload, field="payload")  # type: ignore[arg-type]
        assert text is not None  # noqa: S101 - None was refused above
        opts = check_options(options)  # type: ignore[arg-type]
        return _Prepared(key, queue_name, job_name, bullmq_job_id(key), text, json.dumps(opts))

    async def enqueue_once(
        self,
        conn: Any,
        *,
        idempotency_key: str,
        queue: str,
        name: str,
        payload: Mapping[str, Any],
        options: Mapping[str, Any] | None = None,
    ) -> bool:
        """Write one message in the caller's transaction; a duplicate key is a no-op.

        Everything is validated before any SQL, so a bad message never poisons the caller's
        transaction. The row becomes visible to relays when the caller commits; a rollback
        publishes nothing.

        Args:
            conn: A psycopg ``AsyncConnection`` (inside the caller's transaction), or a SQLAlchemy
                ``AsyncSession`` / ``AsyncConnection`` (the statement goes through the session,
                so it joins the session's transaction).
            idempotency_key: Unique per message, e.g. a run's ``lease.idempotency_key``.
            queue: BullMQ queue name (``[A-Za-z0-9_.-]``, 1–100).
            name: BullMQ job name.
            payload: The job's data, a JSON object.
            options: BullMQ job options (see :func:`sdcore.outbox.check_options`).

        Returns:
            ``True`` if the row was inserted, ``False`` if the key already existed.

        Raises:
            InvalidOutboxMessageError: A bad key, queue, name or option.
            JsonTypeError: ``payload`` is not JSON.
            JsonValueError: ``payload`` cannot be stored in jsonb (NaN, NUL, too deep/large).
            TypeError: ``conn`` is not a supported connection or session.
        """
        row = self._prepare(idempotency_key, queue, name, payload, options)
        if isinstance(conn, psycopg.AsyncConnection):
            return await self._insert(conn, row)
        return await self._enqueue_sqlalchemy(conn, row)

    async def _insert(self, conn: psycopg.AsyncConnection[Any], row: _Prepared) -> bool:
        params = (
            row.key,
            row.queue,
            row.name,
            row.job_id,
            row.payload,
            row.options,
            self.max_attempts,
            self.channel,
        )
        query = self.sql.enqueue if self.notify else self.sql.enqueue_quiet
        cur = await conn.execute(query, params)
        return await cur.fetchone() is not None

    async def _enqueue_sqlalchemy(self, conn: Any, row: _Prepared) -> bool:
        try:
            from sqlalchemy import text
            from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
        except ImportError:
            raise TypeError(
                f"conn must be a psycopg AsyncConnection, got {type(conn).__name__}"
            ) from None
        if not isinstance(conn, AsyncSession | AsyncConnection):
            raise TypeError(
                "conn must be a psycopg AsyncConnection or a SQLAlchemy AsyncSession /"
                f" AsyncConnection, got {type(conn).__name__}"
            )
        # Through session.execute, never a raw driver connection taken before the session's
        # first statement: that one is not yet inside the session's transaction (RESEARCH.md).
        query = self.sql.enqueue_named if self.notify else self.sql.enqueue_quiet_named
        result = await conn.execute(
            text(query),
            {
                "key": row.key,
                "queue": row.queue,
                "name": row.name,
                "job_id": row.job_id,
                "payload": row.payload,
                "options": row.options,
                "max": self.max_attempts,
                "channel": self.channel,
            },
        )
        return result.first() is not None

    async def complete_and_enqueue(
        self,
        conn: psycopg.AsyncConnection[Any],
        jobs: JobSchedulerService,
        lease: JobLease,
        messages: Sequence[OutboxEntry],
        *,
        data: Mapping[str, Any] | None = None,
    ) -> bool:
        """Complete a job-scheduler run and enqueue its messages in one transaction.

        The completion is guarded by the owner token: if ownership was lost, nothing is written
        and ``False`` is returned. Inside ``run_exclusive`` this is the run's outcome (the
        automatic ``complete`` afterwards accepts it).

        Args:
            conn: A psycopg connection (not inside a transaction; one is opened here).
            jobs: The job scheduler whose table holds the run.
            lease: The run's lease.
            messages: The messages to enqueue (validated before any SQL).
            data: JSON object stored on the run.

        Returns:
            ``True`` if the run is ``SUCCESS`` and every message is in the outbox.
        """
        prepared = [
            self._prepare(m.idempotency_key, m.queue, m.name, m.payload, m.options)
            for m in messages
        ]
        done = False
        async with conn.transaction():
            if not await jobs.complete_in(conn, lease, data):
                raise psycopg.Rollback()
            for row in prepared:
                await self._insert(conn, row)
            done = True
        return done
