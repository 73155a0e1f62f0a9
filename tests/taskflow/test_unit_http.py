"""Unit tests, no network: problem+json shapes, the schedule's declaration, listener, processor.

``TestClient(app)`` without ``with`` does not run the lifespan, so nothing connects: every
request here is answered before the database would be touched (auth, validation, routing).
"""

from __future__ import annotations

import itertools
import logging
import uuid
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any, cast
from zoneinfo import ZoneInfo

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from taskflow.app import TaskFlow, create_app
from taskflow.clock import business_day
from taskflow.db import TaskStatus
from taskflow.errors import PROBLEM_JSON, ForbiddenError, NotFoundError, install_error_handlers
from taskflow.events import TaskStatusChanged
from taskflow.notifications import (
    Email,
    NotificationsListener,
    job_options,
    job_payload,
)
from taskflow.overdue import SCHEDULE
from taskflow.settings import Settings

from sdcore.queues import Job
from tests.taskflow._support import SECRET, token_for

PARIS = ZoneInfo("Europe/Paris")
USER = uuid.UUID(int=7)
TASK = uuid.UUID(int=42)


@pytest.fixture
def client() -> TestClient:
    settings = Settings(database_url="postgresql://nobody@127.0.0.1:1/none", jwt_secret=SECRET)
    return TestClient(create_app(settings))


def _assert_problem(response: Any, status: int, title: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM_JSON
    body: dict[str, Any] = response.json()
    assert body["type"] == "about:blank"
    assert body["title"] == title
    assert body["status"] == status
    return body


def test_401_without_a_token(client: TestClient) -> None:
    response = client.patch(f"/v1/tasks/{TASK}/status", json={"status": "DONE"})
    body = _assert_problem(response, 401, "Unauthorized")
    assert body["detail"] == "A Bearer token is required."
    assert body["instance"] == f"/v1/tasks/{TASK}/status"
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(
    "authorization",
    ["Basic dXNlcjpwYXNz", "Bearer not-a-jwt", f"Bearer {token_for(USER, secret='x' * 40)}"],
    ids=["basic", "junk", "wrong-key"],
)
def test_401_with_a_bad_token(client: TestClient, authorization: str) -> None:
    response = client.get(f"/v1/tasks/{TASK}", headers={"Authorization": authorization})
    _assert_problem(response, 401, "Unauthorized")


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"status": "FINISHED"}, ["body", "status"]),
        ({"status": "OVERDUE"}, ["body", "status"]),  # the nightly job's, not a client's
        ({"status": "done"}, ["body", "status"]),
        ({}, ["body", "status"]),
        ({"status": "DONE", "title": "x"}, ["body", "title"]),
    ],
    ids=["unknown", "overdue", "lowercase", "missing", "extra-field"],
)
def test_422_invalid_status(client: TestClient, body: dict[str, str], loc: list[str]) -> None:
    response = client.patch(
        f"/v1/tasks/{TASK}/status",
        json=body,
        headers={"Authorization": f"Bearer {token_for(USER)}"},
    )
    problem = _assert_problem(response, 422, "Unprocessable Entity")
    assert problem["detail"] == "The request is not valid."
    assert [error["loc"] for error in problem["errors"]] == [loc]
    assert all(error["msg"] for error in problem["errors"])


def test_422_task_id_not_a_uuid(client: TestClient) -> None:
    response = client.get("/v1/tasks/42", headers={"Authorization": f"Bearer {token_for(USER)}"})
    problem = _assert_problem(response, 422, "Unprocessable Entity")
    assert problem["errors"][0]["loc"] == ["path", "task_id"]


def test_unknown_route_and_wrong_method_are_problems_too(client: TestClient) -> None:
    _assert_problem(client.get("/v2/nothing"), 404, "Not Found")
    _assert_problem(client.delete(f"/v1/tasks/{TASK}/status"), 405, "Method Not Allowed")


def test_domain_and_unexpected_errors() -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/missing")
    async def missing() -> None:
        raise NotFoundError("Task 42 not found.")

    @app.get("/forbidden")
    async def forbidden() -> None:
        raise ForbiddenError("Only the project owner may archive it.")

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret internals")

    client = TestClient(app, raise_server_exceptions=False)
    body = _assert_problem(client.get("/missing"), 404, "Not Found")
    assert body == {
        "type": "about:blank",
        "title": "Not Found",
        "status": 404,
        "detail": "Task 42 not found.",
        "instance": "/missing",
    }
    body = _assert_problem(client.get("/forbidden"), 403, "Forbidden")
    assert body["detail"] == "Only the project owner may archive it."
    body = _assert_problem(client.get("/boom"), 500, "Internal Server Error")
    assert "detail" not in body  # internals are logged, never returned


# --------------------------------------------------------------------------- the schedule


def test_the_overdue_job_is_declared_at_1am_paris(client: TestClient) -> None:
    state = cast(FastAPI, client.app).state.taskflow
    assert isinstance(state, TaskFlow)
    info = state.sd.scheduler.get(SCHEDULE)
    assert info.time_zone == "Europe/Paris"
    assert info.description == "0 01 * * *"
    assert info.exclusive


@pytest.mark.parametrize(
    ("start", "end"),
    [
        (datetime(2026, 3, 27, tzinfo=UTC), datetime(2026, 4, 1, tzinfo=UTC)),
        (datetime(2026, 10, 23, tzinfo=UTC), datetime(2026, 10, 28, tzinfo=UTC)),
        (datetime(2026, 6, 29, tzinfo=UTC), datetime(2026, 7, 3, tzinfo=UTC)),
    ],
    ids=["spring-forward", "fall-back", "summer"],
)
def test_one_tick_per_paris_day_at_1am_across_dst(
    client: TestClient, start: datetime, end: datetime
) -> None:
    state = cast(FastAPI, client.app).state.taskflow
    ticks = state.sd.scheduler.expected_ticks(SCHEDULE, start, end)
    local = [tick.astimezone(PARIS) for tick in ticks]
    assert [(t.hour, t.minute) for t in local] == [(1, 0)] * len(ticks)
    days = [business_day(tick) for tick in ticks]
    assert days == [t.date() for t in local]
    assert [(b - a).days for a, b in itertools.pairwise(days)] == [1] * (len(days) - 1)
    if start.month == 6:
        assert datetime(2026, 6, 30, 23, 0, tzinfo=UTC) in ticks  # the seed's instant


# --------------------------------------------------------------------------- notifications


def _event() -> TaskStatusChanged:
    return TaskStatusChanged(
        task_id=TASK,
        project_id=uuid.UUID(int=1),
        from_status=TaskStatus.TODO,
        to_status=TaskStatus.DONE,
        changed_by=USER,
        occurred_at=datetime(2026, 7, 1, 8, 30, tzinfo=UTC),
    )


async def test_listener_without_redis_logs_a_simulated_email(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="taskflow")
    await NotificationsListener(queued=False)(_event())
    assert f"[simulated email] task {TASK}: TODO -> DONE" in caplog.messages


async def test_listener_failure_is_logged_with_the_task_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def broken(event: TaskStatusChanged) -> None:
        raise ConnectionError("SMTP down")

    await NotificationsListener(queued=False, notify=broken)(_event())  # does not raise
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.getMessage() == f"notification for task {TASK} failed: ConnectionError: SMTP down"
    assert getattr(record, "task_id", None) == str(TASK)


async def test_listener_with_redis_leaves_the_job_to_the_outbox() -> None:
    called: list[TaskStatusChanged] = []

    async def notify(event: TaskStatusChanged) -> None:
        called.append(event)

    await NotificationsListener(queued=True, notify=notify)(_event())
    assert called == []


def test_job_options_and_payload() -> None:
    assert job_options() == {
        "attempts": 5,
        "backoff": {"type": "exponential", "delay": 1000},
        "removeOnComplete": {"count": 1000},
        "removeOnFail": {"age": 7 * 24 * 3600},
    }
    assert job_payload(_event(), recipient="ada@example.com") == {
        "taskId": str(TASK),
        "projectId": str(uuid.UUID(int=1)),
        "from": "TODO",
        "to": "DONE",
        "changedBy": str(USER),
        "recipient": "ada@example.com",
        "occurredAt": "2026-07-01T08:30:00+00:00",
    }


async def test_processor_numbers_attempts_and_logs_the_final_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from taskflow.queueing import NotificationsProcessor

    sent: list[Email] = []

    async def send(email: Email) -> None:
        sent.append(email)

    processor = NotificationsProcessor(send=send)
    job = cast(
        Job,
        SimpleNamespace(
            id="sd-1",
            data={"recipient": "ada@example.com", "taskId": str(TASK), "to": "DONE"},
            attemptsMade=2,
        ),
    )
    await processor.process(job)
    assert sent == [Email(recipient="ada@example.com", task_id=str(TASK), status="DONE", attempt=3)]
    await processor.on_failed(job, RuntimeError("bounced"), final=True)
    assert caplog.messages[-1] == (
        f"Email for task {TASK} failed for good after 2 attempt(s): RuntimeError: bounced"
    )
