"""The PostgreSQL lease's statement engine: held connections, bounded statements, and what a
failed statement means.

``JobSchedulerService`` (``_service.py``) holds one :class:`LeaseEngine` and two collaborators
over it: the acquires (``_acquire.py``) and the outcomes recorded together (``_finals.py``).
Every lease statement fails in one of these ways, told apart in :meth:`LeaseEngine.statement`:

- *lost*: a losing contender's serialization failure or deadlock (only an acquire may lose);
- *abandoned*: no answer within its limit, so its connection was shut down under it
  (``_watchdog.py``): an acquire reports its keys not acquired, anything else raises
  ``JobSchedulerUnavailableError``;
- *refused*: the server answered with an error (nothing was committed): the service's error;
- *ambiguous*: the connection broke mid-statement (no SQLSTATE, or an administrator's shutdown),
  so it may or may not have committed: resolved on a fresh connection by what the row shows
  under our owner token, never reported as done unless it shows it;
- *cancelled*: the caller stopped waiting; an acquire gives back what its tokens turned out to
  win (``_acquire.py``), an outcome is recorded or not as the statement decides.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import AsyncConnectionPool

from sdcore._internal.identifiers import qualified
from sdcore._internal.validation import at_least, int_between
from sdcore.job_scheduler._model import (
    JobLease,
    JobSchedulerError,
    JobSchedulerStatus,
    JobSchedulerUnavailableError,
    _check_lease,
    _LeaseState,
)
from sdcore.job_scheduler._run import SLACK
from sdcore.job_scheduler._sql import (
    LeaseStatements,
    TickBatchStatements,
    TickStatements,
    fencing_sequence,
)
from sdcore.job_scheduler._watchdog import _Abandoned, _Watchdog
from sdcore.postgres import HeldConnections, redact_text

_T = TypeVar("_T")
STATUS = {member.value: member for member in JobSchedulerStatus}
RUNNING = JobSchedulerStatus.RUNNING.value
# A losing contender under a REPEATABLE READ / SERIALIZABLE default (should the session pin be
# bypassed, e.g. by a pooler) gets a serialization failure: that is "not acquired", not an error.
LOSER_ERRORS = (pg_errors.SerializationFailure, pg_errors.DeadlockDetected)
# (status, data as JSON text or None, job id, owner token): the parameters of `finalize`.
Params = tuple[str, str | None, str, str]
_REFUSED: Any = object()  # statement(lost=...) default: a loser's error is a refusal
_UNKNOWN = {
    status.value: f"recording {status.value} did not answer in time; connection abandoned, "
    "outcome unknown"
    for status in JobSchedulerStatus
}


class JobSchedulerDatabaseError(JobSchedulerError):
    """The database refused a lease statement (missing table, missing privilege, …).

    Attributes:
        sqlstate: The PostgreSQL error code, if any.
    """

    def __init__(self, message: str, sqlstate: str | None) -> None:
        self.sqlstate = sqlstate
        super().__init__(message)


def ambiguous(exc: psycopg.Error) -> bool:
    """The connection broke under the statement: it may or may not have committed."""
    return isinstance(exc, psycopg.OperationalError) and (
        not exc.sqlstate or isinstance(exc, pg_errors.AdminShutdown)
    )


def outcome_unknown(status: str) -> JobSchedulerUnavailableError:
    """The error of a finalize (single or batched) abandoned without an answer."""
    return JobSchedulerUnavailableError(_UNKNOWN[status])


def lease_limit(lease: JobLease) -> float | None:
    """How long a finalize or status read of ``lease`` may take: its time left, plus the slack
    (an answer that does not come back by then is never reported as recorded)."""
    state: _LeaseState | None = getattr(lease, "_state", None)
    if state is None or state.deadline == float("inf"):
        return None
    return max(state.deadline - time.monotonic(), 0.0) + SLACK


def _unanswered(unanswered: str | Callable[[], _T], exc: _Abandoned) -> _T:
    if isinstance(unanswered, str):
        raise JobSchedulerUnavailableError(unanswered) from exc
    return unanswered()


def _left(until: float | None) -> float | None:
    return None if until is None else max(until - time.monotonic(), 0.0)


async def _one(cur: psycopg.AsyncCursor[Any]) -> tuple[Any, ...] | None:
    return await cur.fetchone()


async def _all(cur: psycopg.AsyncCursor[Any]) -> list[tuple[Any, ...]]:
    return await cur.fetchall()


async def _count(cur: psycopg.AsyncCursor[Any]) -> int:
    return cur.rowcount


class LeaseEngine:
    """The lease's statements on PostgreSQL: where they run, how long they may take, and what
    their failures mean (see the module). Arguments as for ``JobSchedulerService``."""

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        *,
        table: str,
        schema: str | None,
        max_connections: int,
        statement_timeout_ms: int,
        transaction_pooling: bool,
        log: logging.Logger,
    ) -> None:
        at_least("max_connections", max_connections, 1)
        int_between("statement_timeout_ms", statement_timeout_ms, 0, 2**31 - 1)
        self.log = log
        self.table = table
        self.schema = schema
        name = qualified(table, schema)
        self.sql = LeaseStatements.render(name)
        self.tick_sql = TickStatements.render(name)
        self.batch_sql = TickBatchStatements.render(name)
        self.sequence_sql = fencing_sequence(name)
        self.pool = pool
        # Never hold the pool's last connection: a handler using jobs.pool (or the application
        # sharing the pool) would otherwise wait for PoolTimeout while the service idles.
        pool_size = pool.max_size
        held = max_connections
        if pool_size >= 2 and held >= pool_size:
            held = pool_size - 1
        elif pool_size < 2:
            log.warning(
                "the lease service holds the only connection of its pool (max_size=%s): "
                "nothing else can use this pool; give it max_size >= 2 to share it",
                pool_size,
                extra={"action": "pool_too_small"},
            )
        self.max_connections = held
        # Prepared at first use: a replica sends each lease statement a few times a minute, and
        # psycopg's default (prepared at the fifth use per connection) would leave the server
        # parsing and planning it on every send. A transaction-mode pooler allows none.
        self._prepare = not transaction_pooling
        self._watchdog = _Watchdog()
        self.held = HeldConnections(
            pool,
            size=held,
            statement_timeout_ms=statement_timeout_ms,
            transaction_pooling=transaction_pooling is True,
        )

    def wrap(self, exc: psycopg.Error) -> JobSchedulerError:
        """The service's error for a driver error (wrapped once, here)."""
        sqlstate = exc.sqlstate
        if isinstance(exc, pg_errors.UndefinedTable):
            where = f" --schema {self.schema}" if self.schema else ""
            return JobSchedulerDatabaseError(
                f"table {self.table!r} does not exist: call ensure_schema() or run "
                f"`sdcore db upgrade --table {self.table}{where}`",
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

    async def statement(
        self,
        send: Awaitable[_T],
        *,
        resolve: Callable[[], Awaitable[_T]] | None = None,
        unanswered: str | Callable[[], _T] = "the database did not answer in time",
        lost: _T = _REFUSED,
    ) -> _T:
        """Await ``send`` (one bounded lease statement) and settle what its failure means.

        Args:
            send: The statement.
            resolve: After an ambiguous commit, on a fresh connection: what the row shows under
                our token (and, where safe, the statement once more). ``None``: the statement
                changes nothing, an ambiguous failure is an error like any other.
            unanswered: No answer in time: the message of the ``JobSchedulerUnavailableError``
                to raise, or what to return instead (called).
            lost: What a losing contender's error means (acquires); by default a refusal.

        Raises:
            JobSchedulerUnavailableError: No answer in time, or the database is unreachable.
            JobSchedulerDatabaseError: The database refused the statement.
        """
        try:
            return await send
        except _Abandoned as exc:
            return _unanswered(unanswered, exc)
        except psycopg.Error as exc:
            if lost is not _REFUSED and isinstance(exc, LOSER_ERRORS):
                return lost
            if resolve is None or not ambiguous(exc):
                raise self.wrap(exc) from exc
            first = exc
        return await self.resolve(first, resolve, unanswered)

    async def resolve(
        self,
        first: psycopg.Error,
        resolve: Callable[[], Awaitable[_T]],
        unanswered: str | Callable[[], _T],
    ) -> _T:
        """Settle an ambiguous commit (``first``) with ``resolve``, on a fresh connection."""
        await self.held.reset_idle()
        try:
            return await resolve()
        except _Abandoned as exc:
            return _unanswered(unanswered, exc)
        except psycopg.Error as exc:
            raise self.wrap(exc) from first

    async def _get(self, limit: float | None) -> psycopg.AsyncConnection[Any]:
        # An idle held connection is handed out without waiting: no timer on the hot path.
        if limit is None or self.held._idle:
            return await self.held.get()
        try:
            async with asyncio.timeout(max(limit, 0.0)):
                return await self.held.get()
        except TimeoutError:
            raise _Abandoned("no connection became free in time") from None

    async def fetch(
        self, query: bytes, params: tuple[Any, ...], limit: float | None = None
    ) -> tuple[Any, ...] | None:
        return await self._run(query, params, limit, _one)

    async def rows(
        self, query: bytes, params: tuple[Any, ...], limit: float | None = None
    ) -> list[tuple[Any, ...]]:
        return await self._run(query, params, limit, _all)

    async def rowcount(
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
            cur = await conn.execute(query, params, prepare=self._prepare)
            result = await read(cur)
        except BaseException as exc:
            abandoned = limit is not None and self._watchdog.done(conn)
            await self.held.put(conn, broken=conn.broken)
            if abandoned:
                raise _Abandoned("the statement did not answer in time") from exc
            raise
        if limit is not None and self._watchdog.done(conn):
            # Answered just as its socket was shut down: the result stands, the connection not.
            await self.held.put(conn, broken=True)
            return result
        self.held.release(conn)
        return result

    async def heartbeat(self, lease: JobLease) -> bool:
        """``JobSchedulerService.heartbeat``: sent once more after a broken connection."""
        params = _check_lease(lease)
        state: _LeaseState | None = getattr(lease, "_state", None)
        limit = None if state is None or state.valid == float("inf") else state.valid
        sent = time.monotonic()

        async def again() -> int:
            nonlocal sent
            sent = time.monotonic()
            return await self.rowcount(self.sql.heartbeat, params, limit)

        ok = (
            await self.statement(
                self.rowcount(self.sql.heartbeat, params, limit),
                resolve=again,
                unanswered="the heartbeat did not answer within the lease; connection abandoned",
            )
            == 1
        )
        if ok and state is not None:
            state.confirm(sent)
        return ok

    async def fenced(
        self, query: bytes, params: tuple[Any, ...], status: str, limit: float | None
    ) -> bool:
        """Send a fenced update of one row (``finalize``, ``reopen``; its last two parameters
        are the id and owner token) that leaves it ``status``: ``True`` if it did."""
        until = None if limit is None else time.monotonic() + limit
        updated = await self.statement(
            self.rowcount(query, params, limit),
            resolve=lambda: self._reread(query, params, status, until),
            unanswered=_UNKNOWN[status],
        )
        return updated == 1

    async def _reread(
        self, query: bytes, params: tuple[Any, ...], status: str, until: float | None
    ) -> int:
        """After an ambiguous commit: the row's status under our token says whether the update
        committed (1, as its row count would have been, or 0); while it still shows ``RUNNING``
        the update is sent again."""
        row = await self.fetch(self.sql.read_status, params[-2:], _left(until))
        if row is None or row[0] != RUNNING:
            return int(row is not None and row[0] == status)
        return await self.rowcount(query, params, _left(until))

    async def finalize(self, params: Params, limit: float | None) -> bool:
        """The single-row ``finalize`` (what a batch of one sends)."""
        return await self.fenced(self.sql.finalize, params, params[0], limit)

    async def refinalize(self, params: Params, until: float | None, first: psycopg.Error) -> bool:
        """An ambiguous commit of a batched ``finalize`` (``first``), resolved for one row."""
        status = params[0]
        reread = functools.partial(self._reread, self.sql.finalize, params, status, until)
        return await self.resolve(first, reread, _UNKNOWN[status]) == 1

    async def finalize_many(self, columns: tuple[list[Any], ...], limit: float | None) -> set[str]:
        """Send ``finalize_many``; the ids it updated (driver errors are the batcher's)."""
        rows = await self.rows(self.sql.finalize_many, columns, limit)
        return {row[0] for row in rows}
