"""The lease for blocking code: :class:`JobSchedulerService` over the async service on a portal.

Every method is one :meth:`Portal.call` of the async service's method of the same name, so the
lease SQL, its validation, its time bounds and its errors are the async core's. ``run_exclusive``
goes through :meth:`Portal.call_here`: the heartbeat and the client deadline run on the portal's
loop while the plain function runs in the caller's own thread. ``complete_in`` runs the async
service's own finalize statement on the caller's blocking connection, in the caller's thread.

What a blocking caller is (and is not) guaranteed is the async API's, less cancellation: a thread
cannot be interrupted, so a lost lease shows in :attr:`JobExecutionLease.is_held` and
:meth:`JobExecutionLease.raise_if_lost` and in the fencing token, and ``run_exclusive`` returns
only once the function has returned (docs/reference/sync.md, "The lease").
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, NoReturn, ParamSpec, Self, TypeVar, overload

import psycopg

from sdcore._internal.legacy import fold_moved
from sdcore.job_scheduler import JobSchedulerService as AsyncJobSchedulerService
from sdcore.job_scheduler._base import RELEASED_DATA
from sdcore.job_scheduler._model import (
    JobAcquireResult,
    JobExecutionLease,
    JobLease,
    JobSchedulerStatus,
    RunExclusiveResult,
)
from sdcore.job_scheduler._options import JobAcquireOptions
from sdcore.job_scheduler._service import _CONNECT_POOL, _MOVED_POOL
from sdcore.postgres import PoolSettings
from sdcore.runtime import RuntimeStateError
from sdcore.sync._portal import Portal

__all__ = ["JobSchedulerService"]

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")

# The thread name of the portal ``connect`` starts (shown in thread dumps).
PORTAL_NAME = "sdcore-jobs"


class JobSchedulerService:
    """The distributed lease on PostgreSQL, for blocking code (threads, WSGI apps, scripts).

    Wraps an async :class:`sdcore.job_scheduler.JobSchedulerService` that lives on ``portal``'s
    event loop; build one with :meth:`connect`, or over a service a runtime already runs there.
    The object may be shared by any number of threads: each call is a task of the portal's
    loop, and the service's connections are shared as in async code. A call from a running
    event loop (async code must ``await`` the async API) or from a process forked after the
    portal started is refused with :class:`~sdcore.runtime.RuntimeStateError`.

    Args:
        service: The async service, opened on ``portal``'s loop.
        portal: The running portal ``service`` lives on.
    """

    def __init__(self, service: AsyncJobSchedulerService, portal: Portal) -> None:
        if not isinstance(service, AsyncJobSchedulerService):
            raise TypeError(
                "service must be an sdcore.job_scheduler.JobSchedulerService, "
                f"got {type(service).__name__}"
            )
        if not isinstance(portal, Portal):
            raise TypeError(f"portal must be an sdcore.sync Portal, got {type(portal).__name__}")
        self._service = service
        self._portal = portal
        self._closed = False
        # What connect() opened: closed (the service, then its pool) and stopped by close().
        self._owned: AsyncExitStack | None = None
        # The calls in flight and those close() cancelled: touched on the portal's loop only.
        self._calls: set[asyncio.Task[Any]] = set()
        self._closing: set[asyncio.Task[Any]] = set()
        self._closing_lock = threading.Lock()
        # Each key is written by its own thread only.
        self._inside: dict[int, int] = {}

    @classmethod
    @contextlib.contextmanager
    def connect(
        cls, dsn: str, *, pool: PoolSettings = _CONNECT_POOL, **options: Any
    ) -> Iterator[Self]:
        """Start a portal, open a pool for ``dsn`` and a service over it; close all on exit.

        The arguments are the async :meth:`sdcore.job_scheduler.JobSchedulerService.connect`'s.
        The pool keywords of sdcore 0.1 (``max_size=…``, …) still work for one release, with a
        ``DeprecationWarning`` that points at the caller's ``with`` line.

        Args:
            dsn: libpq connection string or URL.
            pool: The pool's settings (default ``PoolSettings(max_size=4)``).
            **options: The service's options (``table``, ``schema``, ``max_connections``, …).

        Yields:
            The open service.

        Raises:
            JobSchedulerUnavailableError: The database cannot be reached.
            ValueError: An option out of range, before any connection.
            TypeError: ``pool`` not a ``PoolSettings``, or a 0.1 pool keyword beside it.
        """
        if not isinstance(pool, PoolSettings):
            raise TypeError(f"pool must be a PoolSettings, got {pool!r:.40}")
        # Folded here, in the caller's thread (fold_moved → connect → __enter__ → the caller's
        # ``with``): a warning raised on the portal's thread would point into asyncio.
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
        rest = {name: value for name, value in options.items() if name not in _MOVED_POOL}
        portal = Portal(name=PORTAL_NAME)
        portal.start()
        try:
            stack = AsyncExitStack()
            service = portal.call(
                stack.enter_async_context,
                AsyncJobSchedulerService.connect(dsn, pool=settings, **rest),
            )
            facade = cls(service, portal)
        except BaseException:
            portal.stop()
            raise
        facade._owned = stack
        with facade:
            yield facade

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the service (and, if :meth:`connect` made it, its pool and its portal).

        Calls made afterwards are refused with :class:`~sdcore.runtime.RuntimeStateError`.
        Calls still in flight in other threads are cancelled first, while the connections are
        still there to record their outcome: a ``run_exclusive`` among them sees its lease lost
        (``is_held`` turns ``False``), waits for its function to return, records ``FAIL`` and
        raises :class:`~sdcore.runtime.RuntimeStateError` in its thread (never a success).
        ``close`` returns once they have. A second ``close`` waits for the first, then does
        nothing.

        Raises:
            RuntimeStateError: Called from inside a ``run_exclusive`` function (it would wait
                for that function).
        """
        self._refuse_inside("close()", "close the service")
        with self._closing_lock:  # a second close() returns once the first one is done
            if self._closed:
                return
            self._closed = True
            owned, portal = self._owned, self._portal
            try:
                portal.call(self._cancel_calls)
                portal.call(self._service.close if owned is None else owned.aclose)
            finally:
                if owned is not None:
                    portal.stop()

    def _refuse_inside(self, what: str, instead: str) -> None:
        """Refuse ``what`` (a call that waits for this service's runs) from inside one of them.

        Raises:
            RuntimeStateError: This thread runs a ``run_exclusive`` function of this service.
        """
        if threading.get_ident() in self._inside:
            raise RuntimeStateError(
                f"{what} from inside run_exclusive's function would wait for that function: "
                f"{instead} after run_exclusive returns"
            )

    async def _tracked(
        self, fn: Callable[P, Coroutine[Any, Any, R]], /, *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """Run one call as a task :meth:`close` knows of.

        Runs on the portal's loop, as does :meth:`_cancel_calls`, so the two never interleave
        within a step: a call that started before ``close`` is in ``_calls`` and is cancelled
        by it; one that starts after sees ``_closed`` (set before ``close`` reached the loop).
        """
        if self._closed:
            raise RuntimeStateError("the job scheduler service is closed")
        task = asyncio.current_task()
        assert task is not None  # noqa: S101 - a portal call is a task
        self._calls.add(task)
        try:
            return await fn(*args, **kwargs)
        except asyncio.CancelledError:
            if task in self._closing and task.uncancel() == 0:
                raise RuntimeStateError(
                    "the job scheduler service was closed while the call ran"
                ) from None
            raise
        finally:
            self._calls.discard(task)

    async def _cancel_calls(self) -> None:
        calls = set(self._calls)
        self._closing |= calls
        for task in calls:
            task.cancel()
        if calls:
            await asyncio.wait(calls)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def max_connections(self) -> int:
        """Connections the service holds at most (see the async service's)."""
        return self._service.max_connections

    @property
    def portal(self) -> Portal:
        """The portal the async service lives on."""
        return self._portal

    def schema_sql(self) -> str:
        """Return the DDL of this service's table (what :meth:`ensure_schema` applies)."""
        return self._service.schema_sql()

    def ensure_schema(self) -> None:
        """Apply the lease table's pending migrations; safe from N replicas at once."""
        self._check_open()
        self._portal.call(self._tracked, self._service.ensure_schema)

    def acquire(self, options: JobAcquireOptions | Mapping[str, Any]) -> JobAcquireResult:
        """Try to become the owner of one run (the async ``acquire``: same rules and errors).

        The returned lease's client deadline counts from when the statement was sent, as in
        async code; the blocking caller's own delays (a GIL-bound thread scheduled late) come
        out of it.

        Raises:
            InvalidJobIdentityOptionsError: Bad identity, before any SQL.
            InvalidJobLeaseOptionsError: Bad timing, before any SQL.
            JobSchedulerUnavailableError: The outcome could not be established.
            JobSchedulerDatabaseError: The database refused the statement.
        """
        self._check_open()
        return self._portal.call(self._tracked, self._service.acquire, options)

    def acquire_many(
        self, options: Sequence[JobAcquireOptions | Mapping[str, Any]]
    ) -> list[JobAcquireResult]:
        """``acquire`` for many runs in one statement; one result per item, in order.

        Raises:
            InvalidJobIdentityOptionsError: As the async ``acquire_many``, before any SQL.
            InvalidJobLeaseOptionsError: An item with bad timing, before any SQL.
            JobSchedulerUnavailableError: The outcome could not be established.
            JobSchedulerDatabaseError: The database refused the statement.
        """
        self._check_open()
        return self._portal.call(self._tracked, self._service.acquire_many, options)

    def statuses(self, lock_keys: Sequence[str]) -> dict[str, JobSchedulerStatus]:
        """Return the status of each run that has a row, by ``lock_key``.

        Raises:
            ValueError: A bad key or too many keys, before any SQL.
            JobSchedulerUnavailableError: The database could not be reached.
        """
        self._check_open()
        return self._portal.call(self._tracked, self._service.statuses, lock_keys)

    def heartbeat(self, lease: JobLease) -> bool:
        """Extend the lease by the database clock; ``False`` if ownership was lost.

        Raises:
            JobSchedulerUnavailableError: No answer within the lease.
        """
        self._check_open()
        return self._portal.call(self._tracked, self._service.heartbeat, lease)

    def complete(self, lease: JobLease, data: Mapping[str, Any] | None = None) -> bool:
        """Mark the run ``SUCCESS``; ``False`` if ownership was lost.

        Raises:
            JsonTypeError: ``data`` is not JSON, before any SQL.
            JsonValueError: ``data`` cannot be stored in jsonb, before any SQL.
            JobSchedulerUnavailableError: The outcome could not be established.
        """
        self._check_open()
        return self._portal.call(self._tracked, self._service.complete, lease, data)

    def fail(self, lease: JobLease, data: Mapping[str, Any] | None = None) -> bool:
        """Mark the run ``FAIL`` so that any replica may take it at once; ``False`` if lost.

        Raises:
            JsonTypeError: ``data`` is not JSON, before any SQL.
            JsonValueError: ``data`` cannot be stored in jsonb, before any SQL.
            JobSchedulerUnavailableError: The outcome could not be established.
        """
        self._check_open()
        return self._portal.call(self._tracked, self._service.fail, lease, data)

    def release(self, lease: JobLease, data: Mapping[str, Any] | None = RELEASED_DATA) -> bool:
        """``fail`` marked *released*: the next acquire may take the row.

        Args:
            lease: The capability returned by ``acquire``.
            data: JSON object stored on the row.

        Returns:
            ``True`` if this owner released the row, ``False`` if ownership was already lost.
        """
        self._check_open()
        return self._portal.call(self._tracked, self._service.release, lease, data)

    def give_back(self, lease: JobLease, reason: str) -> bool:
        """``fail`` marked *given back*: the run was won but never started.

        Raises:
            ValueError: ``reason`` is not a non-empty str, before any SQL.
        """
        self._check_open()
        return self._portal.call(self._tracked, self._service.give_back, lease, reason)

    def status_of(self, lease: JobLease) -> JobSchedulerStatus | None:
        """Return the run's status if the row still carries this lease's token, else ``None``.

        Raises:
            JobSchedulerUnavailableError: The database could not be reached.
        """
        self._check_open()
        return self._portal.call(self._tracked, self._service.status_of, lease)

    def complete_in(
        self,
        conn: psycopg.Connection[Any],
        lease: JobLease,
        data: Mapping[str, Any] | None = None,
    ) -> bool:
        """Mark the run ``SUCCESS`` inside the caller's transaction on a blocking connection.

        The async service's own finalize statement, run on ``conn`` in this thread: if ownership
        was lost it matches nothing, this returns ``False``, and the caller rolls back.
        ``run_exclusive`` accepts a run its function completed this way.

        Args:
            conn: A blocking ``psycopg.Connection``, normally inside ``conn.transaction()``.
            lease: The capability given to the function.
            data: A JSON object or ``None``.

        Returns:
            ``True`` if the row is now ``SUCCESS`` (once the caller commits).

        Raises:
            TypeError: ``conn`` is not a blocking ``psycopg.Connection`` (an async one belongs
                to the async API), or ``lease`` is not a lease.
            JsonTypeError: ``data`` is not JSON, before any SQL.
            JsonValueError: ``data`` cannot be stored in jsonb, before any SQL.
        """
        given: object = conn  # typed as a Connection; called by untyped code too
        if not isinstance(given, psycopg.Connection):
            raise TypeError(
                "conn must be a blocking psycopg.Connection (for an AsyncConnection, await "
                f"sdcore.job_scheduler.JobSchedulerService.complete_in), got {type(conn).__name__}"
            )
        query, params = self._service.complete_in_statement(lease, data)
        return conn.execute(query, params).rowcount == 1

    # An async function is refused at run time (TypeError); the first overload makes a type
    # checker see it too: the call never returns, so the code after it is reported unreachable.
    @overload
    def run_exclusive(
        self,
        options: JobAcquireOptions | Mapping[str, Any],
        fn: Callable[[JobExecutionLease], Awaitable[Any]],
    ) -> NoReturn: ...

    @overload
    def run_exclusive(
        self,
        options: JobAcquireOptions | Mapping[str, Any],
        fn: Callable[[JobExecutionLease], T],
    ) -> RunExclusiveResult[T]: ...

    def run_exclusive(
        self,
        options: JobAcquireOptions | Mapping[str, Any],
        fn: Callable[[JobExecutionLease], Any],
    ) -> RunExclusiveResult[Any]:
        """Run the plain function ``fn`` in this thread only if this replica wins the lease.

        The async ``run_exclusive``, with ``fn(lease)`` called in the calling thread (its
        thread locals and a copy of its context variables visible) while the heartbeat and the
        client-deadline timer run on the portal's loop. A thread cannot be interrupted: once the
        lease is lost or its client deadline passes, :attr:`JobExecutionLease.is_held` turns
        ``False`` and :meth:`JobExecutionLease.raise_if_lost` raises, and ``fn`` must check them
        between steps (or pass the fencing token to what it writes). ``run_exclusive`` returns
        or raises only after ``fn`` has returned; it reports ``fn``'s result only once the
        database recorded ``SUCCESS`` within the lease, and raises ``LostJobLeaseError``
        otherwise.

        Args:
            options: Identity and timing of the run.
            fn: A plain function of the lease (``async def`` is refused).

        Returns:
            ``acquired=False`` (``fn`` not called) or ``acquired=True`` with ``fn``'s result.

        Raises:
            TypeError: ``fn`` is not callable, is an ``async`` function, or returned an
                awaitable (the row is then marked ``FAIL``); use the async API for those.
            InvalidJobIdentityOptionsError: Bad identity, before any SQL.
            InvalidJobLeaseOptionsError: Bad timing, before any SQL.
            LostJobLeaseError: Ownership was lost (or ran out on the client) before the outcome
                was recorded.
            JobSchedulerUnavailableError: The database could not be reached to acquire.
            BaseException: Whatever ``fn`` raised (``KeyboardInterrupt`` included), after the
                row was marked ``FAIL``.
        """
        self._check_open()
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        if _is_async(fn):
            raise TypeError(
                f"fn {_name(fn)} is an async function: the blocking run_exclusive runs plain "
                "functions; await sdcore.job_scheduler.JobSchedulerService.run_exclusive in "
                "async code"
            )
        thread = threading.get_ident()
        # Threads inside one of this service's functions (nested runs counted): close() there
        # would wait for the function that called it.
        self._inside[thread] = self._inside.get(thread, 0) + 1
        try:
            return self._portal.call_here(
                self._tracked, self._service.run_exclusive, options, _Plain(fn)
            )
        finally:
            if self._inside[thread] == 1:
                del self._inside[thread]
            else:
                self._inside[thread] -= 1

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeStateError("the job scheduler service is closed")


class _Plain:
    """``fn`` refusing to hand back an awaitable: it would run on the portal's loop, beside
    every other caller's heartbeats, instead of in the caller's thread."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[JobExecutionLease], Any]) -> None:
        self.fn = fn

    def __call__(self, lease: JobExecutionLease) -> Any:
        result = self.fn(lease)
        if inspect.isawaitable(result):
            if inspect.iscoroutine(result):
                result.close()
            raise TypeError(
                f"fn {_name(self.fn)} returned an awaitable: the blocking run_exclusive runs "
                "plain functions; await sdcore.job_scheduler.JobSchedulerService.run_exclusive "
                "in async code"
            )
        return result


def _is_async(fn: object) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
    )


def _name(fn: object) -> str:
    return str(getattr(fn, "__qualname__", type(fn).__qualname__))
