"""sdcore.fastapi: lifespan order, dependencies, health, with and without Redis."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from sdcore.events import EventBus
from sdcore.fastapi import (
    EventsDep,
    JobsDep,
    OutboxDep,
    SchedulerDep,
    Sdcore,
    health_router,
    install,
)
from sdcore.scheduling import SchedulingSettings, Tick

REDIS = "redis://127.0.0.1:6379/0"


def _app(sd: Sdcore) -> FastAPI:
    app = FastAPI(lifespan=sd.lifespan)
    install(app, sd)
    app.include_router(health_router(details=True))

    @app.get("/deps")
    async def deps(
        jobs: JobsDep, events: EventsDep, outbox: OutboxDep, scheduler: SchedulerDep
    ) -> dict[str, Any]:
        return {
            "jobs": type(jobs).__name__,
            "events": isinstance(events, EventBus),
            "outbox": outbox.table,
            "schedules": [s.name for s in scheduler.schedules()],
        }

    @app.post("/emit")
    async def emit(events: EventsDep) -> dict[str, bool]:
        return {"listened": events.emit("thing.done", {"id": 1})}

    return app


def test_without_redis_everything_but_queues_runs(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    sd = Sdcore(database_url=pg_dsn, scheduling=SchedulingSettings(time_zone="Europe/Paris"))
    ticks: list[str] = []
    heard: list[Any] = []
    sd.events.on("thing.*", heard.append)

    @sd.scheduler.interval(200, name="beat")
    async def beat(tick: Tick) -> None:
        assert tick.lease is not None
        ticks.append(tick.run_key or "")

    with TestClient(_app(sd)) as client:
        health = client.get("/health")
        assert health.status_code == 200
        body = health.json()
        assert body["status"] == "ok"
        assert body["database"]["ok"]
        assert "not configured" in body["redis"]["detail"]
        assert client.get("/deps").json() == {
            "jobs": "JobSchedulerService",
            "events": True,
            "outbox": "outbox",
            "schedules": ["beat"],
        }
        assert client.post("/emit").json() == {"listened": True}
        time.sleep(0.7)
    assert heard == [{"id": 1}]
    assert ticks
    assert sd.publisher is None
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            "SELECT run_key, status, data, created_at, modified_at FROM job_scheduler"
        ).fetchall()
        tables = {
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname='public'"
            ).fetchall()
        }
    # Every tick's row is SUCCESS; if one is not, the failing rows and what the handler saw (in
    # the assertion's message) say why.
    assert rows, "no lease row: the ticks ran without the lease"
    failed = [row for row in rows if row[1] != "SUCCESS"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not failed, f"rows not SUCCESS: {failed}; ticks: {ticks}; warnings: {warnings}"
    assert {"job_scheduler", "outbox"} <= tables


def test_shutdown_cancels_a_long_tick_and_leaves_fail(pg_dsn: str) -> None:
    sd = Sdcore(database_url=pg_dsn, grace_period_ms=200)
    started = threading.Event()

    @sd.scheduler.interval(100, name="long")
    async def long(tick: Tick) -> None:
        started.set()
        import asyncio

        await asyncio.sleep(30)

    with TestClient(_app(sd)):
        assert started.wait(5)
    with psycopg.connect(pg_dsn) as conn:
        statuses = {r[0] for r in conn.execute("SELECT status FROM job_scheduler").fetchall()}
    assert statuses == {"FAIL"}


@pytest.mark.slow
def test_with_redis_the_relay_publishes_and_health_reports_it(pg_dsn: str) -> None:
    pytest.importorskip("bullmq")
    from sdcore.queues import Job, Processor

    prefix = f"sdcore-test-{uuid.uuid4().hex[:8]}"
    seen: list[dict[str, Any]] = []
    done = threading.Event()

    class Mail(Processor):
        queue = "mail"

        async def process(self, job: Job) -> None:
            seen.append(dict(job.data))
            done.set()

    sd = Sdcore(database_url=pg_dsn, redis_url=REDIS, processors=[Mail()], queue_prefix=prefix)
    app = _app(sd)

    @app.post("/send")
    async def send(outbox: OutboxDep) -> dict[str, bool]:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn, conn.transaction():
            created = await outbox.enqueue_once(
                conn,
                idempotency_key="mail-1",
                queue="mail",
                name="send",
                payload={"to": "a@example.com"},
            )
        return {"created": created}

    try:
        with TestClient(app) as client:
            assert client.post("/send").json() == {"created": True}
            assert done.wait(15)
            body = client.get("/health").json()
            assert body["status"] == "ok", body
            assert body["redis"]["ok"]
            assert body["relay"]["ok"]
    finally:
        import redis

        r = redis.Redis.from_url(REDIS)
        for key in r.scan_iter(f"{prefix}:*"):
            r.delete(key)
        r.close()
    assert seen == [{"to": "a@example.com"}]


def test_unreachable_redis_is_reported_degraded(pg_dsn: str) -> None:
    pytest.importorskip("bullmq")
    sd = Sdcore(database_url=pg_dsn, redis_url="redis://127.0.0.1:1/0", relay=None)
    with TestClient(_app(sd)) as client:
        response = client.get("/health")
    assert response.status_code == 503
    assert response.json()["redis"]["ok"] is False


def test_configuration_errors() -> None:
    with pytest.raises(ValueError, match="database_url"):
        Sdcore(database_url="")
    with pytest.raises(ValueError, match="redis_url"):
        Sdcore(database_url="postgresql://x/y", processors=[object()])  # type: ignore[list-item]


def test_health_details_only_for_whom_the_gate_lets_through(pg_dsn: str) -> None:
    """Anonymous /health shows no internal hosts, ports or exception text."""
    sd = Sdcore(database_url=pg_dsn)
    app = FastAPI(lifespan=sd.lifespan)
    install(app, sd)
    app.include_router(health_router())
    secret = "operator-token"

    async def operator(request: Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {secret}"

    app.include_router(health_router(path="/health/full", details=operator))
    with TestClient(app) as client:
        anonymous = client.get("/health").json()
        assert anonymous == {
            "status": "ok",
            "database": {"ok": True},
            "redis": {"ok": True},
        }
        assert "detail" not in client.get("/health/full").json()["database"]
        full = client.get("/health/full", headers={"authorization": f"Bearer {secret}"}).json()
        assert full["database"] == {"ok": True, "detail": "reachable"}
