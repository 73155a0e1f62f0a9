"""The PostgreSQL lease's machinery: held connections, bounded statements, confirmations.

``JobSchedulerService`` (``_service.py``) is built on :class:`_LeaseCore`, together with its
batch (``_batch.py``) and scheduler tick (``_ticks.py``) operations.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import AsyncConnectionPool

from sdcore._internal.identifiers import qualified
from sdcore._json import dump_json_object
from sdcore.job_scheduler._attempts import given_back
from sdcore.job_scheduler._base import BaseJobScheduler
from sdcore.job_scheduler._finals import Finals, Params, outcome_unknown
from sdcore.job_scheduler._model import (
    JobAcquired,
    JobAcquireResult,
    JobLease,
    JobNotAcquired,
    JobScheduler,
    JobSchedulerError,
    JobSchedulerStatus,
    JobSchedulerUnavailableError,
    _check_lease,
    _LeaseState,
)
from sdcore.job_scheduler._options import JobAcquireOptions
from sdcore.job_scheduler._run import SLACK
from sdcore.job_scheduler._sql import LeaseStatements, TickStatements, fencing_sequence
from sdcore.job_scheduler._watchdog import _Abandoned, _Watchdog
from sdcore.postgres import HeldConnections, redact_text

_T = TypeVar("_T")
NOT_ACQUIRED = JobNotAcquired()
STATUS = {member.value: member for member in JobSchedulerStatus}
RUNNING = JobSchedulerStatus.RUNNING.value
# A losing contender under a REPEATABLE READ / SERIALIZABLE default (should the session pin be
# bypassed, e.g. by a pooler) gets a serialization failure: that is "not acquired", not an error.
LOSER_ERRORS = (pg_errors.SerializationFailure, pg_errors.DeadlockDetected)


class JobSchedulerDatabaseError(JobSchedulerError):
    """The database refused a lease statement (missing table, missing privilege, …).

    Attributes:
        sqlstate: The PostgreSQL error code, if any.
    """

    def __init__(self, message: str, sqlstate: str | None) -> None:
        self.sqlstate = sqlstate
        super().__init__(message)


# Clean-ups of cancelled acquires still running after their caller stopped waiting.
_SETTLING: set[asyncio.Future[None]] = set()


async def settle(cleanup: Awaitable[None]) -> None:
    """Run a cancelled caller's clean-up (bounded by its own limits) to its end.

    It is shielded: a second cancellation of the caller stops the wait, never the clean-up,
    which then finishes in the background (a won row is still given back).
    """
    task = asyncio.ensure_future(cleanup)
    _SETTLING.add(task)
    task.add_done_callback(_SETTLING.discard)
    await asyncio.shield(task)


async def _one(cur: psycopg.AsyncCursor[Any]) -> tuple[Any, ...] | None:
    return await cur.fetchone()


async def _all(cur: psycopg.AsyncCursor[Any]) -> list[tuple[Any, ...]]:
    return await cur.fetchall()


async def _count(cur: psycopg.AsyncCursor[Any]) -> int:
    return cur.rowcount


def won(opts: JobAcquireOptions, token: str, r: tuple[Any, ...], state: _LeaseState) -> JobAcquired:
    """The lease won by ``opts`` with owner ``token``, from what the acquire returned.

    ``r`` is ``(id, fencing_token, idempotency_key, created_at, modified_at)``: the rest of the
    row is what the caller sent (lease.sql says why).
    """
    row = JobScheduler(
        id=r[0],
        lock_key=opts.lock_key,
        idempotency_key=r[2],
        code=opts.code,
        name=opts.name,
        type=opts.type,  # type: ignore[arg-type]  # a JobSchedulerType after validation
        run_key=opts.run_key,
        status=JobSchedulerStatus.RUNNING,
        owner_token=token,
        fencing_token=r[1],
        data=None,
        created_at=r[3],
        modified_at=r[4],
        lease_ms=opts.lease_ms,
    )
    return JobAcquired(
        row=row,
        id=row.id,
        owner_token=token,
        idempotency_key=row.idempotency_key,
        fencing_token=row.fencing_token,
        _state=state,
    )


def identity_params(opts: JobAcquireOptions, token: str) -> tuple[Any, ...]:
    """The first parameters of every insert into the lease table, in the statements' order."""
    return (
        opts.lock_key,
        opts.idempotency_key,
        opts.code,
        opts.name,
        str(opts.type),
        opts.run_key,
        token,
    )


def _limit(lease: JobLease) -> float | None:
    """How long a finalize or status read of ``lease`` may take: its time left, plus the slack."""
    state: _LeaseState | None = getattr(lease, "_state", None)
    if state is None or state.deadline == float("inf"):
        return None
    return max(state.deadline - time.monotonic(), 0.0) + SLACK


def _final_params(
    lease: JobLease, status: JobSchedulerStatus, data: Mapping[str, Any] | None
) -> tuple[Params, float | None]:
    """``finalize``'s parameters and time limit: bounded by the lease's time left plus the
    slack (an answer that does not come back by then is never reported as recorded)."""
    job_id, token = _check_lease(lease)
    return (status.value, dump_json_object(data), job_id, token), _limit(lease)


class _LeaseCore(BaseJobScheduler):
    """What every lease operation on PostgreSQL shares (see ``JobSchedulerService``)."""

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
        self._sequence_sql = fencing_sequence(qualified(table, schema))
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
        self._finals = Finals(self._finalize_one, self._finalize_resolve, self._finalize_many, held)

    @property
    def pool(self) -> AsyncConnectionPool[Any]:
        """The connection pool the service uses."""
        return self._pool

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

    async def _fetch_all(self, query: bytes, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """Run a read on a held connection; a driver error becomes the service's error."""
        try:
            return await self._fetch_rows(query, params)
        except psycopg.Error as exc:
            raise self._wrap(exc) from exc

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
            await self._fail_quietly(won.lease, opts, "cancelled")
            raise
        if ok and state.time_left() >= state.valid / 2:
            return won
        self._log.warning(
            "job %r run %r: acquire answered too late to keep its lease; not acquired",
            opts.code,
            opts.run_key,
            extra={"action": "acquire_too_late", "job_code": opts.code, "run_key": opts.run_key},
        )
        await self._fail_quietly(won.lease, opts, "acquire answered too late")
        return NOT_ACQUIRED

    async def _fail_quietly(
        self, lease: JobLease, opts: JobAcquireOptions, reason: str, limit: float = SLACK
    ) -> None:
        """Give back a row this acquire owns but will not report, within the slack.

        ``FAIL`` with ``given_back = reason`` (a column, never the caller's data): a plain
        ``acquire`` takes a ``FAIL`` row at once, and a scheduled tick's ``acquire_attempt``
        takes a given-back one at once with the same attempt number (the run never started,
        so it must not use up the tick's budget).
        """
        try:
            job_id, token = _check_lease(lease)
            data = dump_json_object(given_back(reason))
            await self._rowcount(self._sql.reopen, (data, None, reason, job_id, token), limit)
        except (psycopg.Error, _Abandoned) as exc:
            self._warn(
                opts,
                "could not release an abandoned acquire (it expires with its lease)",
                "acquire_release_failed",
                exc,
            )

    async def _resolve_cancelled(
        self, opts: JobAcquireOptions, token: str, state: _LeaseState
    ) -> None:
        """The caller was cancelled mid-acquire: find out whether it won, and give the run back."""
        limit = max(state.time_left(), 0.0) + SLACK
        try:
            row = await self._fetch(self._sql.read_owned, (opts.lock_key, token), limit)
        except (psycopg.Error, _Abandoned) as exc:
            self._warn(
                opts,
                "acquire cancelled with an unknown outcome (a row it wrote expires with its lease)",
                "acquire_cancelled_unknown",
                exc,
            )
            return
        if row is not None and row[0] == RUNNING:
            # As long as the row's lease may still hold it: given back, another replica takes
            # the run now instead of when the lease passes.
            limit = max(state.time_left(), 0.0) + SLACK
            lease = JobLease(id=row[1], owner_token=token)
            await self._fail_quietly(lease, opts, "cancelled", limit)

    def _warn(self, opts: JobAcquireOptions, what: str, action: str, exc: BaseException) -> None:
        self._log.warning(
            "job %r run %r: %s: %s",
            opts.code,
            opts.run_key,
            what,
            redact_text(str(exc)),
            extra={"action": action, "job_code": opts.code},
        )

    async def _acquire_row(
        self, opts: JobAcquireOptions, query: bytes, params: tuple[Any, ...], limit: float
    ) -> tuple[Any, ...] | None:
        """Send an acquire; ``None`` if lost (also a loser's serialization failure, or no
        answer within the lease: the connection is then abandoned)."""
        try:
            return await self._fetch(query, params, limit)
        except LOSER_ERRORS:
            return None
        except _Abandoned:
            self._log_abandoned(opts, "acquire")
            return None

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
        token = params[6]
        try:
            owned = await self._fetch(
                self._sql.read_owned, (opts.lock_key, token), max(state.time_left(), 0.0)
            )
            if owned is not None:
                if owned[0] != RUNNING:
                    return NOT_ACQUIRED
                row: tuple[Any, ...] | None = owned[1:]
            else:
                sent = time.monotonic()
                state = _LeaseState.for_lease(opts.lease_ms, sent)
                row = await self._acquire_row(opts, self._sql.acquire, params, state.valid)
        except _Abandoned:
            self._log_abandoned(opts, "acquire")
            return NOT_ACQUIRED
        except psycopg.Error as exc:
            raise self._wrap(exc) from first
        if row is None:
            return NOT_ACQUIRED
        return await self._confirmed(opts, won(opts, token, row, state))

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
        limit = _limit(lease)
        until = None if limit is None else time.monotonic() + limit
        try:
            return await self._rowcount(self._sql.reopen, params, limit) == 1
        except _Abandoned as exc:
            raise outcome_unknown(JobSchedulerStatus.FAIL.value) from exc
        except psycopg.OperationalError as exc:
            if exc.sqlstate and not isinstance(exc, pg_errors.AdminShutdown):
                raise self._wrap(exc) from exc
            first: psycopg.Error = exc
        except psycopg.Error as exc:
            raise self._wrap(exc) from exc
        await self._held.reset_idle()
        try:
            left = None if until is None else max(until - time.monotonic(), 0.0)
            row = await self._fetch(self._sql.read_status, (job_id, token), left)
            if row is None or row[0] != JobSchedulerStatus.RUNNING.value:
                return row is not None and row[0] == JobSchedulerStatus.FAIL.value
            left = None if until is None else max(until - time.monotonic(), 0.0)
            return await self._rowcount(self._sql.reopen, params, left) == 1
        except _Abandoned as exc:
            raise outcome_unknown(JobSchedulerStatus.FAIL.value) from exc
        except psycopg.Error as exc:
            raise self._wrap(exc) from first

    async def _finalize(
        self, lease: JobLease, status: JobSchedulerStatus, data: Mapping[str, Any] | None
    ) -> bool:
        params, limit = _final_params(lease, status, data)
        return await self._finals.record(params, limit)

    def _finalize_soon(
        self, lease: JobLease, status: JobSchedulerStatus, data: Mapping[str, Any] | None
    ) -> asyncio.Future[bool]:
        """Record the outcome with the others recorded meanwhile (``_finals.py``); the future
        of its answer (no task of its own when it joins a queue).

        Raises:
            ValueError, JsonTypeError, JsonValueError: A bad lease or ``data``, before any SQL.
        """
        params, limit = _final_params(lease, status, data)
        if self._finals.free:
            return asyncio.ensure_future(self._finals.record(params, limit))
        return self._finals.submit(params, limit)

    async def _finalize_one(self, params: Params, limit: float | None) -> bool:
        """The single-row ``finalize`` (what a batch of one sends)."""
        until = None if limit is None else time.monotonic() + limit
        try:
            return await self._rowcount(self._sql.finalize, params, limit) == 1
        except _Abandoned as exc:
            raise outcome_unknown(params[0]) from exc
        except psycopg.OperationalError as exc:
            if exc.sqlstate and not isinstance(exc, pg_errors.AdminShutdown):
                raise self._wrap(exc) from exc
            return await self._finalize_resolve(params, until, exc)
        except psycopg.Error as exc:
            raise self._wrap(exc) from exc

    async def _finalize_resolve(
        self, params: Params, until: float | None, first: psycopg.Error
    ) -> bool:
        """An ambiguous commit of ``finalize``: never report success unless the row shows it."""
        status, _, job_id, token = params
        await self._held.reset_idle()
        left = None if until is None else max(until - time.monotonic(), 0.0)
        try:
            row = await self._fetch(self._sql.read_status, (job_id, token), left)
            if row is None:
                return False
            if row[0] == status:
                return True
            if row[0] != JobSchedulerStatus.RUNNING.value:
                return False
            left = None if until is None else max(until - time.monotonic(), 0.0)
            return await self._rowcount(self._sql.finalize, params, left) == 1
        except _Abandoned as exc:
            raise JobSchedulerUnavailableError(
                f"recording {status}: outcome unknown, the database did not answer in time"
            ) from exc
        except psycopg.Error as exc:
            raise self._wrap(exc) from first

    async def _finalize_many(self, columns: tuple[list[Any], ...], limit: float | None) -> set[str]:
        """Send ``finalize_many``; the ids it updated (driver errors are the batcher's)."""
        rows = await self._fetch_rows(self._sql.finalize_many, columns, limit)
        return {row[0] for row in rows}
