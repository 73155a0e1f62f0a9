"""``Runtime``: every sdcore component of one service, started in order and stopped in reverse.

The framework-free composition root. The FastAPI integration (:class:`sdcore.fastapi.Sdcore`),
``sdcore run MODULE:ATTR``, the CLI relay and the demo build on it, so one process is wired the same
way whatever starts it::

    runtime = Runtime(database_url=dsn, redis_url=os.environ.get("REDIS_URL"))

    @runtime.scheduler.cron("0 1 * * *", name="nightly")
    async def nightly(tick: Tick) -> None: ...

    async with runtime:          # pool → migrations → queues → scheduler
        await stop.wait()        # (shutdown runs in reverse, each step isolated)

Needs the ``sdcore[scheduling]`` extra; Redis (``sdcore[bullmq]``) only with ``redis_url``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

from psycopg_pool import AsyncConnectionPool

from sdcore._internal.lifecycle import AsyncStartStop
from sdcore._internal.telemetry import NOOP, Telemetry
from sdcore.events import EventBus
from sdcore.exceptions import SdcoreError
from sdcore.job_scheduler import JobSchedulerService
from sdcore.outbox import DEFAULT_RELAY_BATCH_BYTES, DEFAULT_RELAY_BATCH_SIZE, Outbox, OutboxRelay
from sdcore.postgres import DEFAULT_TABLES, PoolSettings, create_pool, redact_dsn, redact_text
from sdcore.probes import (
    DEFAULT_RELAY_STUCK_AFTER_S,
    ComponentHealth,
    ProbeResult,
    health,
    liveness,
    readiness,
)
from sdcore.scheduling import PostgresScheduleStore, ScheduleControl, Scheduler

if TYPE_CHECKING:
    from sdcore.metrics import SdcoreMetrics
    from sdcore.queues import BullMQPublisher, Processor, Workers
    from sdcore.tracing import SdcoreTracing

__all__ = ["ComponentHealth", "Runtime", "RuntimeStateError"]

# Connections of the control plane's own pool: one for the poller and heartbeat, one for an
# action's writes or a run-history write at the same moment (LISTEN has its own, outside it).
CONTROL_POOL_SIZE = 2


class RuntimeStateError(SdcoreError, RuntimeError):
    """A runtime that cannot be built or started as configured."""


class Runtime(AsyncStartStop):
    """The job scheduler, scheduler, event bus, outbox, relay and queue workers of one service.

    Built at import time (so that routes and schedules can be declared against it); nothing
    connects until it is entered (``async with runtime``) or :meth:`start` is called. Queues are
    optional: without ``redis_url`` no ``sdcore.queues`` import happens, no relay or worker
    starts, and outbox rows wait in PostgreSQL until a replica with Redis relays them.

    Args:
        database_url: libpq URL of the service's PostgreSQL.
        redis_url: Redis URL for BullMQ, or ``None`` (queues off).
        time_zone: Default zone of cron schedules.
        ensure_schema: Apply pending migrations of the lease and outbox tables at start (off
            when ``sdcore db upgrade`` or your own migrations do it).
        processors: Queue processors to run in this process (needs ``redis_url``).
        relay: Run an outbox relay in this process (with ``redis_url``).
        scheduler: Run the schedules in this process (``False``: an API-only replica).
        queue_prefix: BullMQ key prefix.
        pool_min_size: Pool minimum.
        pool_max_size: Pool maximum. The job scheduler holds at most half of it, never all of
            it, so the application's own ``runtime.pool.connection()`` always finds one.
        grace_period_ms: How long running ticks and jobs may finish at shutdown.
        outbox: The outbox table (default ``Outbox()``).
        schedules_listen: Control-plane changes (pause, trigger, stored schedules…) arrive by
            LISTEN/NOTIFY and by polling every second; ``False`` (implied by
            ``transaction_pooling``) polls only, with unprepared statements.
        logger_name: Logger for start-up and shutdown (default :attr:`default_logger_name`).
        transaction_pooling: ``database_url`` points at a transaction-mode pooler (PgBouncer
            ``pool_mode=transaction``): no server-side prepared statements on the pool, and
            every lease statement carries its own ``synchronous_commit=on`` and timeout.
        connect_timeout: Seconds per connection attempt and host (libpq: whole seconds, at
            least 2); ``None``: the URL's value, else 10.
        reconnect_min_delay_ms: First pause before replacing a broken connection; doubles up
            to ``reconnect_max_delay_ms``, so a promoted standby is used within about that long
            of accepting connections.
        reconnect_max_delay_ms: The cap of that pause.
        reconnect_timeout_ms: Stop trying to replace a connection after this long.
        relay_listen_url: A direct (not pooled) URL of the same database for the relay's
            LISTEN. Under ``transaction_pooling`` without it the relay polls (a notification
            cannot cross a transaction-mode pooler); with it, it is woken within milliseconds.
        metrics: Prometheus metrics (``sdcore[metrics]``): ``True`` for
            :class:`~sdcore.metrics.SdcoreMetrics` on a registry of their own, or your own
            instance; exposed as :attr:`metrics` (``None`` when off).
        tracing: OpenTelemetry spans and trace propagation through the outbox
            (``sdcore[otel]``): ``True`` for :class:`~sdcore.tracing.SdcoreTracing` on the
            global tracer provider, or your own instance; :attr:`tracing`.
        relay_stuck_after_s: Readiness fails when the relay has rows due and completed no
            round for this long (see :mod:`sdcore.probes`).
        relay_batch_size: Outbox rows the relay claims at a time.
        relay_batch_bytes: Payload bytes the relay claims at a time (``OutboxRelay``'s
            ``batch_bytes``: its memory follows it).
        lease_table: The job lease table (the scheduler's run records).
        schema: Schema of the lease and schedules tables (``None``: the ``search_path``).
        application_name: Shown in ``pg_stat_activity`` for the pool's connections.
        schedule_control: Run the schedules control plane with the scheduler (pause, trigger,
            backfill, stored schedules; this replica's schedules are recorded in its tables).
            ``False``: the schedules run as declared and nothing else reaches them.

    Raises:
        ValueError: An empty ``database_url``, processors without ``redis_url``, a pool of
            fewer than 2 connections (the job scheduler would hold the last one), or a
            connection setting out of range.
    """

    default_logger_name = "sdcore.runtime"

    def __init__(
        self,
        *,
        database_url: str,
        redis_url: str | None = None,
        time_zone: str = "UTC",
        ensure_schema: bool = True,
        processors: Sequence[Processor] = (),
        relay: bool = True,
        scheduler: bool = True,
        queue_prefix: str = "bull",
        pool_min_size: int = 1,
        pool_max_size: int = 10,
        grace_period_ms: int = 10_000,
        outbox: Outbox | None = None,
        schedules_listen: bool = True,
        logger_name: str | None = None,
        transaction_pooling: bool = False,
        connect_timeout: int | None = None,
        reconnect_min_delay_ms: int = 100,
        reconnect_max_delay_ms: int = 1_000,
        reconnect_timeout_ms: int = 300_000,
        relay_listen_url: str | None = None,
        metrics: bool | SdcoreMetrics = False,
        tracing: bool | SdcoreTracing = False,
        relay_stuck_after_s: float = DEFAULT_RELAY_STUCK_AFTER_S,
        relay_batch_size: int = DEFAULT_RELAY_BATCH_SIZE,
        relay_batch_bytes: int = DEFAULT_RELAY_BATCH_BYTES,
        lease_table: str = DEFAULT_TABLES["lease"],
        schema: str | None = None,
        application_name: str = "sdcore",
        schedule_control: bool = True,
    ) -> None:
        if not isinstance(database_url, str) or not database_url.strip():
            raise ValueError("database_url is required")
        if processors and not redis_url:
            raise ValueError("processors need redis_url")
        if (
            isinstance(relay_stuck_after_s, bool)
            or not isinstance(relay_stuck_after_s, int | float)
            or relay_stuck_after_s <= 0
        ):
            raise ValueError(
                f"relay_stuck_after_s must be a positive number, got {relay_stuck_after_s!r:.40}"
            )
        sizes = (
            ("pool_max_size", pool_max_size),
            ("relay_batch_size", relay_batch_size),
            ("relay_batch_bytes", relay_batch_bytes),
        )
        for name, value in sizes:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if pool_max_size < 2:
            raise ValueError(
                f"pool_max_size must be at least 2, got {pool_max_size}: the job scheduler holds "
                "up to half of the pool and must never hold its last connection"
            )
        self.database_url = database_url
        self.redis_url = redis_url or None
        settings = PoolSettings(
            min_size=min(pool_min_size, pool_max_size),
            max_size=pool_max_size,
            transaction_pooling=transaction_pooling,
            connect_timeout=connect_timeout,
            reconnect_min_delay_ms=reconnect_min_delay_ms,
            reconnect_max_delay_ms=reconnect_max_delay_ms,
            reconnect_timeout_ms=reconnect_timeout_ms,
            application_name=application_name,
        )
        self.transaction_pooling = transaction_pooling
        self.relay_listen_url = relay_listen_url or None
        self._pool_settings = settings
        self.pool: AsyncConnectionPool[Any] = create_pool(database_url, settings)
        self.jobs = JobSchedulerService(
            self.pool,
            table=lease_table,
            schema=schema,
            max_connections=max(1, pool_max_size // 2),
            transaction_pooling=transaction_pooling,
        )
        self.scheduler = Scheduler(
            jobs=self.jobs, time_zone=time_zone, grace_period_ms=grace_period_ms
        )
        poll_only = transaction_pooling or not schedules_listen
        self.schedule_store = PostgresScheduleStore(
            self.pool, schema=schema, lease_table=lease_table, transaction_pooling=poll_only
        )
        # The control plane's polls and writes run on a pool of their own: a pause must reach
        # this replica while the application's handlers hold every connection of self.pool
        # (that load is often why an operator pauses).
        self.control_pool: AsyncConnectionPool[Any] = create_pool(
            database_url,
            dataclasses.replace(settings, min_size=1, max_size=CONTROL_POOL_SIZE),
        )
        self._control_store = PostgresScheduleStore(
            self.control_pool,
            schema=schema,
            lease_table=lease_table,
            transaction_pooling=poll_only,
        )
        self.control = ScheduleControl(
            self.scheduler,
            self._control_store,
            listen=not poll_only,
            history_store=self.schedule_store,
        )
        self.events = EventBus()
        self.outbox = outbox or Outbox()
        self.processors = list(processors)
        self.publisher: BullMQPublisher | None = None
        self.relay: OutboxRelay | None = None
        self.workers: Workers | None = None
        self.run_scheduler = bool(scheduler)
        self.run_schedule_control = bool(schedule_control)
        self.run_relay = bool(relay)
        self.run_processors = True
        self._ensure_schema = ensure_schema
        self._prefix = queue_prefix
        self._relay_batch_size = relay_batch_size
        self._relay_batch_bytes = relay_batch_bytes
        self._grace = grace_period_ms / 1000
        self._log = logging.getLogger(logger_name or self.default_logger_name)
        self._stack: AsyncExitStack | None = None
        self.relay_stuck_after_s = float(relay_stuck_after_s)
        self.started_at: float | None = None
        """``time.monotonic()`` when :meth:`start` completed (``None`` when stopped)."""
        self.metrics: SdcoreMetrics | None = None
        self.tracing: SdcoreTracing | None = None
        self.telemetry: Telemetry = NOOP
        """The observers every component reports to (``NOOP`` without metrics or tracing)."""
        self.instrument(metrics=metrics, tracing=tracing)

    def instrument(
        self, *, metrics: bool | SdcoreMetrics = False, tracing: bool | SdcoreTracing = False
    ) -> None:
        """Turn metrics and/or tracing on after construction (``sdcore run --metrics-port``).

        Raises:
            RuntimeStateError: The runtime is started, or already instrumented.
        """
        if not metrics and not tracing:
            return
        if self.started or self.telemetry is not NOOP:
            raise RuntimeStateError("instrument() must be called once, before start()")
        hub = self.telemetry = Telemetry()
        if metrics:
            from sdcore.metrics import SdcoreMetrics
            from sdcore.outbox import PostgresOutboxStore

            self.metrics = metrics if isinstance(metrics, SdcoreMetrics) else SdcoreMetrics()
            self.metrics.bind(
                scheduler=self.scheduler,
                jobs=self.jobs,
                outbox=PostgresOutboxStore(self.pool, outbox=self.outbox),
            )
            hub.add(self.metrics.observer)
        if tracing:
            from sdcore.tracing import SdcoreTracing

            self.tracing = tracing if isinstance(tracing, SdcoreTracing) else SdcoreTracing()
            hub.add(self.tracing)
        self.jobs.telemetry = self.scheduler.telemetry = self.outbox.telemetry = hub

    @property
    def queues_enabled(self) -> bool:
        """Whether this service runs with Redis."""
        return self.redis_url is not None

    @property
    def started(self) -> bool:
        """Whether :meth:`start` completed and :meth:`stop` has not run since."""
        return self._stack is not None

    async def start(self) -> None:
        """Start everything: pool → migrations → (Redis: publisher, relay, workers) → scheduler.

        A failure part-way stops what already started, in reverse, then raises.

        Raises:
            RuntimeStateError: Already started.
        """
        if self._stack is not None:
            raise RuntimeStateError("this Runtime is already started")
        await self._preflight()
        stack = AsyncExitStack()
        try:
            await self.pool.open(wait=True, timeout=30)
            stack.push_async_callback(self._step, "pool", self.pool.close)
            stack.push_async_callback(self._step, "job scheduler", self.jobs.close)
            stack.push_async_callback(self._step, "events", lambda: self.events.drain(self._grace))
            if self._ensure_schema:
                await self.jobs.ensure_schema()
                await self.outbox.ensure_schema(self.pool)
                await self.schedule_store.ensure_schema()
            if self.redis_url is not None:
                await self._start_queues(self.redis_url, stack)
            if self.run_scheduler:
                # The control plane first (a paused schedule must not fire at start-up), and
                # stopped first (no trigger or backfill starts a tick into a closing scheduler).
                control = False
                if self.run_schedule_control:
                    await self.control_pool.open(wait=True, timeout=30)
                    stack.push_async_callback(self._step, "control pool", self.control_pool.close)
                    control = await self._start_control()
                try:
                    await self.scheduler.start_all()
                except BaseException:
                    if control:
                        await self.control.aclose()
                    raise
                stack.push_async_callback(self._step, "scheduler", self.scheduler.aclose)
                if control:
                    stack.push_async_callback(self._step, "schedule control", self.control.aclose)
        except BaseException:
            await stack.aclose()
            self.relay = self.workers = self.publisher = None
            raise
        self._stack = stack
        self.started_at = time.monotonic()
        self._log.info(
            "sdcore started (database %s, queues %s, scheduler %s)",
            redact_dsn(self.database_url),
            "on" if self.redis_url else "off",
            "on" if self.run_scheduler else "off",
            extra={"action": "started"},
        )

    async def _start_control(self) -> bool:
        """Start the schedules control plane; without its tables, warn and run without it."""
        import psycopg

        try:
            await self.control.start()
        except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName):
            await self.control.aclose()
            self._log.warning(
                "the schedules control plane is off: its tables do not exist (run `sdcore db "
                "upgrade --schedules`, or start with ensure_schema=True); pause, trigger and "
                "backfill do not reach this replica",
                extra={"action": "control_plane_off"},
            )
            return False
        return True

    async def stop(self) -> None:
        """Stop everything in reverse order; each step's failure is logged and the rest still run.

        Order: schedule control (trigger/backfill coordinators cancelled; another replica takes
        a backfill over) → scheduler (running ticks finish within the grace period, then are
        cancelled and marked FAIL) → workers (running jobs finish) → relay (the batch in flight is
        marked) → publisher → events drained → job scheduler → pool. A no-op when not started.
        """
        stack, self._stack = self._stack, None
        if stack is None:
            return
        self.started_at = None
        try:
            await stack.aclose()
            if self.metrics is not None:
                await self.metrics.aclose()
        finally:
            self.relay = self.workers = self.publisher = None
            self._log.info("sdcore stopped", extra={"action": "stopped"})

    async def _preflight(self) -> None:
        # One direct attempt first: psycopg_pool only logs why a connection failed and raises
        # "pool initialization incomplete" after its timeout; this names the server's reason.
        import psycopg

        kwargs = self._pool_settings.connection_kwargs(self.database_url)
        try:
            conn = await psycopg.AsyncConnection.connect(self.database_url, **kwargs)
        except psycopg.Error as exc:
            reason = redact_text(" ".join(str(exc).split()), self.database_url)
            raise RuntimeStateError(
                f"cannot connect to {redact_dsn(self.database_url)}: {reason}"
            ) from None
        await conn.close()

    @asynccontextmanager
    async def lifespan(self, app: object = None) -> AsyncIterator[None]:
        """An ASGI/FastAPI lifespan: ``app.state.sdcore = self``, start, yield, stop."""
        state = getattr(app, "state", None)
        if state is not None:
            state.sdcore = self
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    async def _step(self, name: str, step: Callable[[], Awaitable[object]]) -> None:
        try:
            await step()
        except Exception:  # noqa: BLE001 - keep shutting the rest down
            self._log.exception("could not stop %s cleanly", name, extra={"action": "stop"})

    async def _start_queues(self, redis_url: str, stack: AsyncExitStack) -> None:
        from sdcore.outbox import PostgresOutboxStore
        from sdcore.queues import BullMQPublisher, Workers

        publisher = BullMQPublisher.from_url(redis_url, prefix=self._prefix)
        await publisher.start()
        self.publisher = publisher
        stack.push_async_callback(self._step, "publisher", publisher.close)
        if self.run_relay:
            store = PostgresOutboxStore(
                self.pool,
                outbox=self.outbox,
                listen_dsn=self.relay_listen_url,
                transaction_pooling=self.transaction_pooling,
            )
            relay = OutboxRelay(
                store,
                publisher,
                batch_size=self._relay_batch_size,
                batch_bytes=self._relay_batch_bytes,
            )
            relay.telemetry = self.telemetry
            await relay.start()
            self.relay = relay
            stack.push_async_callback(self._step, "relay", lambda: relay.stop(self._grace))
        if self.processors and self.run_processors:
            # The publisher checked this Redis at start (eviction policy, persistence); the
            # workers check it only when that could not be done, so each warning is logged once.
            workers = Workers(
                self.processors,
                redis_url=redis_url,
                prefix=self._prefix,
                check_server=publisher.server is None,
            )
            workers.telemetry = self.telemetry
            await workers.start()
            self.workers = workers
            stack.push_async_callback(self._step, "workers", lambda: workers.close(self._grace))

    async def liveness(self) -> ProbeResult:
        """Whether this process should keep running (no I/O; see :mod:`sdcore.probes`)."""
        return await liveness(self)

    async def readiness(self) -> ProbeResult:
        """Whether this replica is ready: alive, database reachable, relay not stuck."""
        return await readiness(self)

    async def health(self) -> dict[str, ComponentHealth]:
        """Check the database, Redis and the relay (each check bounded to 2 s)."""
        return await health(self)
