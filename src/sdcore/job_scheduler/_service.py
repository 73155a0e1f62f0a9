"""``JobSchedulerService``: the lease on PostgreSQL (psycopg 3, psycopg_pool)."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from types import TracebackType
from typing import Any, Self, TypeVar, cast

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import AsyncConnectionPool

from sdcore._internal.identifiers import qualified
from sdcore._json import dump_json_object
from sdcore.job_scheduler._attempts import AttemptBudget, TickRecord, TickStatements
from sdcore.job_scheduler._base import SLACK, BaseJobScheduler
from sdcore.job_scheduler._model import (
    JobAcquired,
    JobAcquireResult,
    JobLease,
    JobNotAcquired,
    JobScheduler,
    JobSchedulerError,
    JobSchedulerStatus,
    JobSchedulerType,
    JobSchedulerUnavailableError,
    _check_lease,
    _check_lock_keys,
    _LeaseState,
)
from sdcore.job_scheduler._options import JobAcquireOptions, coerce_batch, coerce_options
from sdcore.job_scheduler._sql import LeaseStatements
from sdcore.postgres import (
    DatabaseConnectError,
    HeldConnections,
    PoolSettings,
    create_pool,
    migrate,
    open_pool,
    redact_text,
    schema_sql,
)

_T = TypeVar("_T")
_NOT_ACQUIRED = JobNotAcquired()
_STATUS = {member.value: member for member in JobSchedulerStatus}
_TYPE = {member.value: member for member in JobSchedulerType}
# A losing contender under a REPEATABLE READ / SERIALIZABLE default (should the session pin be
# bypassed, e.g. by a pooler) gets a serialization failure: that is "not acquired", not an error.
_LOSER_ERRORS = (pg_errors.SerializationFailure, pg_errors.DeadlockDetected)


class JobSchedulerDatabaseError(JobSchedulerError):
    """The database refused a lease statement (missing table, missing privilege, …).

    Attributes:
        sqlstate: The PostgreSQL error code, if any.
    """

    def __init__(self, message: str, sqlstate: str | None) -> None:
        self.sqlstate = sqlstate
        super().__init__(message)


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

    A timer per statement (``call_later`` + ``cancel``) cost ~8 µs, two per lease cycle. Here a
    statement costs a dict insert and a pop; a sweep every ``TICK`` seconds runs only while
    statements are in flight. A statement is abandoned between ``limit - TICK`` and ``limit``
    after it started, never later.
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


async def _one(cur: psycopg.AsyncCursor[Any]) -> tuple[Any, ...] | None:
    return await cur.fetchone()


async def _all(cur: psycopg.AsyncCursor[Any]) -> list[tuple[Any, ...]]:
    return await cur.fetchall()


async def _count(cur: psycopg.AsyncCursor[Any]) -> int:
    return cur.rowcount


def _row(r: tuple[Any, ...]) -> JobScheduler:
    return JobScheduler(
        id=r[0],
        lock_key=r[1],
        idempotency_key=r[2],
        code=r[3],
        name=r[4],
        type=_TYPE[r[5]],
        run_key=r[6],
        status=_STATUS[r[7]],
        owner_token=r[8],
        fencing_token=r[9],
        data=r[10],
        created_at=r[11],
        modified_at=r[12],
        lease_ms=r[13],
    )


def _acquired(r: tuple[Any, ...], state: _LeaseState) -> JobAcquired:
    row = _row(r)
    return JobAcquired(
        row=row,
        id=row.id,
        owner_token=row.owner_token,
        idempotency_key=row.idempotency_key,
        fencing_token=row.fencing_token,
        _state=state,
    )


def _by_lock_key(opts: JobAcquireOptions) -> str:
    return opts.lock_key


def _many_params(ordered: list[JobAcquireOptions], tokens: list[str]) -> tuple[list[Any], ...]:
    """The column arrays of ``acquire_many`` (items sorted by lock key)."""
    return (
        [o.lock_key for o in ordered],
        [o.idempotency_key for o in ordered],
        [o.code for o in ordered],
        [o.name for o in ordered],
        [str(o.type) for o in ordered],
        [o.run_key for o in ordered],
        tokens,
        [o.lease_ms for o in ordered],
    )


def _limit(lease: JobLease) -> float | None:
    """How long a finalize or status read of ``lease`` may take: its time left, plus the slack."""
    state: _LeaseState | None = getattr(lease, "_state", None)
    if state is None or state.deadline == float("inf"):
        return None
    return max(state.deadline - time.monotonic(), 0.0) + SLACK


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
        if isinstance(max_connections, bool) or not isinstance(max_connections, int):
            raise TypeError("max_connections must be an int")
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        if isinstance(statement_timeout_ms, bool) or not isinstance(statement_timeout_ms, int):
            raise TypeError("statement_timeout_ms must be an int")
        if not 0 <= statement_timeout_ms <= 2**31 - 1:
            raise ValueError(f"statement_timeout_ms out of range: {statement_timeout_ms}")
        self._table = table
        self._schema = schema
        self._sql = LeaseStatements.render(qualified(table, schema))
        self._tick_sql = TickStatements.render(qualified(table, schema))
        self._pool = pool
        # Never hold the pool's last connection: a handler using jobs.pool (or the application
        # sharing the pool) would otherwise wait for PoolTimeout while the service idles.
        pool_size = pool.max_size
        held = max_connections
        if pool_size >= 2 and held >= pool_size:
            held = pool_size - 1
        elif pool_size < 2:
            self._log.warning(
                "the lease service holds the only connection of its pool (max_size=%s): "
                "nothing else can use this pool; give it max_size >= 2 to share it",
                pool_size,
                extra={"action": "pool_too_small"},
            )
        self._max_connections = held
        self._watchdog = _Watchdog()
        self._held = HeldConnections(
            pool,
            size=held,
            statement_timeout_ms=statement_timeout_ms,
            transaction_pooling=transaction_pooling is True,
        )
        self._owned_pool = False

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
        """Return the held connections (and close the pool if :meth:`connect` opened it)."""
        await self._held.close()
        if self._owned_pool:
            await self._pool.close()

    @property
    def pool(self) -> AsyncConnectionPool[Any]:
        """The connection pool the service uses."""
        return self._pool

    def schema_sql(self) -> str:
        """Return the DDL of this service's table (what :meth:`ensure_schema` applies)."""
        return schema_sql(table=self._table, schema=self._schema)

    async def ensure_schema(self) -> None:
        """Apply the lease table's pending migrations; safe from N replicas at once.

        A table created by sdcore 0.1.0 is upgraded in place, every row kept.
        """
        # On a held connection: the held ones may be all the pool has (max_connections == max_size).
        conn = await self._held.get()
        try:
            await migrate(conn, "lease", table=self._table, schema=self._schema)
        except psycopg.Error as exc:
            await self._held.put(conn, broken=conn.broken)
            raise self._wrap(exc) from exc
        except BaseException:
            await self._held.put(conn, broken=conn.broken)
            raise
        await self._held.put(conn)

    def _wrap(self, exc: psycopg.Error) -> JobSchedulerError:
        sqlstate = exc.sqlstate
        if isinstance(exc, pg_errors.UndefinedTable):
            where = f" --schema {self._schema}" if self._schema else ""
            return JobSchedulerDatabaseError(
                f"table {self._table!r} does not exist: call ensure_schema() or run "
                f"`sdcore db upgrade --table {self._table}{where}`",
                sqlstate,
            )
        if isinstance(exc, psycopg.OperationalError) and not isinstance(
            exc, pg_errors.InsufficientPrivilege
        ):
            return JobSchedulerUnavailableError(
                f"database unavailable or statement timed out: {redact_text(str(exc))}"
            )
        return JobSchedulerDatabaseError(
            f"lease statement refused ({sqlstate}): {redact_text(str(exc))}", sqlstate
        )

    @property
    def max_connections(self) -> int:
        """Connections the service holds at most (always fewer than a shared pool's max_size)."""
        return self._max_connections

    async def _get(self, limit: float | None) -> psycopg.AsyncConnection[Any]:
        # An idle held connection is handed out without waiting: no timer on the hot path.
        if limit is None or self._held._idle:
            return await self._held.get()
        try:
            async with asyncio.timeout(max(limit, 0.0)):
                return await self._held.get()
        except TimeoutError:
            raise _Abandoned("no connection became free in time") from None

    async def _fetch(
        self, query: bytes, params: tuple[Any, ...], limit: float | None = None
    ) -> tuple[Any, ...] | None:
        return await self._run(query, params, limit, _one)

    async def _fetch_rows(
        self, query: bytes, params: tuple[Any, ...], limit: float | None = None
    ) -> list[tuple[Any, ...]]:
        return await self._run(query, params, limit, _all)

    async def _rowcount(
        self, query: bytes, params: tuple[Any, ...], limit: float | None = None
    ) -> int:
        return await self._run(query, params, limit, _count)

    async def _run(
        self,
        query: bytes,
        params: tuple[Any, ...],
        limit: float | None,
        read: Callable[[psycopg.AsyncCursor[Any]], Awaitable[_T]],
    ) -> _T:
        """Run one statement on a held connection, abandoned after ``limit`` seconds."""
        conn = await self._get(limit)
        if limit is not None:
            self._watchdog.watch(conn, limit)
        try:
            cur = await conn.execute(query, params)
            result = await read(cur)
        except BaseException as exc:
            abandoned = limit is not None and self._watchdog.done(conn)
            await self._held.put(conn, broken=conn.broken)
            if abandoned:
                raise _Abandoned("the statement did not answer in time") from exc
            raise
        if limit is not None and self._watchdog.done(conn):
            # Answered just as its socket was shut down: the result stands, the connection not.
            await self._held.put(conn, broken=True)
            return result
        self._held.release(conn)
        return result

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
        token = str(uuid.uuid4())
        params = (
            opts.lock_key,
            opts.idempotency_key,
            opts.code,
            opts.name,
            str(opts.type),
            opts.run_key,
            token,
            opts.lease_ms,
        )
        sent = time.monotonic()
        state = _LeaseState.for_lease(opts.lease_ms, sent)
        try:
            row = await self._fetch(self._sql.acquire, params, state.valid)
        except _LOSER_ERRORS:
            return _NOT_ACQUIRED
        except _Abandoned:
            self._log_abandoned(opts, "acquire")
            return _NOT_ACQUIRED
        except psycopg.OperationalError as exc:
            if not exc.sqlstate or isinstance(exc, pg_errors.AdminShutdown):
                return await self._acquire_again(opts, params, state, exc)
            raise self._wrap(exc) from exc
        except psycopg.Error as exc:
            raise self._wrap(exc) from exc
        except asyncio.CancelledError:
            await self._resolve_cancelled(opts, token, state)
            raise
        if row is None:
            return _NOT_ACQUIRED
        return await self._confirmed(opts, _acquired(row, state))

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
        batch = coerce_batch(options)
        if not batch:
            return []
        ordered = sorted(batch, key=_by_lock_key)
        tokens = [str(uuid.uuid4()) for _ in ordered]
        params = _many_params(ordered, tokens)
        sent = time.monotonic()
        limit = _LeaseState.for_lease(min(o.lease_ms for o in batch), sent).valid
        won: dict[str, tuple[tuple[Any, ...], float]] = {}
        try:
            rows = await self._fetch_rows(self._sql.acquire_many, params, limit)
        except _LOSER_ERRORS:
            rows = []
        except _Abandoned:
            self._log_abandoned_many(len(batch))
            rows = []
        except psycopg.OperationalError as exc:
            if exc.sqlstate and not isinstance(exc, pg_errors.AdminShutdown):
                raise self._wrap(exc) from exc
            won = await self._acquire_many_again(ordered, tokens, sent, limit, exc)
            rows = []
        except psycopg.Error as exc:
            raise self._wrap(exc) from exc
        except asyncio.CancelledError:
            await self._resolve_cancelled_many(ordered, tokens, sent, limit)
            raise
        for row in rows:
            won[row[1]] = (row, sent)
        results: list[JobAcquireResult] = []
        late: list[int] = []
        for opts in batch:
            hit = won.get(opts.lock_key)
            if hit is None:
                results.append(_NOT_ACQUIRED)
                continue
            result = _acquired(hit[0], _LeaseState.for_lease(opts.lease_ms, hit[1]))
            if result._state.time_left() < result._state.valid / 2:
                late.append(len(results))
            results.append(result)
        if late:
            await self._confirm_many(batch, results, late)
        return results

    async def _confirm_many(
        self, batch: list[JobAcquireOptions], results: list[JobAcquireResult], late: list[int]
    ) -> None:
        """Confirm the won leases at ``late`` (see :meth:`_confirmed`), in place."""
        try:
            confirmed = await asyncio.gather(
                *(self._confirmed(batch[i], cast("JobAcquired", results[i])) for i in late)
            )
        except asyncio.CancelledError:
            # The late ones give themselves back in _confirmed; the others are ours to return.
            await asyncio.gather(
                *(
                    self._fail_quietly(result.lease, batch[i])
                    for i, result in enumerate(results)
                    if result.acquired and i not in late
                ),
                return_exceptions=True,
            )
            raise
        for i, result in zip(late, confirmed, strict=True):
            results[i] = result

    async def _acquire_many_again(
        self,
        ordered: list[JobAcquireOptions],
        tokens: list[str],
        sent: float,
        limit: float,
        first: psycopg.Error,
    ) -> dict[str, tuple[tuple[Any, ...], float]]:
        """The batch's connection broke: keep the keys our tokens show, try the others again."""
        await self._held.reset_idle()
        keys = [o.lock_key for o in ordered]
        won: dict[str, tuple[tuple[Any, ...], float]] = {}
        try:
            left = max(sent + limit - time.monotonic(), 0.0)
            for row in await self._fetch_rows(self._sql.read_owned_many, (keys, tokens), left):
                if row[7] == JobSchedulerStatus.RUNNING.value:
                    won[row[1]] = (row, sent)
            rest = [i for i, key in enumerate(keys) if key not in won]
            if rest:
                again = [ordered[i] for i in rest]
                params = _many_params(again, [tokens[i] for i in rest])
                resent = time.monotonic()
                for row in await self._fetch_rows(self._sql.acquire_many, params, limit):
                    won[row[1]] = (row, resent)
        except _LOSER_ERRORS:
            pass
        except _Abandoned:
            self._log_abandoned_many(len(ordered))
        except psycopg.Error as exc:
            raise self._wrap(exc) from first
        return won

    async def _resolve_cancelled_many(
        self, ordered: list[JobAcquireOptions], tokens: list[str], sent: float, limit: float
    ) -> None:
        """Cancelled mid-batch: find the keys we won, and give each of them back."""
        keys = [o.lock_key for o in ordered]
        left = max(sent + limit - time.monotonic(), 0.0) + SLACK
        try:
            rows = await self._fetch_rows(self._sql.read_owned_many, (keys, tokens), left)
        except (psycopg.Error, _Abandoned) as exc:
            self._log.warning(
                "acquire_many of %d runs cancelled with an unknown outcome (rows it wrote "
                "expire with their leases): %s",
                len(keys),
                redact_text(str(exc)),
                extra={"action": "acquire_cancelled_unknown"},
            )
            return
        by_key = {o.lock_key: o for o in ordered}
        await asyncio.gather(
            *(
                self._fail_quietly(
                    _acquired(row, _LeaseState.for_lease(by_key[row[1]].lease_ms, sent)).lease,
                    by_key[row[1]],
                )
                for row in rows
                if row[7] == JobSchedulerStatus.RUNNING.value
            )
        )

    def _log_abandoned_many(self, count: int) -> None:
        self._log.warning(
            "acquire_many of %d runs did not answer within the shortest lease; connection "
            "abandoned",
            count,
            extra={"action": "statement_abandoned"},
        )

    async def _confirmed(self, opts: JobAcquireOptions, won: JobAcquired) -> JobAcquireResult:
        """Report ``won`` only with at least half its client lease left; else confirm it."""
        state = won._state
        if state.time_left() >= state.valid / 2:
            return won
        # The round trip used up more than half the lease (a slow commit, a stalled network):
        # the row may be about to expire, or have expired already. A fenced heartbeat renews it
        # from the moment it is sent, or proves it was lost.
        try:
            ok = await self.heartbeat(won.lease)
        except JobSchedulerError:
            ok = False
        except asyncio.CancelledError:
            await self._fail_quietly(won.lease, opts)
            raise
        if ok and state.time_left() >= state.valid / 2:
            return won
        self._log.warning(
            "job %r run %r: acquire answered too late to keep its lease; not acquired",
            opts.code,
            opts.run_key,
            extra={"action": "acquire_too_late", "job_code": opts.code, "run_key": opts.run_key},
        )
        await self._fail_quietly(won.lease, opts)
        return _NOT_ACQUIRED

    async def _fail_quietly(self, lease: JobLease, opts: JobAcquireOptions) -> None:
        """Mark a row this acquire owns but will not report ``FAIL``, within the slack."""
        try:
            job_id, token = _check_lease(lease)
            await self._rowcount(
                self._sql.finalize,
                (JobSchedulerStatus.FAIL.value, '{"error": "acquire abandoned"}', job_id, token),
                SLACK,
            )
        except (psycopg.Error, _Abandoned) as exc:
            self._log.warning(
                "job %r run %r: could not release an abandoned acquire (it expires with its "
                "lease): %s",
                opts.code,
                opts.run_key,
                redact_text(str(exc)),
                extra={"action": "acquire_release_failed", "job_code": opts.code},
            )

    async def _resolve_cancelled(
        self, opts: JobAcquireOptions, token: str, state: _LeaseState
    ) -> None:
        """The caller was cancelled mid-acquire: find out whether it won, and give the run back."""
        limit = max(state.time_left(), 0.0) + SLACK
        try:
            row = await self._fetch(self._sql.read_owned, (opts.lock_key, token), limit)
        except (psycopg.Error, _Abandoned) as exc:
            self._log.warning(
                "job %r run %r: acquire cancelled with an unknown outcome (a row it wrote "
                "expires with its lease): %s",
                opts.code,
                opts.run_key,
                redact_text(str(exc)),
                extra={"action": "acquire_cancelled_unknown", "job_code": opts.code},
            )
            return
        if row is not None and row[7] == JobSchedulerStatus.RUNNING.value:
            await self._fail_quietly(_acquired(row, state).lease, opts)

    def _log_abandoned(self, opts: JobAcquireOptions, what: str) -> None:
        self._log.warning(
            "job %r run %r: %s did not answer within the lease; connection abandoned",
            opts.code,
            opts.run_key,
            what,
            extra={"action": "statement_abandoned", "job_code": opts.code, "run_key": opts.run_key},
        )

    async def _acquire_again(
        self,
        opts: JobAcquireOptions,
        params: tuple[Any, ...],
        state: _LeaseState,
        first: psycopg.Error,
    ) -> JobAcquireResult:
        # The connection broke: the statement may or may not have committed. Our token is in
        # the row only if it did; otherwise the same statement is a fresh, safe attempt (whose
        # lease then runs from when it is sent).
        await self._held.reset_idle()
        try:
            row = await self._fetch(
                self._sql.read_owned, (opts.lock_key, params[6]), max(state.time_left(), 0.0)
            )
            if row is None:
                sent = time.monotonic()
                state = _LeaseState.for_lease(opts.lease_ms, sent)
                row = await self._fetch(self._sql.acquire, params, state.valid)
        except _LOSER_ERRORS:
            return _NOT_ACQUIRED
        except _Abandoned:
            self._log_abandoned(opts, "acquire")
            return _NOT_ACQUIRED
        except psycopg.Error as exc:
            raise self._wrap(exc) from first
        if row is None or row[7] != JobSchedulerStatus.RUNNING.value:
            return _NOT_ACQUIRED
        return await self._confirmed(opts, _acquired(row, state))

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
        return {key: _STATUS[status] for key, status in rows}

    async def _fetch_all(self, query: bytes, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """Run a read on a held connection; a driver error becomes the service's error."""
        try:
            return await self._fetch_rows(query, params)
        except psycopg.Error as exc:
            raise self._wrap(exc) from exc

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
        return None if row is None else _STATUS[row[0]]

    # --- scheduler tick operations (sdcore.scheduling; see _attempts.py) ---------------------

    async def acquire_attempt(
        self, options: JobAcquireOptions, budget: AttemptBudget
    ) -> tuple[JobAcquireResult, int]:
        """``acquire`` within a tick's attempt budget (needs migration ``lease/0003``).

        Raises:
            JobSchedulerUnavailableError: The database could not be reached.
            JobSchedulerDatabaseError: The database refused the statement (e.g. no
                ``attempts`` column: run ``sdcore db upgrade``).
        """
        token = str(uuid.uuid4())
        params = (
            options.lock_key,
            options.idempotency_key,
            options.code,
            options.name,
            str(options.type),
            options.run_key,
            token,
            options.lease_ms,
            budget.max_attempts,
            budget.backoff_ms,
        )
        sent = time.monotonic()
        state = _LeaseState.for_lease(options.lease_ms, sent)
        try:
            row = await self._fetch(self._tick_sql.acquire_attempt, params, state.valid)
        except _LOSER_ERRORS:
            return _NOT_ACQUIRED, 0
        except _Abandoned:
            self._log_abandoned(options, "acquire")
            return _NOT_ACQUIRED, 0
        except psycopg.OperationalError as exc:
            if exc.sqlstate and not isinstance(exc, pg_errors.AdminShutdown):
                raise self._wrap(exc) from exc
            # Ambiguous commit: our token is in the row only if the statement committed.
            await self._held.reset_idle()
            try:
                owned = await self._fetch(
                    self._sql.read_owned, (options.lock_key, token), max(state.time_left(), 0.0)
                )
            except _Abandoned:
                return _NOT_ACQUIRED, 0
            except psycopg.Error as again:
                raise self._wrap(again) from exc
            if owned is None or owned[7] != JobSchedulerStatus.RUNNING.value:
                return _NOT_ACQUIRED, 0
            records = await self.tick_records([options.lock_key])
            record = records.get(options.lock_key)
            result = await self._confirmed(options, _acquired(owned, state))
            if not result.acquired:
                return _NOT_ACQUIRED, 0
            return result, 1 if record is None else record.attempts
        except psycopg.Error as exc:
            raise self._wrap(exc) from exc
        except asyncio.CancelledError:
            await self._resolve_cancelled(options, token, state)
            raise
        if row is None:
            return _NOT_ACQUIRED, 0
        result = await self._confirmed(options, _acquired(row[:-1], state))
        return (result, int(row[-1])) if result.acquired else (_NOT_ACQUIRED, 0)

    async def record_skipped(self, options: JobAcquireOptions, reason: str) -> bool:
        """Record a tick as skipped (``FAIL``, 0 attempts) if it has no row; ``True`` if written.

        Raises:
            JobSchedulerUnavailableError: The database could not be reached.
        """
        params = (
            options.lock_key,
            options.idempotency_key,
            options.code,
            options.name,
            str(options.type),
            options.run_key,
            str(uuid.uuid4()),
            dump_json_object({"skipped": reason}),
        )
        try:
            return await self._rowcount(self._tick_sql.record_skipped, params) == 1
        except psycopg.Error as exc:
            raise self._wrap(exc) from exc

    async def first_seen(self, code: str) -> datetime | None:
        """Return when the oldest row of ``code`` was created, if any.

        Raises:
            JobSchedulerUnavailableError: The database could not be reached.
        """
        try:
            row = await self._fetch(self._tick_sql.first_seen, (code,))
        except psycopg.Error as exc:
            raise self._wrap(exc) from exc
        return None if row is None else row[0]

    async def tick_records(self, lock_keys: Sequence[str]) -> dict[str, TickRecord]:
        """Return what the table says about each tick that has a row, by ``lock_key``.

        Raises:
            ValueError: As for :meth:`statuses` (the same check, before any SQL).
            JobSchedulerUnavailableError: The database could not be reached.
        """
        keys = _check_lock_keys(lock_keys)
        if not keys:
            return {}
        rows = await self._fetch_all(self._tick_sql.tick_records, (keys,))
        return {
            key: TickRecord(
                status=_STATUS[status],
                attempts=attempts,
                skipped=skipped,
                released=bool(released),
                age_ms=float(age),
            )
            for key, status, attempts, skipped, released, age in rows
        }

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

    async def _finalize(
        self, lease: JobLease, status: JobSchedulerStatus, data: Mapping[str, Any] | None
    ) -> bool:
        job_id, token = _check_lease(lease)
        text = dump_json_object(data)
        params = (status.value, text, job_id, token)
        # Bounded by the lease's time left plus the slack: an answer that does not come back by
        # then is never reported as recorded.
        limit = _limit(lease)
        until = None if limit is None else time.monotonic() + limit
        try:
            return await self._rowcount(self._sql.finalize, params, limit) == 1
        except _Abandoned as exc:
            raise JobSchedulerUnavailableError(
                f"recording {status.value} did not answer in time; connection abandoned, "
                "outcome unknown"
            ) from exc
        except psycopg.OperationalError as exc:
            if exc.sqlstate and not isinstance(exc, pg_errors.AdminShutdown):
                raise self._wrap(exc) from exc
            first: psycopg.Error = exc
        except psycopg.Error as exc:
            raise self._wrap(exc) from exc
        # Ambiguous commit: never report success unless the row shows it.
        await self._held.reset_idle()
        left = None if until is None else until - time.monotonic()
        try:
            row = await self._fetch(self._sql.read_status, (job_id, token), left)
            if row is None:
                return False
            if row[0] == status.value:
                return True
            if row[0] != JobSchedulerStatus.RUNNING.value:
                return False
            left = None if until is None else until - time.monotonic()
            return await self._rowcount(self._sql.finalize, params, left) == 1
        except _Abandoned as exc:
            raise JobSchedulerUnavailableError(
                f"recording {status.value}: outcome unknown, the database did not answer in time"
            ) from exc
        except psycopg.Error as exc:
            raise self._wrap(exc) from first
