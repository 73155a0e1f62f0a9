"""``Sdcore``: every sdcore component of one service, started and stopped in the right order."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from psycopg_pool import AsyncConnectionPool

from sdcore.events import EventBus
from sdcore.job_scheduler import JobSchedulerService
from sdcore.outbox import Outbox, OutboxRelay
from sdcore.postgres import redact_dsn, redact_text
from sdcore.scheduling import Scheduler

if TYPE_CHECKING:
    from sdcore.queues import BullMQPublisher, Processor, Workers


@dataclass(frozen=True, slots=True, kw_only=True)
class ComponentHealth:
    """One component's state in the health report."""

    ok: bool
    detail: str


class Sdcore:
    """The job scheduler, scheduler, event bus, outbox, relay and queue workers of one service.

    Built at import time (so that routes and schedules can be declared against it); nothing
    connects until :meth:`lifespan` runs. Queues are optional: without ``redis_url`` no
    ``sdcore.queues`` import happens, no relay or worker starts, and outbox rows wait in
    PostgreSQL until a replica with Redis relays them.

    Args:
        database_url: libpq URL of the service's PostgreSQL.
        redis_url: Redis URL for BullMQ, or ``None`` (queues off).
        time_zone: Default zone of cron schedules.
        ensure_schema: Create the lease and outbox tables at start (off when migrations do it).
        processors: Queue processors to run in this process (needs ``redis_url``).
        relay: Run an outbox relay in this process (with ``redis_url``).
        queue_prefix: BullMQ key prefix.
        pool_min_size: Pool minimum.
        pool_max_size: Pool maximum (the job scheduler holds up to half of it).
        grace_period_ms: How long running ticks and jobs may finish at shutdown.
        outbox: The outbox table (default ``Outbox()``).
        logger_name: Logger for start-up and shutdown.
    """

    def __init__(
        self,
        *,
        database_url: str,
        redis_url: str | None = None,
        time_zone: str = "UTC",
        ensure_schema: bool = True,
        processors: Sequence[Processor] = (),
        relay: bool = True,
        queue_prefix: str = "bull",
        pool_min_size: int = 1,
        pool_max_size: int = 10,
        grace_period_ms: int = 10_000,
        outbox: Outbox | None = None,
        logger_name: str = "sdcore.fastapi",
    ) -> None:
        if not isinstance(database_url, str) or not database_url.strip():
            raise ValueError("database_url is required")
        if processors and not redis_url:
            raise ValueError("processors need redis_url")
        self.database_url = database_url
        self.redis_url = redis_url or None
        self.pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            database_url,
            min_size=pool_min_size,
            max_size=pool_max_size,
            kwargs={"autocommit": True},
            open=False,
        )
        self.jobs = JobSchedulerService(self.pool, max_connections=max(1, pool_max_size // 2))
        self.scheduler = Scheduler(
            jobs=self.jobs, time_zone=time_zone, grace_period_ms=grace_period_ms
        )
        self.events = EventBus()
        self.outbox = outbox or Outbox()
        self.processors = list(processors)
        self.publisher: BullMQPublisher | None = None
        self.relay: OutboxRelay | None = None
        self.workers: Workers | None = None
        self._ensure_schema = ensure_schema
        self._run_relay = relay
        self._prefix = queue_prefix
        self._grace = grace_period_ms / 1000
        self._log = logging.getLogger(logger_name)

    @property
    def queues_enabled(self) -> bool:
        """Whether this service runs with Redis."""
        return self.redis_url is not None

    @asynccontextmanager
    async def lifespan(self, app: object = None) -> AsyncIterator[None]:
        """FastAPI lifespan: start everything, yield, stop everything in reverse order.

        Order: pool → schema → (Redis: publisher, relay, workers) → scheduler. Shutdown: scheduler
        (running ticks finish within the grace period, then are cancelled and marked FAIL) →
        workers (running jobs finish) → relay (the batch in flight is marked) → events drained →
        publisher → job scheduler → pool.
        """
        state = getattr(app, "state", None)
        if state is not None:
            state.sdcore = self
        await self.pool.open(wait=True, timeout=30)
        try:
            if self._ensure_schema:
                await self.jobs.ensure_schema()
                await self.outbox.ensure_schema(self.pool)
            if self.redis_url is not None:
                await self._start_queues(self.redis_url)
            await self.scheduler.start_all()
            self._log.info(
                "sdcore started (database %s, queues %s)",
                redact_dsn(self.database_url),
                "on" if self.redis_url else "off",
                extra={"action": "started"},
            )
            yield
        finally:
            await self._stop()

    async def _start_queues(self, redis_url: str) -> None:
        from sdcore.queues import BullMQPublisher, Workers

        self.publisher = BullMQPublisher.from_url(redis_url, prefix=self._prefix)
        await self.publisher.start()
        if self._run_relay:
            self.relay = OutboxRelay(self.pool, self.publisher, outbox=self.outbox)
            await self.relay.start()
        if self.processors:
            self.workers = Workers(self.processors, redis_url=redis_url, prefix=self._prefix)
            await self.workers.start()

    async def _stop(self) -> None:
        steps: list[tuple[str, Any]] = [
            ("scheduler", self.scheduler.aclose()),
            ("workers", self.workers.close(self._grace) if self.workers else None),
            ("relay", self.relay.stop(self._grace) if self.relay else None),
            ("events", self.events.drain(self._grace)),
            ("publisher", self.publisher.close() if self.publisher else None),
            ("job scheduler", self.jobs.close()),
            ("pool", self.pool.close()),
        ]
        for name, step in steps:
            if step is None:
                continue
            try:
                await step
            except Exception:  # noqa: BLE001 - keep shutting the rest down
                self._log.exception("could not stop %s cleanly", name, extra={"action": "stop"})
        self.relay = self.workers = self.publisher = None

    async def health(self) -> dict[str, ComponentHealth]:
        """Check the database, Redis and the relay (each check bounded to 2 s)."""
        report = {"database": await self._check_database()}
        if self.redis_url is None:
            report["redis"] = ComponentHealth(ok=True, detail="not configured (queues off)")
        else:
            report["redis"] = await self._check_redis()
            state = self.relay.state if self.relay else None
            if state is None:
                report["relay"] = ComponentHealth(ok=True, detail="not running in this process")
            else:
                detail = f"published {state.published}, failed {state.failed}"
                if state.last_error and not state.broker_available:
                    detail += f"; last error: {state.last_error[:200]}"
                report["relay"] = ComponentHealth(
                    ok=state.running and state.broker_available, detail=detail
                )
        return report

    async def _check_database(self) -> ComponentHealth:
        try:
            async with asyncio.timeout(2):
                async with self.pool.connection() as conn:
                    await conn.execute("SELECT 1")
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            return ComponentHealth(ok=False, detail=redact_text(f"{type(exc).__name__}: {exc}"))
        return ComponentHealth(ok=True, detail="reachable")

    async def _check_redis(self) -> ComponentHealth:
        import redis.asyncio as redis

        assert self.redis_url is not None  # noqa: S101 - called only with Redis
        client = redis.Redis.from_url(self.redis_url, socket_timeout=2, socket_connect_timeout=2)
        try:
            async with asyncio.timeout(2):
                await client.ping()
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            return ComponentHealth(ok=False, detail=redact_text(f"{type(exc).__name__}: {exc}"))
        finally:
            await client.aclose()
        return ComponentHealth(ok=True, detail="reachable")
