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
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar, Unpack

from psycopg_pool import AsyncConnectionPool

from sdcore._internal.legacy import fold_moved, refuse_unknown, warn_switch
from sdcore._internal.lifecycle import AsyncStartStop
from sdcore._internal.redis_url import ClusterTarget, check_cluster_prefix, check_redis_url
from sdcore._internal.telemetry import NOOP, Telemetry
from sdcore._internal.validation import boolean, int_between, non_empty_str, shown, text
from sdcore.events import EventBus
from sdcore.exceptions import SdcoreError
from sdcore.job_scheduler import JobSchedulerService
from sdcore.outbox import Outbox, OutboxRelay, RelaySettings
from sdcore.postgres import DEFAULT_TABLES, PoolSettings, create_pool, redact_dsn, redact_text
from sdcore.probes import ComponentHealth, ProbeResult, health, liveness, readiness
from sdcore.scheduling import (
    ControlSettings,
    PostgresScheduleStore,
    ScheduleControl,
    Scheduler,
    SchedulingSettings,
)

if TYPE_CHECKING:
    from sdcore.alerting import Alerting
    from sdcore.metrics import SdcoreMetrics
    from sdcore.queues import BullMQPublisher, Processor, Workers
    from sdcore.tracing import SdcoreTracing

__all__ = ["ComponentHealth", "Runtime", "RuntimeStateError"]

# Connections of the control plane's own pool: one for the poller and heartbeat, one for an
# action's writes or a run-history write at the same moment (LISTEN has its own, outside it).
CONTROL_POOL_SIZE = 2


class RuntimeStateError(SdcoreError, RuntimeError):
    """A runtime that cannot be built or started as configured."""


class _Deprecated(TypedDict, total=False):
    """The keyword arguments of sdcore 0.1 that moved into settings objects (one more release)."""

    pool_min_size: int
    pool_max_size: int
    transaction_pooling: bool
    connect_timeout: int | None
    reconnect_min_delay_ms: int
    reconnect_max_delay_ms: int
    reconnect_timeout_ms: int
    application_name: str
    relay_batch_size: int
    relay_batch_bytes: int
    relay_listen_url: str | None
    relay_stuck_after_s: float
    time_zone: str
    scheduler: bool
    schedules_listen: bool
    schedule_control: bool


# The defaults of the settings keywords; ``is`` tells them from a value the caller gave.
_POOL = PoolSettings()
_RELAY = RelaySettings()
_SCHEDULING = SchedulingSettings()
_CONTROL = ControlSettings()

# Each 0.1 keyword, by the settings keyword that holds it now: old name → field.
_MOVED: dict[str, dict[str, str]] = {
    "pool": {
        "pool_min_size": "min_size",
        "pool_max_size": "max_size",
        "transaction_pooling": "transaction_pooling",
        "connect_timeout": "connect_timeout",
        "reconnect_min_delay_ms": "reconnect_min_delay_ms",
        "reconnect_max_delay_ms": "reconnect_max_delay_ms",
        "reconnect_timeout_ms": "reconnect_timeout_ms",
        "application_name": "application_name",
    },
    "relay": {
        "relay_batch_size": "batch_size",
        "relay_batch_bytes": "batch_bytes",
        "relay_listen_url": "listen_url",
        "relay_stuck_after_s": "stuck_after_s",
    },
    "scheduling": {"time_zone": "time_zone"},
    "control": {"schedules_listen": "listen"},
}
_DEPRECATED = set(_Deprecated.__annotations__)


_S = TypeVar("_S", SchedulingSettings, ControlSettings)


@dataclass(frozen=True, slots=True)
class _Chosen:
    """The settings a Runtime is built from, and which of its optional components run."""

    pool: PoolSettings
    relay: RelaySettings
    scheduling: SchedulingSettings
    control: ControlSettings
    run_relay: bool
    run_scheduler: bool
    run_control: bool


def _choose(
    call: str,
    pool: PoolSettings,
    relay: RelaySettings | bool | None,
    scheduling: SchedulingSettings | None,
    control: ControlSettings | None,
    given: Mapping[str, object],
) -> _Chosen:
    """Apply the 0.1 keywords (each with a DeprecationWarning pointing at the Runtime's caller).

    Raises:
        TypeError: An unknown keyword, or a 0.1 keyword beside the settings object holding it.
    """
    refuse_unknown(call, given, _DEPRECATED)
    stack = 3  # _choose → Runtime.__init__ → the caller
    if not isinstance(pool, PoolSettings):
        raise TypeError(f"pool must be a PoolSettings, got {pool!r:.40}")
    moved = dict(given)
    least, most = moved.get("pool_min_size"), moved.get("pool_max_size", _POOL.max_size)
    if isinstance(least, int) and isinstance(most, int) and least > most:
        moved["pool_min_size"] = most  # 0.1 took the smaller of the two
    if moved.get("relay_listen_url") == "":
        moved["relay_listen_url"] = None  # 0.1 read an empty URL as none
    chosen_pool = fold_moved(
        call,
        "pool",
        pool,
        moved=_MOVED["pool"],
        given=moved,
        explicit=pool is not _POOL,
        stacklevel=stack,
    )
    if isinstance(relay, bool):
        warn_switch(call, "relay", relay, "relay", "RelaySettings", stacklevel=stack)
    run_relay = relay is not None and relay is not False
    relay_base = relay if isinstance(relay, RelaySettings) else _RELAY
    if relay is not None and not isinstance(relay, bool | RelaySettings):
        raise TypeError(f"relay must be a RelaySettings or None, got {relay!r:.40}")
    chosen_relay = fold_moved(
        call,
        "relay",
        relay_base,
        moved=_MOVED["relay"],
        given=moved,
        explicit=not isinstance(relay, bool) and relay is not _RELAY,
        stacklevel=stack,
    )
    run_scheduler, sched_base = _switch(
        call, "scheduler", "scheduling", scheduling, _SCHEDULING, SchedulingSettings, moved, stack
    )
    chosen_scheduling = fold_moved(
        call,
        "scheduling",
        sched_base,
        moved=_MOVED["scheduling"],
        given=moved,
        explicit=scheduling is not _SCHEDULING,
        stacklevel=stack,
    )
    run_control, control_base = _switch(
        call, "schedule_control", "control", control, _CONTROL, ControlSettings, moved, stack
    )
    chosen_control = fold_moved(
        call,
        "control",
        control_base,
        moved=_MOVED["control"],
        given=moved,
        explicit=control is not _CONTROL,
        stacklevel=stack,
    )
    return _Chosen(
        pool=chosen_pool,
        relay=chosen_relay,
        scheduling=chosen_scheduling,
        control=chosen_control,
        run_relay=run_relay,
        run_scheduler=run_scheduler,
        run_control=run_control,
    )


def _switch(
    call: str,
    old: str,
    group: str,
    value: _S | None,
    default: _S,
    kind: type[_S],
    given: Mapping[str, object],
    stack: int,
) -> tuple[bool, _S]:
    """Whether a component runs, and its settings (``default`` when off), from both spellings."""
    if value is not None and not isinstance(value, kind):
        raise TypeError(f"{group} must be a {kind.__name__} or None, got {value!r:.40}")
    if old not in given:
        return value is not None, default if value is None else value
    if value is not default:
        raise TypeError(
            f"{call}({old}=…) cannot be combined with {call}({group}=…): give {group} only"
        )
    on = given[old]
    if not isinstance(on, bool):
        raise TypeError(f"{old} must be a bool, got {on!r:.40}")
    warn_switch(call, old, on, group, kind.__name__, stacklevel=stack + 1)
    return on, default


class Runtime(AsyncStartStop):
    """The job scheduler, scheduler, event bus, outbox, relay and queue workers of one service.

    Built at import time (so that routes and schedules can be declared against it); nothing
    connects until it is entered (``async with runtime``) or :meth:`start` is called. Queues are
    optional: without ``redis_url`` no ``sdcore.queues`` import happens, no relay or worker
    starts, and outbox rows wait in PostgreSQL until a replica with Redis relays them.

    Configuration comes as a few frozen settings objects, each validated when it is built; a
    component whose settings are ``None`` does not run in this process::

        Runtime(
            dsn,
            pool=PoolSettings(max_size=20, application_name="billing"),
            relay=RelaySettings(batch_size=200),
            scheduling=SchedulingSettings(time_zone="Europe/Paris"),
            control=None,            # the schedules run as declared, nothing else reaches them
        )

    The flat keywords of sdcore 0.1 (``pool_max_size=…``, ``relay=False``, ``time_zone=…``,
    ``scheduler=False``, …) still work for one release, with a ``DeprecationWarning`` that
    names the new spelling; one given beside the settings object holding it is a ``TypeError``.

    Args:
        database_url: libpq URL of the service's PostgreSQL.
        redis_url: Redis URL for BullMQ (``redis://``, ``rediss://``, ``unix://``,
            ``redis+sentinel://``, ``redis+cluster://``), or ``None`` (queues off).
        pool: The connection pool (:class:`~sdcore.postgres.PoolSettings`; the control plane
            opens a second pool of 2 connections with the same settings). At least 2
            connections: the job scheduler holds at most half of them, never the last one.
        relay: Run an outbox relay in this process (with ``redis_url``):
            :class:`~sdcore.outbox.RelaySettings`, or ``None``.
        scheduling: Run the schedules in this process:
            :class:`~sdcore.scheduling.SchedulingSettings`, or ``None`` (an API-only replica;
            ``runtime.scheduler`` still takes declarations, with the default settings).
        control: Run the schedules control plane with the scheduler (pause, trigger, backfill,
            stored schedules; this replica's schedules are recorded in its tables):
            :class:`~sdcore.scheduling.ControlSettings`, or ``None``.
        processors: Queue processors to run in this process (needs ``redis_url``).
        outbox: The outbox table (default ``Outbox()``).
        ensure_schema: Apply pending migrations of the lease, outbox and schedules tables at
            start (off when ``sdcore db upgrade`` or your own migrations do it).
        lease_table: The job lease table (the scheduler's run records).
        schema: Schema of the lease and schedules tables (``None``: the ``search_path``).
        queue_prefix: BullMQ key prefix; with a ``redis+cluster://`` URL it must hold a hash
            tag (``{bull}``).
        grace_period_ms: How long running ticks, jobs, the relay's batch and event handlers
            may finish at shutdown (one budget for the whole process).
        metrics: Prometheus metrics (``sdcore[metrics]``): ``True`` for
            :class:`~sdcore.metrics.SdcoreMetrics` on a registry of their own, or your own
            instance; exposed as :attr:`metrics` (``None`` when off).
        tracing: OpenTelemetry spans and trace propagation through the outbox
            (``sdcore[otel]``): ``True`` for :class:`~sdcore.tracing.SdcoreTracing` on the
            global tracer provider, or your own instance; :attr:`tracing`.
        alerting: Alerts on missed, failed and overrunning ticks (``sdcore[alerting]``): an
            :class:`~sdcore.alerting.Alerting`, started before the scheduler and stopped after
            it; its observer joins :attr:`telemetry`.
        logger_name: Logger for start-up and shutdown (default :attr:`default_logger_name`).
        **deprecated: The 0.1 keywords, each mapped onto the settings above.

    Raises:
        ValueError: An empty ``database_url``, a ``redis_url`` that is not a Redis URL (the
            message names the problem), processors without ``redis_url``, a pool of fewer than
            2 connections, or a 0.1 keyword's value out of range.
        TypeError: A settings keyword of the wrong type, an unknown keyword, or a 0.1 keyword
            beside the settings object that holds it.
    """

    default_logger_name = "sdcore.runtime"

    def __init__(
        self,
        database_url: str,
        *,
        redis_url: str | None = None,
        pool: PoolSettings = _POOL,
        relay: RelaySettings | bool | None = _RELAY,
        scheduling: SchedulingSettings | None = _SCHEDULING,
        control: ControlSettings | None = _CONTROL,
        processors: Sequence[Processor] = (),
        outbox: Outbox | None = None,
        ensure_schema: bool = True,
        lease_table: str = DEFAULT_TABLES["lease"],
        schema: str | None = None,
        queue_prefix: str = "bull",
        grace_period_ms: int = 10_000,
        metrics: bool | SdcoreMetrics = False,
        tracing: bool | SdcoreTracing = False,
        alerting: Alerting | None = None,
        logger_name: str | None = None,
        **deprecated: Unpack[_Deprecated],
    ) -> None:
        text("database_url", database_url)
        non_empty_str("queue_prefix", queue_prefix)
        if redis_url is not None:
            text("redis_url", redis_url, empty=True)
            if redis_url.strip() and isinstance(check_redis_url(redis_url), ClusterTarget):
                # A bad URL, or a Cluster prefix without a hash tag, fails here, not when the
                # queues start.
                check_cluster_prefix(queue_prefix)
        boolean("ensure_schema", ensure_schema)
        int_between("grace_period_ms", grace_period_ms, 0, 2**31 - 1)
        if outbox is not None and not isinstance(outbox, Outbox):
            raise TypeError(f"outbox must be an Outbox or None, got {shown(outbox)}")
        if processors and not redis_url:
            raise ValueError("processors need redis_url")
        chosen = _choose(type(self).__name__, pool, relay, scheduling, control, deprecated)
        settings = chosen.pool
        if settings.max_size < 2:
            raise ValueError(
                f"pool.max_size must be at least 2, got {settings.max_size}: the job scheduler "
                "holds up to half of the pool and must never hold its last connection"
            )
        self.database_url = database_url
        self.redis_url = redis_url or None
        self.pool_settings = settings
        """The pool's settings (the control plane's pool has the same, sized 1..2)."""
        self.relay_settings = chosen.relay if chosen.run_relay and self.redis_url else None
        """The relay's settings, ``None`` when this process runs no relay (``relay=None``, or
        no ``redis_url`` to relay to)."""
        self.scheduling_settings = chosen.scheduling if chosen.run_scheduler else None
        """The scheduler's settings, ``None`` when this process runs no schedules."""
        self.control_settings = (
            chosen.control if chosen.run_control and chosen.run_scheduler else None
        )
        """The control plane's settings, ``None`` when it does not run (``control=None``, or
        ``scheduling=None``: it controls this process's scheduler)."""
        self.transaction_pooling = settings.transaction_pooling
        self.relay_listen_url = chosen.relay.listen_url
        self.pool: AsyncConnectionPool[Any] = create_pool(database_url, settings)
        self.jobs = JobSchedulerService(
            self.pool,
            table=lease_table,
            schema=schema,
            max_connections=max(1, settings.max_size // 2),
            transaction_pooling=settings.transaction_pooling,
        )
        self.scheduler = Scheduler(
            jobs=self.jobs,
            time_zone=chosen.scheduling.time_zone,
            lease_ms=chosen.scheduling.lease_ms,
            grace_period_ms=grace_period_ms,
        )
        self.schedule_store = PostgresScheduleStore(
            self.pool,
            schema=schema,
            lease_table=lease_table,
            transaction_pooling=settings.transaction_pooling,
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
            transaction_pooling=settings.transaction_pooling,
        )
        self.control = ScheduleControl(
            self.scheduler,
            self._control_store,
            # A transaction-mode pooler hands a session's notifications to nobody.
            listen=chosen.control.listen and not settings.transaction_pooling,
            poll_interval_ms=chosen.control.poll_interval_ms,
            heartbeat_ms=chosen.control.heartbeat_ms,
            history_store=self.schedule_store,
        )
        self.events = EventBus()
        self.outbox = outbox or Outbox()
        self.processors = list(processors)
        self.publisher: BullMQPublisher | None = None
        self.relay: OutboxRelay | None = None
        self.workers: Workers | None = None
        self.run_scheduler = chosen.run_scheduler
        self.run_schedule_control = chosen.run_control
        self.run_relay = chosen.run_relay
        self.run_processors = True
        self._ensure_schema = ensure_schema
        self._prefix = queue_prefix
        self._relay_batch_size = chosen.relay.batch_size
        self._relay_batch_bytes = chosen.relay.batch_bytes
        self._grace = grace_period_ms / 1000
        self._open_timeout = max(settings.open_timeout_ms / 1000, 1.0)
        self._log = logging.getLogger(logger_name or self.default_logger_name)
        self._stack: AsyncExitStack | None = None
        self.relay_stuck_after_s = float(chosen.relay.stuck_after_s)
        self.started_at: float | None = None
        """``time.monotonic()`` when :meth:`start` completed (``None`` when stopped)."""
        self.metrics: SdcoreMetrics | None = None
        self.tracing: SdcoreTracing | None = None
        self.telemetry: Telemetry = NOOP
        """The observers every component reports to (``NOOP`` without metrics or tracing)."""
        self.instrument(metrics=metrics, tracing=tracing)
        if alerting is not None:
            from sdcore.alerting import Alerting

            if not isinstance(alerting, Alerting):
                raise TypeError(f"alerting must be an Alerting or None, got {shown(alerting)}")
        self.alerting = alerting
        """The alerting component (``None`` when off)."""

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
            await self.pool.open(wait=True, timeout=self._open_timeout)
            stack.push_async_callback(self._step, "pool", self.pool.close)
            stack.push_async_callback(self._step, "job scheduler", self.jobs.close)
            stack.push_async_callback(self._step, "events", lambda: self.events.drain(self._grace))
            if self._ensure_schema:
                await self.jobs.ensure_schema()
                await self.outbox.ensure_schema(self.pool)
                await self.schedule_store.ensure_schema()
            if self.alerting is not None:
                await self._start_alerting(self.alerting, stack)
            if self.redis_url is not None:
                await self._start_queues(self.redis_url, stack)
            if self.run_scheduler:
                # The control plane first (a paused schedule must not fire at start-up), and
                # stopped first (no trigger or backfill starts a tick into a closing scheduler).
                control = False
                if self.run_schedule_control:
                    await self.control_pool.open(wait=True, timeout=self._open_timeout)
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

    async def _start_alerting(self, alerting: Alerting, stack: AsyncExitStack) -> None:
        """Install the alerting observer on the scheduler's hub and start it (before the
        scheduler, so that its first ticks are watched; stopped after it)."""
        hub = self.telemetry
        if hub is NOOP:
            hub = self.telemetry = Telemetry()
            self.jobs.telemetry = self.scheduler.telemetry = self.outbox.telemetry = hub
        if alerting.observer not in hub.observers:
            hub.add(alerting.observer)
        await alerting.start(
            self.pool,
            self.scheduler,
            jobs=self.jobs if self.run_scheduler else None,
            history=self.schedule_store if self.control_settings is not None else None,
            ensure_schema=self._ensure_schema,
        )
        stack.push_async_callback(self._step, "alerting", lambda: alerting.stop(self._grace))

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

        kwargs = self.pool_settings.connection_kwargs(self.database_url)
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
