"""``JobSchedulerService``: the lease on PostgreSQL (psycopg 3, psycopg_pool).

The statements are in ``sdcore/postgres/sql/lease.sql``; the shared machinery (held
connections, bounded statements, confirmation of late answers) in ``_core.py``; batches in
``_batch.py``; the scheduler's tick operations in ``_ticks.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, Self

import psycopg
from psycopg import errors as pg_errors

from sdcore._internal.identifiers import random_uuid
from sdcore._json import dump_json_object
from sdcore.job_scheduler._attempts import AttemptBudget
from sdcore.job_scheduler._batch import _BatchOperations
from sdcore.job_scheduler._core import (
    NOT_ACQUIRED,
    STATUS,
    JobSchedulerDatabaseError,
    _limit,
    identity_params,
    settle,
    won,
)
from sdcore.job_scheduler._model import (
    JobAcquireResult,
    JobLease,
    JobSchedulerStatus,
    JobSchedulerUnavailableError,
    _check_lease,
    _check_lock_keys,
    _LeaseState,
)
from sdcore.job_scheduler._options import JobAcquireOptions, coerce_options
from sdcore.job_scheduler._ticks import _TickOperations
from sdcore.job_scheduler._watchdog import _Abandoned
from sdcore.postgres import (
    DatabaseConnectError,
    PoolSettings,
    create_pool,
    migrate,
    open_pool,
    schema_sql,
)

__all__ = ["JobSchedulerDatabaseError", "JobSchedulerService"]


class JobSchedulerService(_BatchOperations, _TickOperations):
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

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        dsn: str,
        *,
        min_size: int = 1,
        max_size: int = 4,
        application_name: str = "sdcore",
        transaction_pooling: bool = False,
        connect_timeout: int | None = None,
        open_timeout_ms: int = 30_000,
        reconnect_min_delay_ms: int = 100,
        reconnect_max_delay_ms: int = 1_000,
        reconnect_timeout_ms: int = 300_000,
        **options: Any,
    ) -> AsyncIterator[Self]:
        """Open a pool for ``dsn`` and a service over it; close both on exit.

        Args:
            dsn: libpq connection string or URL. A multi-host DSN with
                ``target_session_attrs=read-write`` follows a failover.
            min_size: Pool minimum size.
            max_size: Pool maximum size (also the default ``max_connections``).
            application_name: Shown in ``pg_stat_activity``.
            transaction_pooling: ``dsn`` points at a transaction-mode pooler (PgBouncer
                ``pool_mode=transaction``): no server-side prepared statements, no session
                settings; every lease statement carries its own ``synchronous_commit=on`` and
                timeout.
            connect_timeout: Seconds per connection attempt and host (libpq: whole seconds, at
                least 2); ``None``: the DSN's value, else 10.
            open_timeout_ms: How long to wait for a first connection while nothing answers. A
                server that refuses (unknown database or role, failed authentication) fails at
                once, with its reason.
            reconnect_min_delay_ms: First pause before replacing a broken connection; doubles...
            reconnect_max_delay_ms: ...up to this, so a promoted standby is used within about
                this long of accepting connections.
            reconnect_timeout_ms: Stop trying to replace a connection after this long.
            **options: Passed to the constructor (``table``, ``schema``, …).

        Yields:
            The open service.

        Raises:
            JobSchedulerUnavailableError: The database cannot be reached (the server's reason,
                password redacted).
            ValueError: An option out of range, before any connection.
        """
        options.setdefault("max_connections", max_size)
        settings = PoolSettings(
            min_size=min_size,
            max_size=max_size,
            application_name=application_name,
            transaction_pooling=transaction_pooling,
            connect_timeout=connect_timeout,
            open_timeout_ms=open_timeout_ms,
            reconnect_min_delay_ms=reconnect_min_delay_ms,
            reconnect_max_delay_ms=reconnect_max_delay_ms,
            reconnect_timeout_ms=reconnect_timeout_ms,
        )
        pool = create_pool(dsn, settings)
        try:
            await open_pool(pool)
        except DatabaseConnectError as exc:
            raise JobSchedulerUnavailableError(str(exc)) from None
        try:
            service = cls(pool, transaction_pooling=transaction_pooling, **options)
        except BaseException:
            await pool.close()
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
        await self._held.close()
        if self._owned_pool:
            await self._pool.close()

    def schema_sql(self) -> str:
        """Return the DDL of this service's table (what :meth:`ensure_schema` applies)."""
        return schema_sql(table=self._table, schema=self._schema)

    async def ensure_schema(self) -> None:
        """Apply the lease table's pending migrations; safe from N replicas at once.

        A table created by sdcore 0.1.0 is upgraded in place, every row kept. A fencing sequence
        whose ``CACHE`` was raised after migration ``lease/0007`` pinned it to 1 is reported
        (a warning): with a cache, a key re-created after a prune may get a lower token.
        """
        # On a held connection: the held ones may be all the pool has (max_connections == max_size).
        conn = await self._held.get()
        try:
            await migrate(conn, "lease", table=self._table, schema=self._schema)
            cur = await conn.execute(
                b"SELECT seqcache FROM pg_sequence WHERE seqrelid = "
                + self._sequence_sql.encode("utf-8")
            )
            cached = await cur.fetchone()
        except psycopg.Error as exc:
            await self._held.put(conn, broken=conn.broken)
            raise self._wrap(exc) from exc
        except BaseException:
            await self._held.put(conn, broken=conn.broken)
            raise
        await self._held.put(conn)
        if cached is not None and int(cached[0]) > 1:
            # The quoted name inside the regclass literal ('"schema"."name"'::regclass).
            sequence = self._sequence_sql.removesuffix("::regclass")[1:-1].replace("''", "'")
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
        token = random_uuid()
        params = (*identity_params(opts, token), opts.lease_ms)
        sent = time.monotonic()
        state = _LeaseState.for_lease(opts.lease_ms, sent)
        # A cancellation anywhere in the acquire, the recovery of a broken connection included,
        # resolves the outcome by our token and gives back a row we won: a cancelled acquire
        # never leaves a RUNNING row with no owner.
        try:
            try:
                row = await self._acquire_row(opts, self._sql.acquire, params, state.valid)
            except psycopg.OperationalError as exc:
                if not exc.sqlstate or isinstance(exc, pg_errors.AdminShutdown):
                    return await self._acquire_again(opts, params, state, exc)
                raise self._wrap(exc) from exc
            except psycopg.Error as exc:
                raise self._wrap(exc) from exc
        except asyncio.CancelledError:
            await settle(self._resolve_cancelled(opts, token, state))
            raise
        if row is None:
            return NOT_ACQUIRED
        return await self._confirmed(opts, won(opts, token, row, state))

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
        rows = await self._fetch_all(self._sql.statuses, (keys,))
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
        params = _check_lease(lease)
        state: _LeaseState | None = getattr(lease, "_state", None)
        for attempt in (1, 2):
            sent = time.monotonic()
            limit = None if state is None or state.valid == float("inf") else state.valid
            try:
                ok = await self._rowcount(self._sql.heartbeat, params, limit) == 1
            except _Abandoned as exc:
                raise JobSchedulerUnavailableError(
                    "the heartbeat did not answer within the lease; connection abandoned"
                ) from exc
            except psycopg.OperationalError as exc:
                if attempt == 2 or (exc.sqlstate and not isinstance(exc, pg_errors.AdminShutdown)):
                    raise self._wrap(exc) from exc
                await self._held.reset_idle()
                continue
            except psycopg.Error as exc:
                raise self._wrap(exc) from exc
            if ok and state is not None:
                state.confirm(sent)
            return ok
        raise AssertionError("unreachable")  # pragma: no cover

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
        return await self._finalize(lease, JobSchedulerStatus.SUCCESS, data)

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
        return await self._finalize(lease, JobSchedulerStatus.FAIL, data)

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
        job_id, token = _check_lease(lease)
        params = (JobSchedulerStatus.SUCCESS.value, dump_json_object(data), job_id, token)
        cur = await conn.execute(self._sql.finalize, params)
        return cur.rowcount == 1

    async def status_of(self, lease: JobLease) -> JobSchedulerStatus | None:
        """Return the run's status if the row still carries this lease's token, else ``None``.

        Raises:
            JobSchedulerUnavailableError: The database could not be reached.
        """
        params = _check_lease(lease)
        try:
            row = await self._fetch(self._sql.read_status, params, _limit(lease))
        except _Abandoned as exc:
            raise JobSchedulerUnavailableError(
                "the status read did not answer in time; connection abandoned"
            ) from exc
        except psycopg.Error as exc:
            raise self._wrap(exc) from exc
        return None if row is None else STATUS[row[0]]

    async def acquire_attempts(
        self, items: Sequence[tuple[JobAcquireOptions, AttemptBudget]]
    ) -> list[tuple[JobAcquireResult, int]]:
        """``acquire_attempt`` for many ticks in one statement; one result per item, in order.

        Each key is won or not exactly as by :meth:`acquire_attempt` (its attempt budget
        included), by exactly one of the replicas that race for it. See
        :mod:`sdcore.job_scheduler._tick_batch`.

        Raises:
            ValueError: Two items for one lock key, or more than 10,000 items (before any SQL).
            JobSchedulerUnavailableError: The database could not be reached.
            JobSchedulerDatabaseError: The database refused the statement.
        """
        from sdcore.job_scheduler._tick_batch import acquire_attempts

        return await acquire_attempts(self, items)
