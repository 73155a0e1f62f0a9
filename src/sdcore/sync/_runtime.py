"""``sdcore.sync.Runtime``: the async :class:`sdcore.Runtime` on a portal, for blocking code.

Invariants:

- Construction builds the async runtime only: no thread, no connection (a module-level object of
  an app that Gunicorn imports in its master before forking is safe).
- ``start()`` leaves either a started runtime or nothing running: a failure (or an interrupt,
  SIGTERM included) stops what the async start began, then the portal.
- The async runtime's background tasks run in a context of their own, not a copy of the caller's
  (a lazy ``start()`` inside a request must not make every later tick a child of that request's
  trace span); that context marks them as this runtime's, which is how ``stop()`` recognises a
  call from one of its own handlers (it would wait for itself).
- A runtime is tied to the process that started it (the portal is): in a forked child it is
  refused with an error that says where to start it.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
from collections.abc import Callable, Coroutine, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Self, TypeVar

from sdcore._internal.validation import boolean, int_between
from sdcore.outbox import Outbox, RelaySettings
from sdcore.postgres import DEFAULT_TABLES, PoolSettings
from sdcore.probes import ComponentHealth, ProbeResult
from sdcore.runtime import Runtime as AsyncRuntime
from sdcore.runtime import RuntimeStateError
from sdcore.scheduling import ControlSettings, SchedulingSettings
from sdcore.sync._exit import PROCESS_EXIT, Terminated
from sdcore.sync._lease import JobSchedulerService
from sdcore.sync._outbox import Outbox as SyncOutbox
from sdcore.sync._portal import Portal

if TYPE_CHECKING:
    from sdcore.alerting import Alerting
    from sdcore.events import EventBus
    from sdcore.metrics import SdcoreMetrics
    from sdcore.queues import Processor
    from sdcore.scheduling import Scheduler
    from sdcore.tracing import SdcoreTracing

__all__ = ["Runtime"]

T = TypeVar("T")

DEFAULT_HANDLER_THREADS: Final = 8
MAX_HANDLER_THREADS: Final = 1024
PORTAL_NAME: Final = "sdcore-runtime"

# Set in the context the async runtime's tasks (and the handler threads they start) run in.
_OWNER: contextvars.ContextVar[Runtime | None] = contextvars.ContextVar(
    "sdcore_sync_runtime", default=None
)

_IDLE: Final = ("idle", 0)
_STARTED: Final = ("started", 0)


class Runtime:
    """The async :class:`sdcore.Runtime` on an event loop of its own, for code without ``await``.

    Build it at import time and declare schedules on it as on the async one, with plain
    functions; they run in a pool of ``handler_threads`` threads while the lease, heartbeats,
    deadlines and the control plane run on the runtime's loop::

        runtime = Runtime(os.environ["DATABASE_URL"])

        @runtime.scheduler.cron("0 1 * * *", name="nightly")
        def nightly(tick: Tick) -> None: ...

        with runtime:          # start() … stop(); under Gunicorn: post_fork / worker_exit
            serve()

    Nothing starts until :meth:`start`. A started runtime is stopped (within
    ``grace_period_ms``) by :meth:`stop`, at interpreter exit (when the main thread ends, before
    Python waits for the other threads), and — with ``stop_on_sigterm``, when :meth:`start` ran
    in the main thread and nobody else handles SIGTERM — on SIGTERM, after which the process
    still ends as killed by SIGTERM.

    Args:
        database_url: As :class:`sdcore.Runtime`; so are ``redis_url``, ``pool``, ``relay``,
            ``scheduling``, ``control``, ``processors``, ``outbox``, ``ensure_schema``,
            ``lease_table``, ``schema``, ``queue_prefix``, ``grace_period_ms``, ``metrics``,
            ``tracing``, ``alerting`` and ``logger_name`` (the flat keywords of sdcore 0.1 are
            not taken).
        handler_threads: Threads that run plain-function handlers (scheduler ticks, event
            listeners the core runs in threads); a tick beyond them waits for a free thread.
        stop_on_sigterm: Stop on SIGTERM (see above).

    Raises:
        ValueError: As :class:`sdcore.Runtime`, or ``handler_threads`` out of 1..1024.
        TypeError: As :class:`sdcore.Runtime`, or a non-``bool`` ``stop_on_sigterm``.
    """

    def __init__(
        self,
        database_url: str,
        *,
        redis_url: str | None = None,
        pool: PoolSettings = PoolSettings(),  # noqa: B008 - frozen values
        relay: RelaySettings | None = RelaySettings(),  # noqa: B008
        scheduling: SchedulingSettings | None = SchedulingSettings(),  # noqa: B008
        control: ControlSettings | None = ControlSettings(),  # noqa: B008
        processors: Sequence[Processor] = (),
        outbox: Outbox | SyncOutbox | None = None,
        ensure_schema: bool = True,
        lease_table: str = DEFAULT_TABLES["lease"],
        schema: str | None = None,
        queue_prefix: str = "bull",
        grace_period_ms: int = 10_000,
        metrics: bool | SdcoreMetrics = False,
        tracing: bool | SdcoreTracing = False,
        alerting: Alerting | None = None,
        logger_name: str | None = None,
        handler_threads: int = DEFAULT_HANDLER_THREADS,
        stop_on_sigterm: bool = True,
    ) -> None:
        int_between("handler_threads", handler_threads, 1, MAX_HANDLER_THREADS)
        boolean("stop_on_sigterm", stop_on_sigterm)
        if isinstance(outbox, SyncOutbox):
            outbox = outbox.outbox
        self.aio = AsyncRuntime(
            database_url,
            redis_url=redis_url,
            pool=pool,
            relay=relay,
            scheduling=scheduling,
            control=control,
            processors=processors,
            outbox=outbox,
            ensure_schema=ensure_schema,
            lease_table=lease_table,
            schema=schema,
            queue_prefix=queue_prefix,
            grace_period_ms=grace_period_ms,
            metrics=metrics,
            tracing=tracing,
            alerting=alerting,
            logger_name=logger_name,
        )
        """The async runtime this one runs; its coroutines are awaited on :attr:`portal` only."""
        self.portal = Portal(name=PORTAL_NAME, handler_threads=handler_threads)
        """The event loop (on a thread of its own) the async runtime runs on."""
        self.jobs = JobSchedulerService(self.aio.jobs, self.portal)
        """The lease, blocking, on the runtime's pool (usable between :meth:`start` and
        :meth:`stop`; :meth:`stop` cancels its calls in flight first, then closes it)."""
        self.outbox = SyncOutbox.of(self.aio.outbox)
        """The outbox table, blocking: ``runtime.outbox.enqueue_once(conn, ...)`` on the caller's
        own connection, in its transaction (no portal call)."""
        self.handler_threads = handler_threads
        self.stop_on_sigterm = stop_on_sigterm
        self._lock = threading.Lock()
        # (phase, thread id inside start()/stop()): one attribute, so that a signal handler
        # never sees a phase without its thread.
        self._state: tuple[str, int] = _IDLE
        self._pid: int | None = None  # the process that started it
        self._stopped = False

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler: declare schedules (plain functions or coroutines) before :meth:`start`.

        Its methods belong to the runtime's loop once started: change schedules at run time
        through the control plane (``sdcore.sync.ScheduleAdmin``, ``sdcore schedules``).
        """
        return self.aio.scheduler

    @property
    def events(self) -> EventBus:
        """The event bus: subscribe listeners before :meth:`start`; ``emit`` from a plain thread
        runs plain listeners in that thread (a coroutine listener needs the loop)."""
        return self.aio.events

    @property
    def started(self) -> bool:
        """Whether :meth:`start` completed in this process and :meth:`stop` has not run since."""
        return self._state == _STARTED and self._pid == os.getpid()

    def starting_in(self, thread_id: int) -> bool:
        """Whether the thread ``thread_id`` is inside :meth:`start` (for the SIGTERM handler)."""
        phase, thread = self._state
        return phase == "starting" and thread == thread_id

    def start(self) -> None:
        """Start the portal, then the async runtime on it (pool, migrations, scheduler, …).

        A runtime starts once: after :meth:`stop`, build a new one (as for the async runtime,
        whose pools do not open twice).

        Raises:
            RuntimeStateError: Already started or stopped, started in another process before a
                fork, or the database cannot be reached (nothing is left running).
        """
        self._refuse_own_threads("start()")
        try:
            self._start()
        except Terminated:
            PROCESS_EXIT.terminate()  # stops the other runtimes, then ends the process
            raise

    def _start(self) -> None:
        with self._lock:
            self._check_process()
            if self._state != _IDLE:
                raise RuntimeStateError("this sdcore.sync.Runtime is already started")
            if self._stopped:
                raise RuntimeStateError(
                    "this sdcore.sync.Runtime was stopped: its pools cannot open again; build a "
                    "new Runtime to start again"
                )
            if PROCESS_EXIT.terminating:
                raise RuntimeStateError("the process is ending (SIGTERM): not starting sdcore")
            try:
                # First in the try: a SIGTERM that sees "starting" interrupts this block.
                self._state = ("starting", threading.get_ident())
                PROCESS_EXIT.add(self, sigterm=self.stop_on_sigterm)
                self.portal.start()
                self._pid = os.getpid()
                # A fresh context: the runtime's tasks inherit nothing of the caller's.
                contextvars.Context().run(self.portal.call, self._start_here)
            except BaseException:
                self._shutdown()
                raise
            self._state = _STARTED

    async def _start_here(self) -> None:
        _OWNER.set(self)
        await self.aio.start()

    def stop(self) -> None:
        """Stop the async runtime (running ticks get ``grace_period_ms``), then the portal.

        A no-op when not started (or started in another process). Safe from any thread but the
        runtime's own (its loop, its handlers); callers wait for one stop in progress.

        Raises:
            RuntimeStateError: Called from the runtime's loop, one of its handlers or a
                ``runtime.jobs.run_exclusive`` function (the stop would wait for itself).
        """
        self._refuse_own_threads("stop()")
        # Before any state changes: the stop would close the lease and wait for that function.
        self.jobs._refuse_inside("runtime.stop()", "stop the runtime")
        with self._lock:
            if self._state != _STARTED or self._pid != os.getpid():
                return
            self._state = ("stopping", threading.get_ident())
            self._stopped = True
            self._shutdown()

    def _shutdown(self) -> None:
        """Stop what runs (async runtime, portal) and forget this runtime; the lock is held."""
        try:
            if self.portal.running:
                try:
                    # Blocking lease calls of other threads first, while the pool is there to
                    # record their outcome (each sees its lease lost and records FAIL).
                    self.jobs.close()
                    self.portal.call(self.aio.stop)
                finally:
                    self.portal.stop()
        finally:
            self._state = _IDLE
            PROCESS_EXIT.remove(self)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def health(self) -> dict[str, ComponentHealth]:
        """The async runtime's health report (database, Redis, relay), from any thread.

        Raises:
            RuntimeStateError: Not started, or called from the runtime's own loop.
        """
        if not self.portal.running:
            self._check_process()
            raise RuntimeStateError("this sdcore.sync.Runtime is not started: start() it first")
        try:
            return self.portal.call(self.aio.health)
        except RuntimeStateError:
            if self.portal.accepting:
                raise  # the caller's fault (its own loop): not a stop racing the call
            raise RuntimeStateError(
                "this sdcore.sync.Runtime stopped while the call ran: start() it first"
            ) from None

    def liveness(self) -> ProbeResult:
        """Whether this process should keep running (see :mod:`sdcore.probes`), from any thread;
        a runtime that is not started answers not alive."""
        return self._probe(self.aio.liveness)

    def readiness(self) -> ProbeResult:
        """Whether this replica is ready (alive, database reachable, relay not stuck), from any
        thread; a runtime that is not started answers not ready."""
        return self._probe(self.aio.readiness)

    def _probe(self, probe: Callable[[], Coroutine[Any, Any, ProbeResult]]) -> ProbeResult:
        if self.portal.running:
            try:
                result: ProbeResult = self.portal.call(probe)
            except RuntimeStateError:
                if self.portal.accepting:
                    raise  # the caller's fault (its own loop): not a stop racing the call
            else:
                return result
        self._check_process()
        # Stopped: the probe reads the stopped state and returns before any I/O or await.
        return _settled(probe())

    def _check_process(self) -> None:
        if self._pid is not None and self._pid != os.getpid() and self._state != _IDLE:
            raise RuntimeStateError(
                f"this sdcore.sync.Runtime was started in process {self._pid} before a fork: "
                "build it at import time and start it in the process that uses it (under "
                "Gunicorn, in the post_fork or post_worker_init hook)"
            )

    def _refuse_own_threads(self, what: str) -> None:
        if _OWNER.get() is self:
            raise RuntimeStateError(
                f"runtime.{what} from one of the runtime's own handlers would wait for itself: "
                "call it from another thread"
            )
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        raise RuntimeStateError(
            f"runtime.{what} from a running event loop would block it (or wait for itself on "
            "the runtime's own loop): use the async sdcore.Runtime in async code"
        )

    def __repr__(self) -> str:
        return f"<sdcore.sync.Runtime {'started' if self.started else 'stopped'}>"


def _settled(coro: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that finishes without suspending."""
    try:
        coro.send(None)
    except StopIteration as done:
        result: T = done.value
        return result
    coro.close()
    raise RuntimeStateError("this sdcore.sync.Runtime is not started: start() it first")
