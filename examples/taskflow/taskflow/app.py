"""``create_app(settings)``: the FastAPI application, wired to sdcore.

What runs where (one process; every replica is the same):

- the HTTP API (``taskflow.api``) and its ``TasksService``;
- sdcore's ``Sdcore`` runtime: pool, lease tables, event bus, scheduler (``mark-overdue-tasks``),
  and, only with ``REDIS_URL``, the outbox relay and the ``notifications`` worker;
- ``NotificationsListener`` on ``task.status.changed``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI
from sdcore.fastapi import Sdcore, install
from sdcore.scheduling import SchedulingSettings
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from taskflow.api import router
from taskflow.clock import APP_TIME_ZONE, Clock, utc_now
from taskflow.db import create_schema, session_factory
from taskflow.errors import install_error_handlers
from taskflow.events import TASK_STATUS_CHANGED
from taskflow.health import router as health_router
from taskflow.limits import BodyLimit
from taskflow.notifications import (
    EmailSender,
    NotificationOutbox,
    NotificationsListener,
    Notifier,
    job_options,
    log_email,
    simulated_email,
)
from taskflow.overdue import OverdueJob, register_overdue_job
from taskflow.settings import Settings
from taskflow.tasks import BeforeCommit, TasksService

if TYPE_CHECKING:
    from sdcore.queues import Processor


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskFlow:
    """What the routes reach through ``request.app.state.taskflow``."""

    settings: Settings
    sd: Sdcore
    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    tasks: TasksService
    overdue: OverdueJob


def create_app(
    settings: Settings,
    *,
    clock: Clock = utc_now,
    notify: Notifier = simulated_email,
    send_email: EmailSender = log_email,
    before_commit: BeforeCommit | None = None,
) -> FastAPI:
    """Build the application; nothing connects until its lifespan starts.

    Args:
        settings: See :class:`~taskflow.settings.Settings`.
        clock: Where events' ``occurred_at`` comes from.
        notify: The listener's simulated sender (no Redis).
        send_email: The processor's sender (Redis).
        before_commit: Test hook run just before a status change commits.
    """
    processors: list[Processor] = []
    if settings.queues_enabled and settings.run_workers:
        # Imported only now: without REDIS_URL, neither sdcore.queues nor bullmq is loaded
        # (the seed's ConditionalModule.registerWhen(NotificationsQueueModule, ...)).
        from taskflow.queueing import NotificationsProcessor

        processors.append(NotificationsProcessor(send=send_email))

    sd = Sdcore(
        database_url=settings.libpq_url,
        redis_url=settings.redis_url,
        scheduling=SchedulingSettings(time_zone=APP_TIME_ZONE),
        processors=processors,
        queue_prefix=settings.queue_prefix,
    )
    engine = create_async_engine(
        # hide_parameters: a failing statement's log lines never carry user data.
        settings.sqlalchemy_url,
        pool_size=5,
        max_overflow=5,
        pool_pre_ping=True,
        hide_parameters=True,
    )
    sessions = session_factory(engine)

    outbox = None
    if settings.queues_enabled:
        options = job_options(
            attempts=settings.notify_attempts, backoff_ms=settings.notify_backoff_ms
        )
        outbox = NotificationOutbox(sd.outbox, options=options)
    tasks = TasksService(
        sessions, sd.events, clock=clock, notifications=outbox, before_commit=before_commit
    )
    listener = NotificationsListener(queued=settings.queues_enabled, notify=notify)
    sd.events.on(TASK_STATUS_CHANGED, listener, deferred=True)

    overdue = OverdueJob(sessions, replica=settings.replica_name)
    register_overdue_job(sd.scheduler, overdue, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Our tables first: the scheduler, started by sd.lifespan, may fire at once.
        await create_schema(engine)
        try:
            async with sd.lifespan(app):
                yield
        finally:
            await engine.dispose()

    app = FastAPI(title="TaskFlow", version="1.0", lifespan=lifespan)
    app.state.taskflow = TaskFlow(
        settings=settings, sd=sd, engine=engine, sessions=sessions, tasks=tasks, overdue=overdue
    )
    install(app, sd)
    install_error_handlers(app)
    app.include_router(health_router)
    app.include_router(router)
    # Outermost: bodies are bounded (and anonymous /v1 calls refused) before anything reads them.
    app.add_middleware(BodyLimit, settings=settings)
    return app
