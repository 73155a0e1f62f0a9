"""End to end over HTTP, real PostgreSQL, no Redis: the status change and what follows it.

``with TestClient(app)`` runs the lifespan (tables, sdcore, the scheduler); leaving the block
drains the event bus, so every deferred listener has run when the assertions look.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import uuid
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from taskflow.app import create_app
from taskflow.db import TaskStatus
from taskflow.errors import PROBLEM_JSON
from taskflow.events import TASK_STATUS_CHANGED, TaskStatusChanged

from tests.taskflow._support import EXAMPLE, SECRET, Api, SettingsFactory, messages, wait_for

ALICE = uuid.UUID("a11ce000-0000-4000-8000-000000000001")
BOB = uuid.UUID("b0b00000-0000-4000-8000-000000000002")
CAROL = uuid.UUID("ca201000-0000-4000-8000-000000000003")
FIXED = datetime(2026, 7, 1, 8, 30, tzinfo=UTC)


def _recorder(app: FastAPI) -> list[TaskStatusChanged]:
    """Every ``task.status.changed`` the app emits (a second listener on its bus)."""
    heard: list[TaskStatusChanged] = []
    app.state.taskflow.sd.events.on(TASK_STATUS_CHANGED, heard.append)
    return heard


def test_patch_commits_then_emits_and_the_listener_simulates_the_email(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    app = create_app(make_settings(), clock=lambda: FIXED)
    heard = _recorder(app)
    with TestClient(app) as client:
        api = Api(client)
        task = api.task(ALICE, api.project(ALICE, email="alice@example.com"))
        response = api.set_status(ALICE, task, "DONE")
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        body = response.json()
        assert body["id"] == task
        assert body["status"] == "DONE"
        line = f"[simulated email] task {task}: TODO -> DONE"
        assert wait_for(lambda: line in messages(caplog))
        assert api.get(ALICE, task).json()["status"] == "DONE"
    assert heard == [
        TaskStatusChanged(
            task_id=uuid.UUID(task),
            project_id=uuid.UUID(body["project_id"]),
            from_status=TaskStatus.TODO,
            to_status=TaskStatus.DONE,
            changed_by=ALICE,
            occurred_at=FIXED,
        )
    ]


def test_same_status_is_200_and_no_event(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    app = create_app(make_settings())
    heard = _recorder(app)
    with TestClient(app) as client:
        api = Api(client)
        task = api.task(ALICE, api.project(ALICE))
        response = api.set_status(ALICE, task, "TODO")
        assert response.status_code == 200
        assert response.json()["status"] == "TODO"
    assert heard == []
    assert not [m for m in messages(caplog) if "[simulated email]" in m]


def test_members_may_change_status_others_get_404(make_settings: SettingsFactory) -> None:
    app = create_app(make_settings())
    heard = _recorder(app)
    with TestClient(app) as client:
        api = Api(client)
        task = api.task(ALICE, api.project(ALICE, members=[BOB]))
        assert api.set_status(BOB, task, "IN_PROGRESS").status_code == 200
        assert api.get(BOB, task).json()["status"] == "IN_PROGRESS"
        # Carol is neither owner nor member: for her the task does not exist (not even 403).
        for response in (api.set_status(CAROL, task, "DONE"), api.get(CAROL, task)):
            assert response.status_code == 404
            assert response.headers["content-type"] == PROBLEM_JSON
            assert response.json()["detail"] == f"Task {task} not found."
        bob_project = api.project(BOB)
        denied = client.post(
            f"/v1/projects/{bob_project}/tasks", json={"title": "x"}, headers=api.headers(CAROL)
        )
        assert denied.status_code == 404
        assert api.get(ALICE, task).json()["status"] == "IN_PROGRESS"
    assert [(e.changed_by, e.to_status) for e in heard] == [(BOB, TaskStatus.IN_PROGRESS)]


def test_errors_over_http_are_problem_json(make_settings: SettingsFactory) -> None:
    with TestClient(create_app(make_settings())) as client:
        api = Api(client)
        task = api.task(ALICE, api.project(ALICE))
        cases: list[tuple[Any, int]] = [
            (client.patch(f"/v1/tasks/{task}/status", json={"status": "DONE"}), 401),
            (api.set_status(ALICE, str(uuid.uuid4()), "DONE"), 404),
            (api.set_status(CAROL, task, "DONE"), 404),
            (api.set_status(ALICE, task, "FINISHED"), 422),
            (api.set_status(ALICE, task, "OVERDUE"), 422),
        ]
        for response, status in cases:
            assert response.status_code == status, response.text
            assert response.headers["content-type"] == PROBLEM_JSON
            body = response.json()
            assert body["status"] == status
            assert body["type"] == "about:blank"
            assert body["instance"].startswith("/v1/tasks/")
        assert api.get(ALICE, task).json()["status"] == "TODO"


def test_a_failing_listener_does_not_fail_the_request(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(event: TaskStatusChanged) -> None:
        raise ConnectionError("SMTP relay refused the connection")

    def raw(event: TaskStatusChanged) -> None:
        # A plain listener runs inside emit(); the bus catches and logs what it raises.
        raise RuntimeError(f"audit store unavailable for task {event.task_id}")

    app = create_app(make_settings(), notify=broken)
    app.state.taskflow.sd.events.on(TASK_STATUS_CHANGED, raw)
    with TestClient(app) as client:
        api = Api(client)
        task = api.task(ALICE, api.project(ALICE))
        response = api.set_status(ALICE, task, "DONE")
        assert response.status_code == 200
        assert response.json()["status"] == "DONE"
        expected = f"notification for task {task} failed: ConnectionError: SMTP relay refused"

        def logged() -> bool:
            return any(
                r.levelno == logging.ERROR and r.getMessage().startswith(expected)
                for r in list(caplog.records)
            )

        assert wait_for(logged)
    [bus_error] = [r for r in caplog.records if getattr(r, "action", None) == "listener_failed"]
    assert f"audit store unavailable for task {task}" in bus_error.getMessage()


def test_a_rolled_back_change_emits_nothing(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture, pg_dsn: str
) -> None:
    caplog.set_level(logging.INFO)

    async def fail_before_commit(session: Any, task: Any) -> None:
        raise RuntimeError("disk full (forced after the UPDATE, before the COMMIT)")

    app = create_app(make_settings(), before_commit=fail_before_commit)
    heard = _recorder(app)
    with TestClient(app, raise_server_exceptions=False) as client:
        api = Api(client)
        task = api.task(ALICE, api.project(ALICE))
        response = api.set_status(ALICE, task, "DONE")
        assert response.status_code == 500
        assert response.headers["content-type"] == PROBLEM_JSON
        assert "disk full" not in response.text
        assert api.get(ALICE, task).json()["status"] == "TODO"
    assert heard == []
    assert not [m for m in messages(caplog) if "[simulated email]" in m]
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute("SELECT status, version FROM tasks").fetchone()
    assert row == ("TODO", 0)


def test_without_redis_no_queue_module_is_loaded(database_url: str) -> None:
    """A fresh interpreter: start the app, change a status, look at ``sys.modules``."""
    script = textwrap.dedent(
        f"""
        import json, logging, sys, uuid
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        from fastapi.testclient import TestClient
        from taskflow.app import create_app
        from taskflow.settings import Settings
        from tests.taskflow._support import Api

        app = create_app(Settings(database_url={database_url!r}, jwt_secret={SECRET!r}))
        user = uuid.uuid4()
        with TestClient(app) as client:
            api = Api(client)
            task = api.task(user, api.project(user))
            status = api.set_status(user, task, "DONE").status_code
        print(json.dumps({{
            "status": status,
            "task": task,
            "queues": "sdcore.queues" in sys.modules,
            "bullmq": "bullmq" in sys.modules,
            "processor": "taskflow.queueing" in sys.modules,
        }}))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLE), str(EXAMPLE.parents[1])])}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {
        "status": 200,
        "task": result["task"],
        "queues": False,
        "bullmq": False,
        "processor": False,
    }
    assert f"[simulated email] task {result['task']}: TODO -> DONE" in done.stderr
