"""The consumer side: a Celery task's database effect once per task id, however often it runs."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Concatenate, ParamSpec, TypeVar

import psycopg
from celery import current_task  # type: ignore[import-untyped]
from celery.exceptions import Ignore  # type: ignore[import-untyped]
from psycopg import sql
from psycopg.pq import TransactionStatus

from sdcore._internal.identifiers import check_identifier
from sdcore._internal.validation import non_empty_str, positive_timedelta, shown
from sdcore.outbox import OutboxError
from sdcore.postgres import SCHEMA_LOCK_ID

P = ParamSpec("P")
R = TypeVar("R")
DEFAULT_LEDGER_TABLE = "sdcore_celery_done"
MAX_TASK_ID_LENGTH = 1024


class LedgerTransactionRequiredError(OutboxError, RuntimeError):
    """``TaskLedger.record`` was given a connection in autocommit mode with no transaction open.

    The mark would commit at once, alone: a task that then failed would count as done, and its
    retry would be skipped.
    """

    def __init__(self) -> None:
        super().__init__(
            "TaskLedger.record needs the task's transaction: the connection is in autocommit"
            " mode with no transaction open (use `with conn.transaction():`)"
        )


class TaskLedger:
    """The table of the Celery task ids whose transaction committed.

    :meth:`record` inserts the task id in the caller's transaction: the first run of a task id
    inserts it and goes on; a repeat (a redelivery, a re-published outbox row) finds it and is
    told to skip. A run whose transaction rolls back leaves no mark, so its retry runs. Two
    runs of one id at once: the second waits on the first's uncommitted row, then skips if it
    committed or goes on if it rolled back.

    Args:
        table: The table's name.
        schema: Its schema (``None``: the ``search_path``).

    Raises:
        InvalidIdentifierError: A table or schema name PostgreSQL cannot hold.
    """

    def __init__(self, *, table: str = DEFAULT_LEDGER_TABLE, schema: str | None = None) -> None:
        self.table = check_identifier("table", table)
        self.schema = None if schema is None else check_identifier("schema", schema)
        self._name = sql.Identifier(*(p for p in (self.schema, self.table) if p is not None))
        # The index's name, cut to what PostgreSQL keeps (63 bytes; identifiers are checked
        # to fit in 63 bytes, and the suffix is ASCII).
        index = (self.table + "_done_at").encode("utf-8")[:63].decode("utf-8", "ignore")
        self._index = sql.Identifier(index)

    def schema_sql(self) -> str:
        """Return the table's DDL (idempotent: ``IF NOT EXISTS``)."""
        return self._ddl().as_string(None)

    def _ddl(self) -> sql.Composed:
        return sql.SQL(
            "CREATE TABLE IF NOT EXISTS {t} (\n"
            "    task_id text PRIMARY KEY,\n"
            "    task text NOT NULL,\n"
            "    done_at timestamptz NOT NULL DEFAULT clock_timestamp()\n"
            ");\n"
            "CREATE INDEX IF NOT EXISTS {i} ON {t} (done_at);\n"
        ).format(t=self._name, i=self._index)

    def ensure_schema(self, conn: psycopg.Connection[Any]) -> None:
        """Create the table if it is missing, in a transaction of its own.

        Serialized with sdcore's other schema changes (an advisory lock): replicas that start
        together do not race on the catalog.
        """
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_ID,))
            conn.execute(self._ddl())

    def record(self, conn: psycopg.Connection[Any], task_id: str, *, task: str) -> bool:
        """Mark ``task_id`` done in the caller's transaction; ``False``: a run already did.

        Args:
            conn: A psycopg connection inside the task's transaction.
            task_id: The Celery task id (an outbox message's job id).
            task: The task's name (kept for operators).

        Raises:
            LedgerTransactionRequiredError: ``conn`` would commit the mark on its own.
            TypeError / ValueError: An empty or oversized id or name.
        """
        non_empty_str("task_id", task_id, max_length=MAX_TASK_ID_LENGTH)
        non_empty_str("task", task, max_length=MAX_TASK_ID_LENGTH)
        if conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
            raise LedgerTransactionRequiredError()
        cur = conn.execute(
            sql.SQL(
                "INSERT INTO {t} (task_id, task) VALUES (%s, %s)"
                " ON CONFLICT (task_id) DO NOTHING RETURNING 1"
            ).format(t=self._name),
            (task_id, task),
        )
        return cur.fetchone() is not None

    def prune(self, conn: psycopg.Connection[Any], *, older_than: timedelta) -> int:
        """Forget task ids done more than ``older_than`` ago; return how many.

        A task id forgotten is run again if its message is delivered again: keep ids at least
        as long as a message can be redelivered (the outbox's ``dedup_window_ms`` covers
        re-publishes).
        """
        age = positive_timedelta("older_than", older_than)
        cur = conn.execute(
            sql.SQL("DELETE FROM {t} WHERE done_at < clock_timestamp() - %s").format(t=self._name),
            (age,),
        )
        return cur.rowcount


Connect = Callable[[], "psycopg.Connection[Any]"]


class _Held:
    """A connection of this process and thread, closed when the thread's storage is dropped."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.pid = os.getpid()

    def __del__(self, getpid: Callable[[], int] = os.getpid) -> None:
        # Only in the process that opened it: a forked child's copy must not end the parent's
        # session (libpq's finish writes on the socket both processes hold). ``getpid`` is bound
        # at definition: at interpreter exit the module's globals may already be gone.
        if self.pid == getpid() and not self.conn.closed:
            self.conn.close()


class _Connections(threading.local):
    """One connection per process and thread: a prefork worker's children never share one."""

    held: _Held | None = None


def exactly_once(
    connect: str | Connect, *, ledger: TaskLedger | None = None
) -> Callable[[Callable[Concatenate[psycopg.Connection[Any], P], R]], Callable[P, R]]:
    """Make a Celery task's database effect happen once per task id.

    The decorated function gets a psycopg connection inside a transaction as its first argument
    and runs only if :meth:`TaskLedger.record` marks the task id in that same transaction; the
    transaction commits when it returns and rolls back (with the mark) when it raises, so a
    retry runs again. A repeat of a task id that committed is skipped: it raises
    ``celery.exceptions.Ignore`` (the message is acknowledged, the first run's state and result
    stand). Put it under ``@app.task``::

        @app.task(acks_late=True)
        @exactly_once(DATABASE_URL)
        def charge(conn, order_id): ...

    It covers what the task writes through ``conn``. Not covered: anything outside that
    transaction (an HTTP call, an email, another database), which a repeat does again unless
    it is idempotent itself; a run that commits and then dies before the broker's ack is fine
    (the redelivery is skipped).

    Args:
        connect: A libpq connection string, or a function returning a new psycopg connection.
            A connection is opened per process and thread on first use (never shared across a
            prefork worker's fork) and opened again after it broke.
        ledger: The table of done task ids (default: ``TaskLedger()``).

    Raises:
        TypeError: ``connect`` is neither a ``str`` nor callable.
    """
    if not (isinstance(connect, str) or callable(connect)):
        raise TypeError(f"connect must be a connection string or a callable, got {shown(connect)}")
    book = TaskLedger() if ledger is None else ledger
    opener: Connect = (lambda: psycopg.connect(connect)) if isinstance(connect, str) else connect
    local = _Connections()
    # Connections inherited through a fork: kept referenced, never closed or collected here
    # (libpq's finish would end the parent's session on the socket both processes hold).
    inherited: list[_Held] = []

    def connection() -> tuple[psycopg.Connection[Any], bool]:
        """This process and thread's connection, and whether it was just opened."""
        held = local.held
        if held is not None and held.pid == os.getpid() and not held.conn.closed:
            return held.conn, False
        if held is not None and held.pid != os.getpid():
            inherited.append(held)
        conn = opener()
        if not isinstance(conn, psycopg.Connection):
            raise TypeError(f"connect() must return a psycopg.Connection, got {shown(conn)}")
        local.held = _Held(conn)
        return conn, True

    def decorate(
        function: Callable[Concatenate[psycopg.Connection[Any], P], R],
    ) -> Callable[P, R]:
        @functools.wraps(function)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            request = getattr(current_task, "request", None)
            task_id = getattr(request, "id", None)
            name = getattr(current_task, "name", None) or function.__qualname__
            if not isinstance(task_id, str):
                raise RuntimeError(
                    f"{function.__qualname__} runs exactly once per Celery task id: call it as"
                    " a task (delay, apply_async, a worker), not directly"
                )
            for retry in (False, True):
                conn, fresh = connection()
                ran = False
                try:
                    with conn.transaction():
                        if book.record(conn, task_id, task=name):
                            ran = True
                            return function(conn, *args, **kwargs)
                except psycopg.OperationalError:
                    if not conn.broken:
                        raise  # the database's answer (a lock timeout, …): the task's failure
                    conn.close()  # the next run opens another
                    # A connection kept since the last task may have been closed by the server
                    # (idle timeout, restart) and fail at BEGIN or at the mark, before the
                    # task's own code: that once, on a new connection, before failing the task.
                    if ran or fresh or retry:
                        raise
                    continue
                break
            raise Ignore(f"task {task_id} already ran to commit")

        return run

    return decorate
