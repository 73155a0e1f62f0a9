"""``Outbox``: write messages in the caller's transaction; one message per idempotency key."""

from __future__ import annotations

import json
import warnings
from collections.abc import Awaitable, Callable, Generator, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool

from sdcore._internal.identifiers import qualified
from sdcore._internal.steps import run_async
from sdcore._internal.telemetry import NOOP, Telemetry, trace_json
from sdcore._internal.validation import at_least, int_between
from sdcore._json import dump_json_object
from sdcore.job_scheduler import JobLease
from sdcore.outbox._debounce import Plan, plan_notify, settle
from sdcore.outbox._model import (
    DuplicateOutboxKeyError,
    InvalidOutboxMessageError,
    OutboxKeyConflictError,
    OutboxTransactionRequiredError,
    check_exact_numbers,
    check_identity,
    check_key,
    check_namespace,
    check_options,
    job_id_v2,
    message_digest,
)
from sdcore.outbox._sql import OutboxStatements
from sdcore.postgres import check_identifier, migrate, outbox_schema_sql

if TYPE_CHECKING:
    from sdcore.job_scheduler import JobSchedulerService

DEFAULT_CHANNEL = "sdcore_outbox"


class OutboxDriver(Protocol):
    """How :meth:`Outbox.enqueue_via` writes through another database library.

    An adapter of that library implements it (``sdcore.sqlalchemy``'s for a SQLAlchemy session);
    the outbox itself only knows psycopg.
    """

    async def begin(self) -> Hashable:
        """Join the caller's transaction, refusing an autocommit connection if the caller asked.

        Returns:
            The database written to (host, port, name): enqueues to one database share their
            ``NOTIFY`` debouncing.

        Raises:
            OutboxTransactionRequiredError: No transaction to join.
        """
        ...

    async def first(self, statement: str, params: Mapping[str, Any]) -> Sequence[Any] | None:
        """Run ``statement`` (psycopg's ``%(name)s`` placeholders) in that transaction.

        Returns:
            Its first row, or ``None`` when it returned none.
        """
        ...


# What runs one statement and returns its first row (psycopg bytes, or a driver's text).
_First = Callable[[Any, dict[str, Any]], Awaitable[Sequence[Any] | None]]
# One statement of the write loop (bytes for psycopg, str for drivers) with its parameters.
Statement = tuple[Any, dict[str, Any]]
# The write loop: yields statements, is sent each one's first row, returns "inserted".
WriteSteps = Generator[Statement, Sequence[Any] | None, bool]


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
    payload: str
    options: str
    digest: bytes


DEFAULT_DEDUP_WINDOW_MS = 30 * 24 * 3600 * 1000
DEFAULT_NOTIFY_INTERVAL_MS = 20


class Outbox:
    """The transactional outbox table and how to write to it.

    Args:
        table: Table name (default ``outbox``).
        schema: Schema, or ``None`` for the connection's ``search_path``.
        channel: ``NOTIFY`` channel that wakes relays.
        max_attempts: Publish attempts before a row becomes ``DEAD``.
        notify: Send ``NOTIFY`` with inserts so relays wake at once (``False``: relays find rows
            by polling only).
        notify_interval_ms: Debounce: the enqueue that opens an interval of this many ms (per
            database, table and channel, in this process) carries the ``NOTIFY``; the others
            commit without one once its transaction has committed (while it is open one more
            may notify, and if it rolled back the next one does; an enqueue that inserted
            nothing takes no slot). PostgreSQL
            serializes the commits of notifying transactions (a server-wide lock held until the
            commit is flushed), which caps concurrent writers; relays that have just found rows
            look again every ``notify_interval_ms`` for a second (or 50 intervals), so the rows
            nobody announced wait about one interval. ``0``: every insert notifies. Give the
            relay's ``Outbox`` the same value.
        namespace: Part of every BullMQ job id, so outboxes that share a Redis and queue names
            never collide on a key. ``None`` (default): the outbox's identity, computed by the
            database at insert — ``"<database>"."<schema>"."<table>"`` (quoted as by
            ``quote_ident``). Set one per service or tenant when two outboxes on different
            servers have the same database, schema and table names, or to compute job ids
            outside the database (:meth:`job_id`).
        dedup_window_ms: How long after its publication a key stays taken: relays prune old
            published rows to tombstones (key kept, payload dropped) and delete a tombstone
            only once this has passed. Default 30 days; at least one second.
        exact_numbers: Refuse, before any SQL, payload numbers that do not come back unchanged
            (``-0.0``, floats of magnitude ≥ 1e16, ints beyond ±(2^53 − 1)).

    Raises:
        InvalidIdentifierError: A bad table, schema or channel name.
        InvalidOutboxMessageError: A bad namespace.
        TypeError: ``max_attempts``, ``dedup_window_ms`` or ``notify_interval_ms`` not an int.
        ValueError: ``max_attempts``, ``dedup_window_ms`` or ``notify_interval_ms`` out of range.
    """

    telemetry: Telemetry = NOOP  # whose trace context rows carry (sdcore.tracing)

    def __init__(
        self,
        *,
        table: str = "outbox",
        schema: str | None = None,
        channel: str = DEFAULT_CHANNEL,
        max_attempts: int = 10,
        notify: bool = True,
        notify_interval_ms: int = DEFAULT_NOTIFY_INTERVAL_MS,
        namespace: str | None = None,
        dedup_window_ms: int = DEFAULT_DEDUP_WINDOW_MS,
        exact_numbers: bool = False,
    ) -> None:
        int_between("max_attempts", max_attempts, 1, 1000)
        at_least("dedup_window_ms", dedup_window_ms, 1000)
        int_between("notify_interval_ms", notify_interval_ms, 0, 10_000)
        target = qualified(table, schema)
        self.table = table
        self.schema = schema
        self.channel = check_identifier("channel", channel)
        self.max_attempts = max_attempts
        self.notify = bool(notify)
        self.notify_interval_ms = notify_interval_ms if self.notify else 0
        self.namespace = check_namespace(namespace)
        self.dedup_window_ms = dedup_window_ms
        self.exact_numbers = bool(exact_numbers)
        self.sql = OutboxStatements.render(target)
        self._target = target.as_string(None)

    def job_id(self, idempotency_key: str) -> str:
        """Return the BullMQ job id this outbox gives a new message with ``idempotency_key``.

        Needs an explicit ``namespace`` (without one, the id depends on the database the row
        is written to; read the row's ``job_id`` column instead).

        Raises:
            InvalidOutboxMessageError: A bad key.
            ValueError: The outbox has no namespace.
        """
        key = check_key(idempotency_key)
        if self.namespace is None:
            raise ValueError(
                "this Outbox has no namespace: its job ids are derived from the database, schema"
                " and table by the database; read the row's job_id, or set namespace="
            )
        return job_id_v2(self.namespace, key)

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
        # Measured as the relay sends it, against the publisher's default max_job_bytes (the
        # same number in the same unit): what is accepted here is published, never DEAD for size.
        text = dump_json_object(payload, field="payload", published=True)  # type: ignore[arg-type]
        assert text is not None  # noqa: S101 - None was refused above
        if self.exact_numbers:
            check_exact_numbers(payload)
        opts = json.dumps(check_options(options))  # type: ignore[arg-type]
        digest = message_digest(queue_name, job_name, text, opts)
        return _Prepared(key, queue_name, job_name, text, opts, digest)

    def _row_params(self, row: _Prepared) -> dict[str, Any]:
        return {
            "key": row.key,
            "queue": row.queue,
            "name": row.name,
            "payload": row.payload,
            "options": row.options,
            "digest": row.digest,
            "max": self.max_attempts,
            "namespace": self.namespace,
            "target": self._target,
            "channel": self.channel,
            "trace": trace_json(self.telemetry),
        }

    async def enqueue_once(
        self,
        conn: Any,
        *,
        idempotency_key: str,
        queue: str,
        name: str,
        payload: Mapping[str, Any],
        options: Mapping[str, Any] | None = None,
        allow_autocommit: bool = False,
    ) -> bool:
        """Write one message in the caller's transaction; the same message again is a no-op.

        Everything is validated before any SQL, so a bad message never poisons the caller's
        transaction. The row becomes visible to relays when the caller commits; a rollback
        publishes nothing.

        Under REPEATABLE READ or SERIALIZABLE, a key that another transaction committed after
        this transaction's snapshot raises ``psycopg.errors.SerializationFailure`` (SQLSTATE
        40001) instead of returning ``False``: retry the whole transaction, as for any
        serialization failure.

        Args:
            conn: A psycopg ``AsyncConnection`` (inside the caller's transaction). For a
                SQLAlchemy ``AsyncSession`` / ``AsyncConnection`` call
                :func:`sdcore.sqlalchemy.enqueue_once` (passing one here still works until the
                release after 0.2, with a ``DeprecationWarning``).
            idempotency_key: Unique per message, e.g. a run's ``lease.idempotency_key``.
            queue: BullMQ queue name (``[A-Za-z0-9_.-]``, 1–100).
            name: BullMQ job name.
            payload: The job's data, a JSON object.
            options: BullMQ job options (see :func:`sdcore.outbox.check_options`).
            allow_autocommit: Accept an autocommit connection with no transaction open (the
                message then commits at once, on its own).

        Returns:
            ``True`` if the row was inserted, ``False`` if this key already holds the same
            message (queue, name, payload and options equal as jsonb's ``=`` compares them:
            key order ignored, numbers by value, so ``10`` equals ``10.0``).

        Raises:
            InvalidOutboxMessageError: A bad key, queue, name or option.
            JsonTypeError: ``payload`` is not JSON.
            JsonValueError: ``payload`` cannot be stored in jsonb (NaN, NUL, too deep/large).
            OutboxKeyConflictError: The key holds a different message (nothing was written).
            OutboxTransactionRequiredError: ``conn`` is in autocommit mode outside a
                transaction (and ``allow_autocommit`` is false); nothing was written.
            TypeError: ``conn`` is not a supported connection or session.
        """
        if not isinstance(conn, psycopg.AsyncConnection) and _from_sqlalchemy(conn):
            warnings.warn(
                "Outbox.enqueue_once(session, ...) with a SQLAlchemy session or connection is"
                " deprecated; use sdcore.sqlalchemy.enqueue_once(outbox, session, ...)",
                DeprecationWarning,
                stacklevel=2,
            )
            # The one upward import, for this deprecated call only (see tests/unit/test_layers).
            from sdcore.sqlalchemy import enqueue_once

            return await enqueue_once(
                self,
                conn,
                idempotency_key=idempotency_key,
                queue=queue,
                name=name,
                payload=payload,
                options=options,
                allow_autocommit=allow_autocommit,
            )
        row = self._prepare(idempotency_key, queue, name, payload, options)
        if not isinstance(conn, psycopg.AsyncConnection):
            raise TypeError(
                f"conn must be a psycopg AsyncConnection, got {type(conn).__name__} (for a"
                " SQLAlchemy session: sdcore.sqlalchemy.enqueue_once)"
            )
        if (
            not allow_autocommit
            and conn.autocommit
            and conn.info.transaction_status == TransactionStatus.IDLE
        ):
            raise OutboxTransactionRequiredError("psycopg AsyncConnection")
        return await self._insert(conn, row)

    async def enqueue_via(
        self,
        driver: OutboxDriver,
        *,
        idempotency_key: str,
        queue: str,
        name: str,
        payload: Mapping[str, Any],
        options: Mapping[str, Any] | None = None,
    ) -> bool:
        """:meth:`enqueue_once` through another database library's adapter.

        The message is validated first; then ``driver.begin()`` joins the caller's transaction
        and the outbox's statements run through ``driver.first``, exactly as psycopg sends them.
        ``sdcore.sqlalchemy.enqueue_once`` is such an adapter.

        Args:
            driver: The adapter (see :class:`OutboxDriver`).
            idempotency_key: As for :meth:`enqueue_once`.
            queue: As for :meth:`enqueue_once`.
            name: As for :meth:`enqueue_once`.
            payload: As for :meth:`enqueue_once`.
            options: As for :meth:`enqueue_once`.

        Returns:
            ``True`` if the row was inserted, ``False`` if this key already holds the same
            message.

        Raises:
            InvalidOutboxMessageError: A bad key, queue, name or option.
            JsonTypeError: ``payload`` is not JSON.
            JsonValueError: ``payload`` cannot be stored in jsonb.
            OutboxKeyConflictError: The key holds a different message (nothing was written).
            OutboxTransactionRequiredError: The driver has no transaction to join.
        """
        row = self._prepare(idempotency_key, queue, name, payload, options)
        database = await driver.begin()
        return await self._write(row, database, driver.first)

    def _plan(self, database: Hashable) -> Plan:
        """How this enqueue notifies (see ``notify_interval_ms``)."""
        if not self.notify:
            return Plan("quiet")
        if not self.notify_interval_ms:
            return Plan("notify")
        return plan_notify((database, self._target, self.channel), self.notify_interval_ms)

    def _query(self, plan: Plan, *, text: bool) -> bytes | str:
        sql = self.sql
        if plan.kind == "notify":
            return sql.enqueue_text if text else sql.enqueue
        if plan.kind == "watch":
            return sql.enqueue_watch_text if text else sql.enqueue_watch
        return sql.enqueue_quiet_text if text else sql.enqueue_quiet

    def _params(self, row: _Prepared, plan: Plan) -> dict[str, Any]:
        params = self._row_params(row)
        if plan.kind == "watch":
            params["watch"] = plan.watched
            params["may_cover"] = plan.may_cover
        return params

    async def _insert(self, conn: psycopg.AsyncConnection[Any], row: _Prepared) -> bool:
        async def first(step: Statement) -> Sequence[Any] | None:
            cur = await conn.execute(*step)
            return await cur.fetchone()

        info = conn.info
        return await run_async(self._steps(row, (info.host, info.port, info.dbname)), first)

    async def _write(self, row: _Prepared, database: Hashable, first: _First) -> bool:
        async def run(step: Statement) -> Sequence[Any] | None:
            return await first(*step)

        return await run_async(self._steps(row, database, text=True), run)

    def _steps(self, row: _Prepared, database: Hashable, *, text: bool = False) -> WriteSteps:
        """Insert ``row``, or compare it with the key's row: the one loop of every connection.

        Yields each statement with its parameters and is sent the statement's first row
        (``None`` for none); returns what :meth:`enqueue_once` returns. Run it with
        :func:`~sdcore._internal.steps.run_async` (``AsyncConnection``, an
        :class:`OutboxDriver`) or :func:`~sdcore._internal.steps.run_blocking` (a blocking
        connection, in ``sdcore.sync``): the driver closes it however the run ends, so the
        ``NOTIFY`` slot this enqueue took is settled before the driver returns or raises.

        Args:
            row: The validated message.
            database: The database written to (its enqueues share the ``NOTIFY`` debounce).
            text: Yield the statements as ``str`` (for drivers) instead of psycopg's bytes.
        """
        plan = self._plan(database)
        params = self._params(row, plan)
        query = self._query(plan, text=text)
        existing = self.sql.existing_text if text else self.sql.existing
        inserted: Sequence[Any] | None = None
        try:
            for _ in range(3):
                inserted = yield query, params
                if inserted is not None:
                    return True
                found = yield existing, params
                if found is not None:
                    return self._same_message(row, found)
        finally:
            # Reached on return, on an error and on the driver's close (a failed statement,
            # a cancellation): an enqueue whose statement did not insert gives its slot back.
            settle(plan, inserted)
        raise RuntimeError(  # pragma: no cover - a key inserted and deleted three times over
            f"idempotency key {row.key!r:.80} kept conflicting with rows that vanished"
        )

    def _same_message(self, row: _Prepared, existing: Sequence[Any]) -> bool:
        same, queue, name, status, pruned = existing
        if not same:
            raise OutboxKeyConflictError(
                row.key,
                existing_queue=queue,
                existing_name=name,
                existing_status=status,
                pruned=bool(pruned),
            )
        return False

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
        automatic ``complete`` afterwards accepts it). A message whose key already holds the
        same message counts as enqueued; a key holding another message raises and rolls the
        whole transaction back (the run stays ``RUNNING``).

        Args:
            conn: A psycopg connection (not inside a transaction; one is opened here).
            jobs: The job scheduler whose table holds the run.
            lease: The run's lease.
            messages: The messages to enqueue (validated before any SQL).
            data: JSON object stored on the run.

        Returns:
            ``True`` if the run is ``SUCCESS`` and every message is in the outbox.

        Raises:
            DuplicateOutboxKeyError: Two entries share a key (before any SQL).
            OutboxKeyConflictError: A key holds a different message (nothing was written).
        """
        prepared = self._prepare_entries(messages)
        done = False
        async with conn.transaction():
            if not await jobs.complete_in(conn, lease, data):
                raise psycopg.Rollback()
            for row in prepared:
                await self._insert(conn, row)
            done = True
        return done

    def _prepare_entries(self, messages: Sequence[OutboxEntry]) -> list[_Prepared]:
        """Validate :meth:`complete_and_enqueue`'s messages (before any SQL).

        Raises:
            DuplicateOutboxKeyError: Two entries share a key.
        """
        prepared = [
            self._prepare(m.idempotency_key, m.queue, m.name, m.payload, m.options)
            for m in messages
        ]
        seen: dict[str, list[int]] = {}
        for index, row in enumerate(prepared):
            seen.setdefault(row.key, []).append(index)
        for key, indexes in seen.items():
            if len(indexes) > 1:
                raise DuplicateOutboxKeyError(key, tuple(indexes))
        return prepared


def _from_sqlalchemy(conn: object) -> bool:
    """Whether ``conn`` is a SQLAlchemy object (told by its class's module: nothing imported)."""
    return any(cls.__module__.split(".", 1)[0] == "sqlalchemy" for cls in type(conn).__mro__)
