"""``Outbox`` without ``await``: the async outbox's write loop on a blocking connection.

No portal here: the caller's connection is blocking and its transaction is the caller's, so the
statements must run on that connection, in the caller's thread. Each write is the async
outbox's own statement sequence (``sdcore.outbox.Outbox._steps``, the same statements, the same
``NOTIFY`` debounce shared with async enqueues of this process), run by
:func:`~sdcore._internal.steps.run_blocking` instead of awaited.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol, Self

import psycopg
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool

from sdcore._internal.steps import run_blocking
from sdcore.job_scheduler import JobLease
from sdcore.outbox import (
    DEFAULT_CHANNEL,
    DEFAULT_DEDUP_WINDOW_MS,
    OutboxEntry,
    OutboxTransactionRequiredError,
)
from sdcore.outbox import Outbox as AsyncOutbox
from sdcore.outbox._outbox import DEFAULT_NOTIFY_INTERVAL_MS, Statement, WriteSteps
from sdcore.postgres._migrations import migrate_blocking

__all__ = ["CompletesRuns", "Outbox", "OutboxDriver"]

_Row = Sequence[Any] | None


class OutboxDriver(Protocol):
    """How :meth:`Outbox.enqueue_via` writes through another blocking database library.

    The blocking twin of :class:`sdcore.outbox.OutboxDriver`: an adapter of that library
    implements it (``sdcore.django``'s for Django's connection); the outbox only knows psycopg.
    """

    def begin(self) -> Hashable:
        """Join the caller's transaction, refusing to write outside one.

        Returns:
            The database written to (host, port, name): enqueues to one database share their
            ``NOTIFY`` debouncing.

        Raises:
            OutboxTransactionRequiredError: No transaction to join (or an error of the
                library's own that says so).
        """
        ...

    def first(self, statement: str, params: Mapping[str, Any]) -> _Row:
        """Run ``statement`` (psycopg's ``%(name)s`` placeholders) in that transaction.

        Returns:
            Its first row, or ``None`` when it returned none.
        """
        ...


class CompletesRuns(Protocol):
    """What :meth:`Outbox.complete_and_enqueue` needs of the job scheduler: ``complete_in`` on a
    blocking connection (``sdcore.sync.JobSchedulerService`` has it)."""

    def complete_in(
        self, conn: psycopg.Connection[Any], lease: JobLease, data: Mapping[str, Any] | None
    ) -> bool:
        """Mark the run ``SUCCESS`` in the caller's transaction; ``False`` if the lease was lost."""
        ...


class Outbox:
    """The transactional outbox for blocking code: write messages in the caller's transaction.

    Takes the keywords of :class:`sdcore.outbox.Outbox` (same defaults, same validation and
    errors) and holds one (:attr:`outbox`): the table's configuration, shared with relays and
    admins. To wrap an existing one (a ``Runtime``'s), use :meth:`of`.

    Args:
        table: Table name.
        schema: Schema, or ``None`` for the connection's ``search_path``.
        channel: ``NOTIFY`` channel that wakes relays.
        max_attempts: Publish attempts before a row becomes ``DEAD``.
        notify: Send ``NOTIFY`` with inserts.
        notify_interval_ms: The ``NOTIFY`` debounce; shared, per database, table and channel,
            with the async outboxes of this process.
        namespace: Part of every BullMQ job id.
        dedup_window_ms: How long after its publication a key stays taken.
        exact_numbers: Refuse payload numbers that do not come back unchanged.

    Raises:
        InvalidIdentifierError: A bad table, schema or channel name.
        InvalidOutboxMessageError: A bad namespace.
        TypeError: A number that is not an int.
        ValueError: A number out of range.
    """

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
        self.outbox = AsyncOutbox(
            table=table,
            schema=schema,
            channel=channel,
            max_attempts=max_attempts,
            notify=notify,
            notify_interval_ms=notify_interval_ms,
            namespace=namespace,
            dedup_window_ms=dedup_window_ms,
            exact_numbers=exact_numbers,
        )
        """The async outbox this one writes as (its table, namespace and notify settings)."""

    @classmethod
    def of(cls, outbox: AsyncOutbox) -> Self:
        """Return a blocking outbox writing to the table of ``outbox`` (shared, not copied).

        Raises:
            TypeError: ``outbox`` is not an :class:`sdcore.outbox.Outbox`.
        """
        if not isinstance(outbox, AsyncOutbox):
            raise TypeError(f"outbox must be an sdcore.outbox.Outbox, got {type(outbox).__name__}")
        made = cls.__new__(cls)
        made.outbox = outbox
        return made

    def job_id(self, idempotency_key: str) -> str:
        """Return the BullMQ job id a new message with this key gets (see the async outbox).

        Raises:
            InvalidOutboxMessageError: A bad key.
            ValueError: The outbox has no namespace.
        """
        return self.outbox.job_id(idempotency_key)

    def schema_sql(self) -> str:
        """Return the DDL of this outbox table."""
        return self.outbox.schema_sql()

    def ensure_schema(self, target: psycopg.Connection[Any] | ConnectionPool[Any]) -> None:
        """Apply the outbox table's pending migrations (race-safe), on a blocking connection.

        The async migration runner's statements and transactions, run here without a loop, so
        the caller's own connection (and its credentials) is used.

        Args:
            target: A ``psycopg.Connection`` not inside a transaction, or a
                ``psycopg_pool.ConnectionPool``.

        Raises:
            TypeError: ``target`` is neither.
            psycopg.Error: The database refused a statement (see ``sdcore.postgres.migrate``).
        """
        if not isinstance(target, psycopg.Connection | ConnectionPool):
            raise TypeError(
                "target must be a psycopg Connection or a psycopg_pool ConnectionPool, got"
                f" {type(target).__name__} (async code: await sdcore.outbox.Outbox.ensure_schema)"
            )
        migrate_blocking(target, "outbox", table=self.outbox.table, schema=self.outbox.schema)

    def enqueue_once(
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

        The rules of :meth:`sdcore.outbox.Outbox.enqueue_once`: everything is validated before
        any SQL (a bad message never poisons the caller's transaction); the row is visible to
        relays when the caller commits, and a rollback publishes nothing.

        Args:
            conn: A ``psycopg.Connection`` inside the caller's transaction, or a SQLAlchemy
                (sync) ``Session`` / ``Connection`` on the psycopg driver (its transaction is
                joined, autobegun if none is open).
            idempotency_key: Unique per message, e.g. a run's ``lease.idempotency_key``.
            queue: BullMQ queue name.
            name: BullMQ job name.
            payload: The job's data, a JSON object.
            options: BullMQ job options (see :func:`sdcore.outbox.check_options`).
            allow_autocommit: Accept an autocommit connection with no transaction open (the
                message then commits at once, on its own).

        Returns:
            ``True`` if the row was inserted, ``False`` if this key already holds the same
            message.

        Raises:
            InvalidOutboxMessageError: A bad key, queue, name or option.
            JsonTypeError: ``payload`` is not JSON.
            JsonValueError: ``payload`` cannot be stored in jsonb.
            OutboxKeyConflictError: The key holds a different message (nothing was written).
            OutboxTransactionRequiredError: ``conn`` is in autocommit mode outside a transaction
                (and ``allow_autocommit`` is false); nothing was written.
            TypeError: ``conn`` is not a supported connection or session.
        """
        outbox = self.outbox
        row = outbox._prepare(idempotency_key, queue, name, payload, options)
        if isinstance(conn, psycopg.Connection):
            if (
                not allow_autocommit
                and conn.autocommit
                and conn.info.transaction_status == TransactionStatus.IDLE
            ):
                raise OutboxTransactionRequiredError("psycopg Connection")
            return run_blocking(_psycopg_steps(outbox, conn, row), _first_of(conn))
        if _from_sqlalchemy(conn):
            return _sqlalchemy_write(outbox, conn, row, allow_autocommit=allow_autocommit)
        hint = ""
        if isinstance(conn, psycopg.AsyncConnection):
            hint = " (an AsyncConnection: await sdcore.outbox.Outbox().enqueue_once)"
        raise TypeError(
            "conn must be a psycopg Connection or a SQLAlchemy Session / Connection, got"
            f" {type(conn).__name__}{hint}"
        )

    def enqueue_via(
        self,
        driver: OutboxDriver,
        *,
        idempotency_key: str,
        queue: str,
        name: str,
        payload: Mapping[str, Any],
        options: Mapping[str, Any] | None = None,
    ) -> bool:
        """:meth:`enqueue_once` through another blocking database library's adapter.

        :meth:`sdcore.outbox.Outbox.enqueue_via` without ``await``, with the same arguments,
        result and errors: the message is validated first; then ``driver.begin()`` joins the
        caller's transaction (see :class:`OutboxDriver`) and the outbox's statements run
        through ``driver.first``, exactly as psycopg sends them.
        """
        outbox = self.outbox
        row = outbox._prepare(idempotency_key, queue, name, payload, options)
        database = driver.begin()

        def first(step: Statement) -> _Row:
            return driver.first(*step)

        return run_blocking(outbox._steps(row, database, text=True), first)

    def complete_and_enqueue(
        self,
        conn: psycopg.Connection[Any],
        jobs: CompletesRuns,
        lease: JobLease,
        messages: Sequence[OutboxEntry],
        *,
        data: Mapping[str, Any] | None = None,
    ) -> bool:
        """Complete a job-scheduler run and enqueue its messages in one transaction.

        The rules of :meth:`sdcore.outbox.Outbox.complete_and_enqueue`: the completion is
        guarded by the owner token (ownership lost: nothing written, ``False``); a key holding
        another message raises and rolls the whole transaction back.

        Args:
            conn: A ``psycopg.Connection`` (a transaction, or a savepoint inside the caller's,
                is opened here).
            jobs: The job scheduler whose table holds the run
                (``sdcore.sync.JobSchedulerService``).
            lease: The run's lease.
            messages: The messages to enqueue (validated before any SQL).
            data: JSON object stored on the run.

        Returns:
            ``True`` if the run is ``SUCCESS`` and every message is in the outbox.

        Raises:
            DuplicateOutboxKeyError: Two entries share a key (before any SQL).
            OutboxKeyConflictError: A key holds a different message (nothing was written).
            TypeError: ``conn`` is not a ``psycopg.Connection``.
        """
        outbox = self.outbox
        prepared = outbox._prepare_entries(messages)
        if not isinstance(conn, psycopg.Connection):
            raise TypeError(f"conn must be a psycopg Connection, got {type(conn).__name__}")
        first = _first_of(conn)
        done = False
        with conn.transaction():
            if not jobs.complete_in(conn, lease, data):
                raise psycopg.Rollback()
            for row in prepared:
                run_blocking(_psycopg_steps(outbox, conn, row), first)
            done = True
        return done


def _psycopg_steps(outbox: AsyncOutbox, conn: psycopg.Connection[Any], row: Any) -> WriteSteps:
    info = conn.info
    # The key the async path uses for the same connection parameters: one debounce per database.
    return outbox._steps(row, (info.host, info.port, info.dbname))


def _first_of(conn: psycopg.Connection[Any]) -> Any:
    def first(step: Statement) -> _Row:
        return conn.execute(*step).fetchone()

    return first


def _from_sqlalchemy(conn: object) -> bool:
    """Whether ``conn`` is a SQLAlchemy object (told by its class's module: nothing imported)."""
    return any(cls.__module__.split(".", 1)[0] == "sqlalchemy" for cls in type(conn).__mro__)


def _sqlalchemy_write(outbox: AsyncOutbox, conn: Any, row: Any, *, allow_autocommit: bool) -> bool:
    """The write loop through a SQLAlchemy sync ``Session`` or ``Connection``.

    Every statement goes through the connection bound to the session's transaction
    (``Session.connection()`` joins or autobegins it), as ``exec_driver_sql``: psycopg gets the
    statement text and parameters the psycopg path sends.
    """
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session

    if isinstance(conn, Session):
        bound = conn.connection()
    elif isinstance(conn, Connection):
        bound = conn
    else:
        raise TypeError(
            "a SQLAlchemy session must be a (sync) Session or Connection, got"
            f" {type(conn).__name__} (async: await sdcore.sqlalchemy.enqueue_once(outbox, ...))"
        )
    raw: Any = bound.connection.dbapi_connection
    # Only the driver knows whether that transaction is real or AUTOCOMMIT.
    if not allow_autocommit and getattr(raw, "autocommit", False):
        raise OutboxTransactionRequiredError(f"SQLAlchemy {type(conn).__name__}")
    database: Hashable
    if isinstance(raw, psycopg.Connection):
        # The psycopg path's key: one debounce per database whichever way it is written to
        # (an engine's URL may not name the server, with a `creator` for instance).
        database = (raw.info.host, raw.info.port, raw.info.dbname)
    else:
        url = bound.engine.url
        database = (url.host, url.port, url.database)

    def first(step: Statement) -> _Row:
        statement, params = step
        found = bound.exec_driver_sql(statement, params).first()
        return None if found is None else tuple(found)

    return run_blocking(outbox._steps(row, database, text=True), first)
