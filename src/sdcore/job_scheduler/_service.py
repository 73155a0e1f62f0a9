"""``JobSchedulerService``: the lease on PostgreSQL (psycopg 3, psycopg_pool).

The statements are in ``sdcore/postgres/sql/lease*.sql`` and ``ticks.sql``. The service holds
its collaborators: the statement engine (``_core.py``: held connections, bounded statements,
what a failed statement means), the acquires (``_acquire.py``) and the outcomes recorded
together (``_finals.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from types import TracebackType
from typing import Any, Self

import psycopg
from psycopg_pool import AsyncConnectionPool

from sdcore._internal.identifiers import random_uuid
from sdcore._internal.legacy import fold_moved
from sdcore._json import dump_json_object
from sdcore.job_scheduler._acquire import Acquirer, check_ticks
from sdcore.job_scheduler._attempts import AttemptAcquireResult, AttemptBudget, TickRecord
from sdcore.job_scheduler._base import BaseJobScheduler
from sdcore.job_scheduler._core import (
    STATUS,
    JobSchedulerDatabaseError,
    LeaseEngine,
    Params,
    lease_limit,
)
from sdcore.job_scheduler._finals import Finals
from sdcore.job_scheduler._model import (
    JobAcquireResult,
    JobLease,
    JobScheduler,
    JobSchedulerStatus,
    JobSchedulerUnavailableError,
    _check_lease,
    _check_lock_keys,
)
from sdcore.job_scheduler._options import JobAcquireOptions, coerce_batch, coerce_options
from sdcore.job_scheduler._sql import identity_params
from sdcore.postgres import (
    DatabaseConnectError,
    PoolSettings,
    create_pool,
    migrate,
    open_pool,
    schema_sql,
)

__all__ = ["JobSchedulerDatabaseError", "JobSchedulerService"]

SUCCESS = JobSchedulerStatus.SUCCESS
FAIL = JobSchedulerStatus.FAIL

# ``connect``'s default pool; ``is`` tells it from one the caller gave.
_CONNECT_POOL = PoolSettings(max_size=4)
# The pool keywords ``connect`` took in sdcore 0.1, by field of PoolSettings (the same names).
_MOVED_POOL = {
    name: name
    for name in (
        "min_size",
        "max_size",
        "application_name",
        "transaction_pooling",
        "connect_timeout",
        "open_timeout_ms",
        "reconnect_min_delay_ms",
        "reconnect_max_delay_ms",
        "reconnect_timeout_ms",
    )
}


class JobSchedulerService(BaseJobScheduler):
    """The distributed lease on PostgreSQL.

    Build it over a pool the application owns, or use :meth:`connect`. Lease statements run in
    their own autocommit transactions at READ COMMITTED on up to ``max_connections`` connections
    the service keeps checked out of the pool while it is open (they are returned, with their
    session settings reset, by :meth:`close`).

    Args:
        pool: An open ``psycopg_pool.AsyncConnectionPool``.
        table: Table name (default ``job_scheduler``).
        schema: Schema name, or ``None`` for the connection's ``search_path``.
        max_connections: Connections held for lease statements (at most this many in flight);
            capped at ``pool.max_size - 1`` when the pool has two or more, so the service never
            holds the last connection of a pool it shares with the application.
        statement_timeout_ms: Server-side timeout of each lease statement (0 = none).
        transaction_pooling: ``pool`` goes through a transaction-mode pooler (PgBouncer
            ``pool_mode=transaction``): no session settings; each statement carries its own.
        logger_name: Logger for run and heartbeat events.

    Raises:
        InvalidIdentifierError: A bad table or schema name.
        ValueError: ``max_connections`` or ``statement_timeout_ms`` out of range.
    """

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        *,
        table: str = JobScheduler.TABLE_NAME,
        schema: str | None = None,
        max_connections: int = 4,
        statement_timeout_ms: int = 30_000,
        transaction_pooling: bool = False,
        logger_name: str = "sdcore.job_scheduler",
    ) -> None:
        super().__init__(logger_name=logger_name)
        self._engine = engine = LeaseEngine(
            pool,
            table=table,
            schema=schema,
            max_connections=max_connections,
            statement_timeout_ms=statement_timeout_ms,
            transaction_pooling=transaction_pooling,
            log=self._log,
        )
        self._acquirer = Acquirer(engine)
        self._finals = Finals(engine)
        self._owned_pool = False

    @property
    def pool(self) -> AsyncConnectionPool[Any]:
        """The connection pool the service uses."""
        return self._engine.pool

    @property
    def max_connections(self) -> int:
        """Connections the service holds at most (always fewer than a shared pool's max_size)."""
        return self._engine.max_connections

    @classmethod
    @asynccontextmanager
    async def connect(
        cls, dsn: str, *, pool: PoolSettings = _CONNECT_POOL, **options: Any
    ) -> AsyncIterator[Self]:
        """Open a pool for ``dsn`` and a service over it; close both on exit.

        Args:
            dsn: libpq connection string or URL. A multi-host DSN with
                ``target_session_attrs=read-write`` follows a failover.
            pool: The pool's size, reconnect timing, open timeout and pooler mode
                (:class:`~sdcore.postgres.PoolSettings`; default ``PoolSettings(max_size=4)``).
                Its ``max_size`` is also the default ``max_connections``; its
                ``transaction_pooling`` reaches the service too.
            **options: Passed to the constructor (``table``, ``schema``, ``max_connections``,
                …). The pool keywords of sdcore 0.1 (``max_size=…``, ``open_timeout_ms=…``, …)
                still work for one release, with a ``DeprecationWarning`` naming the new
                spelling; one beside ``pool`` is a ``TypeError``.

        Yields:
            The open service.

        Raises:
            JobSchedulerUnavailableError: The database cannot be reached (the server's reason,
                password redacted).
            ValueError: An option out of range, before any connection.
            TypeError: ``pool`` not a ``PoolSettings``, or a 0.1 pool keyword beside it.
        """
        if not isinstance(pool, PoolSettings):
            raise TypeError(f"pool must be a PoolSettings, got {pool!r:.40}")
        # fold_moved → connect → the context manager's __aenter__ → the caller's ``async with``
        settings = fold_moved(
            "JobSchedulerService.connect",
            "pool",
            pool,
            moved=_MOVED_POOL,
            given=options,
            explicit=pool is not _CONNECT_POOL,
            stacklevel=3,
            spelled={"max_size": _CONNECT_POOL.max_size},
        )
        for name in _MOVED_POOL:
            options.pop(name, None)
        options.setdefault("max_connections", settings.max_size)
        opened = create_pool(dsn, settings)
        try:
            await open_pool(opened)
        except DatabaseConnectError as exc:
            raise JobSchedulerUnavailableError(str(exc)) from None
        try:
            service = cls(opened, transaction_pooling=settings.transaction_pooling, **options)
        except BaseException:
            await opened.close()
            raise
        service._owned_pool = True
        try:
            yield service
        finally:
            await service.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Return the held connections (and close the pool if :meth:`connect` opened it).

        Outcomes being recorded (``complete``/``fail`` in flight) are awaited first.
        """
        await self._finals.aclose()
        await self._engine.held.close()
        if self._owned_pool:
            await self._engine.pool.close()

    def schema_sql(self) -> str:
        """Return the DDL of this service's table (what :meth:`ensure_schema` applies)."""
        return schema_sql(table=self._engine.table, schema=self._engine.schema)

    async def ensure_schema(self) -> None:
        """Apply the lease table's pending migrations; safe from N replicas at once.

        A table created by sdcore 0.1.0 is upgraded in place, every row kept. A fencing sequence
        whose ``CACHE`` was raised after migration ``lease/0007`` pinned it to 1 is reported
        (a warning): with a cache, a key re-created after a prune may get a lower token.
        """
        # On a held connection: the held ones may be all the pool has (max_connections == max_size).
        engine = self._engine
        conn = await engine.held.get()
        try:
            await migrate(conn, "lease", table=engine.table, schema=engine.schema)
            cur = await conn.execute(
                b"SELECT seqcache FROM pg_sequence WHERE seqrelid = "
                + engine.sequence_sql.encode("utf-8")
            )
            cached = await cur.fetchone()
        except psycopg.Error as exc:
            await engine.held.put(conn, broken=conn.broken)
            raise engine.wrap(exc) from exc
        except BaseException:
            await engine.held.put(conn, broken=conn.broken)
            raise
        await engine.held.put(conn)
        if cached is not None and int(cached[0]) > 1:
            # The quoted name inside the regclass literal ('"schema"."name"'::regclass).
            sequence = engine.sequence_sql.removesuffix("::regclass")[1:-1].replace("''", "'")
            self._log.warning(
                "the fencing sequence %s has CACHE %d: each session draws from its own block, "
                "so a key re-created after a prune may get a lower fencing token; run "
                "ALTER SEQUENCE %s CACHE 1",
                sequence,
                int(cached[0]),
                sequence,
                extra={"action": "fencing_sequence_cached"},
            )

    async def acquire(self, options: JobAcquireOptions | Mapping[str, Any]) -> JobAcquireResult:
        """Insert a new ``RUNNING`` row, or take over a ``FAIL`` / expired ``RUNNING`` row.

        Expiry is the owner's lease, judged by the database clock: a ``RUNNING`` row is taken
        over only once its owner's ``lease_ms`` has passed since its last acquire or heartbeat,
        whatever ``lease_ms`` this call asks for. Taking over rotates the owner token, draws a
        new fencing token (above every token the table handed out), clears ``data`` and keeps
        the idempotency key. A ``SUCCESS`` row is never taken over.

        The lease is valid on the client from the moment the statement was *sent*, for
        ``lease_ms`` less :data:`~sdcore.job_scheduler.LEASE_CLOCK_MARGIN`. An answer that
        used more than half of that is confirmed with a heartbeat before it is reported; an
        acquire that cannot be confirmed in time is abandoned (its connection shut down, not
        cancelled and awaited) and reported not acquired: a row it may have written expires
        after its lease like any other. A caller cancelled while the statement is in flight
        reads the row back by its token and marks a row it turned out to own ``FAIL`` before
        the cancellation propagates.

        Args:
            options: ``JobAcquireOptions`` or a mapping with the same keys.

        Returns:
            ``JobAcquired`` (with row, tokens, keys and the lease's client deadline) or
            ``JobNotAcquired``.

        Raises:
            InvalidJobIdentityOptionsError: Bad identity, before any SQL.
            InvalidJobLeaseOptionsError: Bad timing, before any SQL.
            JobSchedulerUnavailableError: The outcome could not be established.
            JobSchedulerDatabaseError: The database refused the statement.
        """
        opts = options if type(options) is JobAcquireOptions else coerce_options(options)
        return (await self._acquirer.one(opts, None))[0]

    async def acquire_many(
        self, options: Sequence[JobAcquireOptions | Mapping[str, Any]]
    ) -> list[JobAcquireResult]:
        """``acquire`` for many runs in one statement; one result per item, in the input order.

        Each key follows the rules of :meth:`acquire` and is won by exactly one caller, however
        many replicas race over overlapping sets of keys (the statement locks rows and inserts
        keys in key order, so two batches never deadlock). Every item is validated before any
        SQL. Each lease is valid on the client from the moment the statement was sent, for its
        own ``lease_ms`` less the clock margin; a won lease whose answer used more than half of
        that is confirmed with a heartbeat (as by :meth:`acquire`) before it is reported, and
        reported not acquired if that fails. The statement is abandoned, and every item
        reported not acquired, if it does not answer within the shortest lease of the batch.
        A caller cancelled meanwhile marks the rows it turned out to own ``FAIL`` first.

        Args:
            options: At most 10,000 ``JobAcquireOptions`` or mappings, each a different run.

        Returns:
            ``JobAcquired`` or ``JobNotAcquired`` for each item, in the order given.

        Raises:
            InvalidJobIdentityOptionsError: Not a sequence, too many items, two items for one
                run, or an item with a bad identity (named by its index), before any SQL.
            InvalidJobLeaseOptionsError: An item with bad timing, before any SQL.
            JobSchedulerUnavailableError: The outcome could not be established.
            JobSchedulerDatabaseError: The database refused the statement.
        """
        results = await self._acquirer.many([(opts, None) for opts in coerce_batch(options)])
        return [result for result, _ in results]

    async def statuses(self, lock_keys: Sequence[str]) -> dict[str, JobSchedulerStatus]:
        """Return the status of each run that has a row, by ``lock_key``.

        Args:
            lock_keys: Keys as in ``JobAcquireOptions.lock_key`` (at most 10,000).

        Returns:
            ``{lock_key: status}`` for the keys that have a row.

        Raises:
            ValueError: A single str, too many keys, a key that is not a str, or one with NUL
                or invalid Unicode (before any SQL).
            JobSchedulerUnavailableError: The database could not be reached.
        """
        keys = _check_lock_keys(lock_keys)
        if not keys:
            return {}
        engine = self._engine
        rows = await engine.statement(engine.rows(engine.sql.statuses, (keys,)))
        return {key: STATUS[status] for key, status in rows}

    async def heartbeat(self, lease: JobLease) -> bool:
        """Bump ``modified_at`` by the database clock if ``lease`` is the current RUNNING owner.

        For a lease returned by ``acquire`` the statement is bounded by the lease itself: an
        answer later than ``lease_ms`` (less the clock margin) after sending could not renew
        anything, so the connection is abandoned then and the heartbeat raises. A heartbeat that
        succeeds moves the lease's client deadline to its send time plus the lease.

        Args:
            lease: The capability returned by ``acquire``.

        Returns:
            ``True`` if the lease was extended; ``False`` if ownership was lost.

        Raises:
            JobSchedulerUnavailableError: The database could not be reached (twice), or did not
                answer within the lease.
        """
        return await self._engine.heartbeat(lease)

    async def complete(self, lease: JobLease, data: Mapping[str, Any] | None = None) -> bool:
        """Mark the run ``SUCCESS`` with an optional JSON object.

        Args:
            lease: The capability returned by ``acquire``.
            data: A JSON object (str keys; no NaN/Infinity, no NUL) or ``None``.

        Returns:
            ``True`` if recorded; ``False`` if ownership was lost.

        Raises:
            JsonTypeError: ``data`` is not JSON, before any SQL.
            JsonValueError: ``data`` cannot be stored in jsonb, before any SQL.
            JobSchedulerUnavailableError: The outcome could not be established.
        """
        return await self._finals.record(*_final(lease, SUCCESS, data))

    async def fail(self, lease: JobLease, data: Mapping[str, Any] | None = None) -> bool:
        """Mark the run ``FAIL`` so that any replica may take it at once.

        Args:
            lease: The capability returned by ``acquire``.
            data: A JSON object or ``None`` (e.g. ``{"error": "…"}``).

        Returns:
            ``True`` if recorded; ``False`` if ownership was lost.

        Raises:
            JsonTypeError: ``data`` is not JSON, before any SQL.
            JsonValueError: ``data`` cannot be stored in jsonb, before any SQL.
            JobSchedulerUnavailableError: The outcome could not be established.
        """
        return await self._finals.record(*_final(lease, FAIL, data))

    async def complete_in(
        self,
        conn: psycopg.AsyncConnection[Any],
        lease: JobLease,
        data: Mapping[str, Any] | None = None,
    ) -> bool:
        """Mark the run ``SUCCESS`` inside the caller's transaction on ``conn``.

        Use it to record a run's outcome and its effects (outbox rows, business rows) atomically:
        if ownership was lost the UPDATE matches nothing, this returns ``False``, and the caller
        rolls back — a fenced-out owner can neither complete nor publish. ``run_exclusive``
        accepts a run its callable completed this way.

        Args:
            conn: A psycopg connection, normally inside ``conn.transaction()``.
            lease: The capability returned by ``acquire`` / given to the callable.
            data: A JSON object or ``None``.

        Returns:
            ``True`` if the row is now ``SUCCESS`` (once the caller commits).

        Raises:
            JsonTypeError: ``data`` is not JSON, before any SQL.
            JsonValueError: ``data`` cannot be stored in jsonb, before any SQL.
        """
        cur = await conn.execute(*self.complete_in_statement(lease, data))
        return cur.rowcount == 1

    def complete_in_statement(
        self, lease: JobLease, data: Mapping[str, Any] | None = None
    ) -> tuple[bytes, Params]:
        """Return the statement and parameters :meth:`complete_in` sends, for a caller that
        runs them on a connection of another kind (``sdcore.sync`` on a blocking one).

        The statement matches nothing unless the row is ``RUNNING`` with the lease's owner
        token, so its rowcount (1 or 0) is the whole answer.

        Raises:
            JsonTypeError: ``data`` is not JSON.
            JsonValueError: ``data`` cannot be stored in jsonb.
            ValueError: ``lease`` is malformed.
        """
        job_id, token = _check_lease(lease)
        params = (JobSchedulerStatus.SUCCESS.value, dump_json_object(data), job_id, token)
        return self._engine.sql.finalize, params

    async def status_of(self, lease: JobLease) -> JobSchedulerStatus | None:
        """Return the run's status if the row still carries this lease's token, else ``None``.

        Raises:
            JobSchedulerUnavailableError: The database could not be reached.
        """
        engine = self._engine
        row = await engine.statement(
            engine.fetch(engine.sql.read_status, _check_lease(lease), lease_limit(lease)),
            unanswered="the status read did not answer in time; connection abandoned",
        )
        return None if row is None else STATUS[row[0]]

    def finalize_soon(
        self,
        lease: JobLease,
        status: JobSchedulerStatus,
        data: Mapping[str, Any] | None = None,
    ) -> Awaitable[bool]:
        """Record the outcome with the others recorded meanwhile (``_finals.py``): the future
        of its answer (no task of its own when it joins a queue).

        Raises:
            ValueError, JsonTypeError, JsonValueError: A bad status, lease or ``data``, before
                any SQL.
        """
        params, limit = _final(lease, status, data)
        if self._finals.free:
            return asyncio.ensure_future(self._finals.record(params, limit))
        return self._finals.submit(params, limit)

    async def _reopen(
        self,
        lease: JobLease,
        data: Mapping[str, Any] | None,
        *,
        released: str | None = None,
        given_back: str | None = None,
    ) -> bool:
        """``fail`` with a reopen mark in its own column (``reopen`` in lease.sql), bounded like
        ``finalize``; an ambiguous commit is resolved by reading the row back."""
        job_id, token = _check_lease(lease)
        params = (dump_json_object(data), released, given_back, job_id, token)
        engine = self._engine
        return await engine.fenced(engine.sql.reopen, params, FAIL.value, lease_limit(lease))

    async def acquire_attempt(
        self, options: JobAcquireOptions, budget: AttemptBudget
    ) -> AttemptAcquireResult:
        """``acquire`` within a tick's attempt budget (needs migration ``lease/0003``).

        Raises:
            JobSchedulerUnavailableError: The database could not be reached.
            JobSchedulerDatabaseError: The database refused the statement (e.g. no
                ``attempts`` column: run ``sdcore db upgrade``).
        """
        result, attempt = await self._acquirer.one(options, budget)
        return AttemptAcquireResult(result=result, attempt=attempt)

    async def acquire_attempts(
        self, items: Sequence[tuple[JobAcquireOptions, AttemptBudget]]
    ) -> list[AttemptAcquireResult]:
        """``acquire_attempt`` for many ticks in one statement; one result per item, in order.

        Each key is won or not exactly as by :meth:`acquire_attempt` (its attempt budget
        included), by exactly one of the replicas that race for it. See
        :mod:`sdcore.job_scheduler._acquire`.

        Raises:
            ValueError: Two items for one lock key, or more than 10,000 items (before any SQL).
            JobSchedulerUnavailableError: The database could not be reached.
            JobSchedulerDatabaseError: The database refused the statement.
        """
        answers = await self._acquirer.many(check_ticks(items))
        return [AttemptAcquireResult(result=result, attempt=n) for result, n in answers]

    async def record_skipped(self, options: JobAcquireOptions, reason: str) -> bool:
        """Record a tick as skipped (``FAIL``, 0 attempts) if it has no row; ``True`` if written.

        Raises:
            JobSchedulerUnavailableError: The database could not be reached.
        """
        params = (*identity_params(options, random_uuid()), dump_json_object({"skipped": reason}))
        engine = self._engine
        return await engine.statement(engine.rowcount(engine.tick_sql.record_skipped, params)) == 1

    async def first_seen(self, code: str) -> datetime | None:
        """Return when the oldest row of ``code`` was created, if any.

        Raises:
            JobSchedulerUnavailableError: The database could not be reached.
        """
        engine = self._engine
        row = await engine.statement(engine.fetch(engine.tick_sql.first_seen, (code,)))
        return None if row is None else row[0]

    async def first_seen_many(self, codes: Sequence[str]) -> dict[str, datetime]:
        """Return :meth:`first_seen` of each of ``codes`` that has a row, in one statement.

        Raises:
            ValueError: A single str instead of a sequence, more than 10,000 codes, or a code
                that is not a str or PostgreSQL cannot store (before any SQL).
            JobSchedulerUnavailableError: The database could not be reached.
        """
        names = list(dict.fromkeys(_check_lock_keys(codes, "codes")))
        if not names:
            return {}
        engine = self._engine
        rows = await engine.statement(engine.rows(engine.tick_sql.first_seen_many, (names,)))
        return {code: first for code, first in rows}

    async def tick_records(self, lock_keys: Sequence[str]) -> dict[str, TickRecord]:
        """Return what the table says about each tick that has a row, by ``lock_key``.

        Raises:
            ValueError: As for :meth:`statuses` (the same check, before any SQL).
            JobSchedulerUnavailableError: The database could not be reached.
        """
        keys = _check_lock_keys(lock_keys)
        if not keys:
            return {}
        engine = self._engine
        rows = await engine.statement(engine.rows(engine.tick_sql.tick_records, (keys,)))
        return {
            key: TickRecord(
                status=STATUS[status],
                attempts=attempts,
                skipped=skipped,
                released=bool(released),
                age_ms=float(age),
                given_back=bool(returned),
                given_back_reason=reason if returned else None,
            )
            for key, status, attempts, skipped, released, age, returned, reason in rows
        }


def _final(
    lease: JobLease, status: JobSchedulerStatus, data: Mapping[str, Any] | None
) -> tuple[Params, float | None]:
    """``finalize``'s parameters and time limit: bounded by the lease's time left plus the
    slack (an answer that does not come back by then is never reported as recorded)."""
    if status is not SUCCESS and status is not FAIL:
        raise ValueError(f"an outcome is SUCCESS or FAIL, got {status!r}")
    job_id, token = _check_lease(lease)
    return (status.value, dump_json_object(data), job_id, token), lease_limit(lease)
