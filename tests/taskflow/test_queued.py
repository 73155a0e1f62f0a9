"""End to end with Redis: status change → outbox (same transaction) → relay → BullMQ → processor.

Every test has its own BullMQ prefix on the shared Redis (deleted afterwards) and its own
database. The processor runs in the app's process, as by default.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

import psycopg
import pytest
import redis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from taskflow.app import create_app
from taskflow.db import TaskStatus
from taskflow.events import TASK_STATUS_CHANGED, TaskStatusChanged
from taskflow.notifications import Email, log_email

from tests.taskflow._support import (
    REDIS_URL,
    Api,
    SettingsFactory,
    job_keys,
    messages,
    wait_for,
)

ALICE = uuid.UUID("a11ce000-0000-4000-8000-000000000001")


def _outbox(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT idempotency_key, queue, name, status, payload FROM outbox ORDER BY id"
        ).fetchall()


def _recorder(app: FastAPI) -> list[TaskStatusChanged]:
    heard: list[TaskStatusChanged] = []
    app.state.taskflow.sd.events.on(TASK_STATUS_CHANGED, heard.append)
    return heard


def test_a_status_change_reaches_the_processor(
    make_settings: SettingsFactory,
    redis_prefix: str,
    pg_dsn: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    app = create_app(make_settings(redis_url=REDIS_URL, queue_prefix=redis_prefix))
    with TestClient(app) as client:
        api = Api(client)
        task = api.task(ALICE, api.project(ALICE, email="alice@example.com"))
        response = api.set_status(ALICE, task, "DONE")
        assert response.status_code == 200
        assert response.json()["status"] == "DONE"
        line = f"Email to alice@example.com: task {task} is now DONE (attempt 1)"
        assert wait_for(lambda: line in messages(caplog), timeout=15), messages(caplog)
    # The simulated path stays quiet: the queued path owns this notification.
    assert not [m for m in messages(caplog) if "[simulated email]" in m]
    [(key, queue, name, status, payload)] = _outbox(pg_dsn)
    assert (key, queue, name, status) == (
        f"task-status-changed:{task}:v1",
        "notifications",
        "task-status-changed",
        "PUBLISHED",
    )
    assert payload["recipient"] == "alice@example.com"
    assert (payload["from"], payload["to"]) == ("TODO", "DONE")
    [job] = job_keys(redis_prefix)
    client_ = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        options = json.loads(str(client_.hget(job, "opts")))
    finally:
        client_.close()
    assert options["attempts"] == 5
    assert options["backoff"] == {"type": "exponential", "delay": 1000}
    assert options["removeOnComplete"] == {"count": 1000}


def test_a_failing_send_is_retried_with_backoff_then_logged(
    make_settings: SettingsFactory, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    tries: dict[str, list[float]] = {}

    async def flaky(email: Email) -> None:
        tries.setdefault(email.task_id, []).append(time.monotonic())
        if email.task_id == doomed or email.attempt < 2:
            raise ConnectionError(f"SMTP 451 for attempt {email.attempt}")
        await log_email(email)

    settings = make_settings(
        redis_url=REDIS_URL, queue_prefix=redis_prefix, notify_attempts=3, notify_backoff_ms=100
    )
    with TestClient(create_app(settings, send_email=flaky)) as client:
        api = Api(client)
        project = api.project(ALICE, email="alice@example.com")
        doomed, recovers = api.task(ALICE, project), api.task(ALICE, project)
        assert api.set_status(ALICE, doomed, "DONE").status_code == 200
        assert api.set_status(ALICE, recovers, "IN_PROGRESS").status_code == 200
        final = f"Email for task {doomed} failed for good after 3 attempt(s)"
        sent = f"Email to alice@example.com: task {recovers} is now IN_PROGRESS (attempt 2)"

        def settled() -> bool:
            seen = messages(caplog)
            return sent in seen and any(m.startswith(final) for m in seen)

        assert wait_for(settled, timeout=20), messages(caplog)
    assert len(tries[doomed]) == 3
    assert len(tries[recovers]) == 2
    first, second = (b - a for a, b in zip(tries[doomed], tries[doomed][1:], strict=False))
    # Exponential from 100 ms: ~100 ms, then ~200 ms (BullMQ's timers are not exact upwards).
    assert 0.09 <= first < 1.5
    assert 0.19 <= second < 2.0
    finals = [r for r in caplog.records if getattr(r, "action", None) == "job_failed_final"]
    assert len(finals) == 1  # sdcore's own record of the final failure, next to ours
    retries = [m for m in messages(caplog) if m.startswith(f"Email for task {doomed} failed (")]
    assert len(retries) == 2


def test_a_rolled_back_change_enqueues_nothing(
    make_settings: SettingsFactory,
    redis_prefix: str,
    pg_dsn: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)

    async def fail_done(session: Any, task: Any) -> None:
        # After the UPDATE and the outbox INSERT, before the COMMIT.
        if task.status is TaskStatus.DONE:
            raise RuntimeError("forced failure before commit")

    settings = make_settings(redis_url=REDIS_URL, queue_prefix=redis_prefix)
    app = create_app(settings, before_commit=fail_done)
    heard = _recorder(app)
    with TestClient(app, raise_server_exceptions=False) as client:
        api = Api(client)
        task = api.task(ALICE, api.project(ALICE))
        assert api.set_status(ALICE, task, "DONE").status_code == 500
        assert _outbox(pg_dsn) == []
        # Control: a change that commits goes all the way, so the silence above means something.
        assert api.set_status(ALICE, task, "IN_PROGRESS").status_code == 200
        line = f"task {task} is now IN_PROGRESS (attempt 1)"
        assert wait_for(lambda: any(line in m for m in messages(caplog)), timeout=15)
    assert [(e.from_status, e.to_status) for e in heard] == [
        (TaskStatus.TODO, TaskStatus.IN_PROGRESS)
    ]
    assert [row[0] for row in _outbox(pg_dsn)] == [f"task-status-changed:{task}:v1"]
    assert len(job_keys(redis_prefix)) == 1
    assert not [m for m in messages(caplog) if "is now DONE" in m]
