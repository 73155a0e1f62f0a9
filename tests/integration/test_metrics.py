"""``GET /metrics`` of a running runtime: real ticks, a failing handler, a lost lease, a dead row.

One Sdcore on a fresh database and the shared Redis (keys under a prefix of this test), served
by FastAPI over ASGI; the exposition is parsed with ``prometheus_client``'s own parser.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import psycopg
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from sdcore.fastapi import Sdcore, install, metrics_router
from sdcore.metrics import METRIC_NAMES, SdcoreMetrics
from sdcore.outbox import Outbox
from sdcore.queues import Job, Processor
from sdcore.scheduling import Tick
from tests.integration._redis_prefix import REDIS_URL, redis_prefix

pytestmark = pytest.mark.postgres

BOUNDED_LABELS = {"schedule", "outcome", "job", "queue", "reason", "status", "le"}

# What the scrape must show before the values are checked (name, labels, at least).
EXPECTED: list[tuple[str, dict[str, str], float]] = [
    ("sdcore_schedule_runs_total", {"schedule": "ok", "outcome": "success"}, 2),
    ("sdcore_schedule_runs_total", {"schedule": "victim", "outcome": "lost_lease"}, 1),
    ("sdcore_schedule_runs_total", {"schedule": "boom", "outcome": "failure"}, 2),
    ("sdcore_outbox_messages", {"status": "dead"}, 1),
    ("sdcore_queue_jobs_total", {"queue": "mq", "outcome": "completed"}, 1),
    ("sdcore_schedule_missed_ticks", {"schedule": "absent"}, 2),
    # The window starts at the schedule's first row: its first tick is not judged.
    ("sdcore_schedule_missed_ticks", {"schedule": "boom"}, 1),
]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    """A BullMQ key prefix of this test; its keys are deleted afterwards."""
    async with redis_prefix() as name:
        yield name


class Echo(Processor):
    queue = "mq"

    async def process(self, job: Job) -> Any:
        return {"ok": True}


def parse(text: str) -> Samples:
    """Every sample of the exposition, keyed by (sample name, sorted labels)."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def _release(dsn: str, lease_id: str) -> None:
    """What an operator's ``sdcore jobs release`` does: the run's row is FAIL, not ours."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("UPDATE job_scheduler SET status = 'FAIL' WHERE id = %s", (lease_id,))


async def test_metrics_of_a_running_runtime(make_dsn: Callable[[], str], prefix: str) -> None:
    dsn = make_dsn()
    metrics = SdcoreMetrics(missed_settle_s=1.0, cache_s=0.0)
    sd = Sdcore(
        database_url=dsn,
        redis_url=REDIS_URL,
        queue_prefix=prefix,
        processors=[Echo()],
        outbox=Outbox(max_attempts=1),
        metrics=metrics,
    )
    released: list[str] = []

    @sd.scheduler.interval(300, name="ok")
    async def ok(tick: Tick) -> None:
        return None

    @sd.scheduler.interval(300, name="boom")
    async def boom(tick: Tick) -> None:
        raise RuntimeError("planned failure")

    @sd.scheduler.interval(300, name="victim", lease_ms=3000, heartbeat_ms=100)
    async def victim(tick: Tick) -> None:
        if released:
            return
        assert tick.lease is not None
        released.append(tick.lease.id)
        await _release(dsn, tick.lease.id)
        await asyncio.sleep(30)  # cancelled when the refused heartbeat loses the lease

    @sd.scheduler.interval(300, name="absent")
    async def absent(tick: Tick) -> None:  # never runs: its replica is "down"
        return None

    sd.scheduler.stop("absent")
    app = FastAPI(lifespan=sd.lifespan)
    install(app, sd)
    app.include_router(metrics_router())

    async with sd:
        async with sd.pool.connection() as conn, conn.transaction():
            await sd.outbox.enqueue_once(
                conn, idempotency_key="good", queue="mq", name="n", payload={"a": 1}
            )
            await sd.outbox.enqueue_once(
                conn, idempotency_key="poison", queue="mq", name="n", payload={"a": 2}
            )
            # A row edited by hand: the relay refuses its job id, and with one attempt it is DEAD.
            await conn.execute("UPDATE outbox SET job_id = 'bad' WHERE idempotency_key = 'poison'")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            samples: Samples = {}
            async with asyncio.timeout(30):
                while True:
                    response = await client.get("/metrics")
                    assert response.status_code == 200
                    assert response.headers["content-type"].startswith("text/plain")
                    samples = parse(response.text)
                    if all(value(samples, n, **labels) >= low for n, labels, low in EXPECTED):
                        break
                    await asyncio.sleep(0.3)

    # Runs by schedule and outcome; a lost lease is its own outcome, and counted per job.
    assert (
        value(samples, "sdcore_schedule_runs_total", schedule="victim", outcome="lost_lease") == 1
    )
    assert value(samples, "sdcore_job_leases_lost_total", job="victim") == 1
    assert value(samples, "sdcore_schedule_runs_total", schedule="ok", outcome="failure") == 0
    assert value(samples, "sdcore_job_leases_acquired_total", job="ok") >= 2
    # Every started tick was timed; its start lag is a lag, not an age.
    lag_count = value(samples, "sdcore_schedule_tick_lag_seconds_count", schedule="ok")
    assert lag_count >= 2
    assert (
        0 <= value(samples, "sdcore_schedule_tick_lag_seconds_sum", schedule="ok") < 5 * lag_count
    )
    assert value(samples, "sdcore_schedule_run_duration_seconds_count", schedule="boom") >= 2
    # Cluster figures from the database: the stopped schedule missed ticks, the failing one too
    # (a FAIL row is not a run), the healthy one none.
    assert value(samples, "sdcore_cluster_metrics_up") == 1
    assert value(samples, "sdcore_schedule_missed_ticks", schedule="ok") == 0
    assert value(samples, "sdcore_schedule_missed_ticks", schedule="boom") >= 1
    # The poisoned message failed its only attempt and is DEAD; the good one went out.
    assert value(samples, "sdcore_outbox_messages", status="dead") == 1
    assert value(samples, "sdcore_outbox_messages", status="pending") == 0
    assert value(samples, "sdcore_outbox_oldest_pending_age_seconds") == 0
    assert value(samples, "sdcore_outbox_published_total", queue="mq") == 1
    assert value(samples, "sdcore_outbox_publish_failures_total", queue="mq") == 1
    assert value(samples, "sdcore_outbox_relay_batches_total") >= 1
    assert value(samples, "sdcore_queue_jobs_total", queue="mq", outcome="completed") == 1
    # Names are documented ones, labels bounded: no run key, id or token ever is a label.
    families = {name for name, _ in samples}
    for name in families:
        base = name.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
        assert base in METRIC_NAMES or name in METRIC_NAMES or base.endswith("_created"), name
    labels = {key for _, pairs in samples for key, _ in pairs}
    assert labels <= BOUNDED_LABELS


async def test_metrics_off_means_404_and_no_registry(make_dsn: Callable[[], str]) -> None:
    sd = Sdcore(database_url=make_dsn())
    assert sd.metrics is None
    app = FastAPI(lifespan=sd.lifespan)
    install(app, sd)
    app.include_router(metrics_router())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        response = await client.get("/metrics")
    assert response.status_code == 404
    assert "metrics=True" in response.text
