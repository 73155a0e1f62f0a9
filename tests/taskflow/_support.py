"""Helpers shared by the TaskFlow tests (``conftest.py`` put ``examples/taskflow`` on the path)."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
from fastapi.testclient import TestClient
from httpx2 import Response
from psycopg.conninfo import conninfo_to_dict
from taskflow.auth import encode_token
from taskflow.clock import utc_now
from taskflow.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "taskflow"

SettingsFactory = Callable[..., Settings]
"""``make_settings(**overrides)`` (fixture): settings on the test's own database."""

SECRET = "taskflow-test-secret-0123456789abcdef"
REDIS_URL = os.environ.get("SDCORE_TEST_REDIS_URL", "redis://127.0.0.1:6379")


def database_url_of(dsn: str) -> str:
    """Turn the fixture's libpq DSN (``key=value``) into a ``postgresql://`` URL."""
    params = conninfo_to_dict(dsn)
    user = quote(str(params.get("user", "postgres")))
    password = params.get("password")
    auth = f"{user}:{quote(str(password))}" if password else user
    host = params.get("host", "127.0.0.1")
    port = params.get("port", 5432)
    return f"postgresql://{auth}@{host}:{port}/{params['dbname']}"


def job_keys(prefix: str, queue: str = "notifications") -> list[str]:
    """The BullMQ job hashes of ``queue`` (job ids are ``sd2-…``, from the outbox and the key)."""
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        return [
            key
            for key in client.scan_iter(match=f"{prefix}:{queue}:sd*", count=1000)
            if key.count(":") == prefix.count(":") + 2  # not the job's :lock / :logs keys
        ]
    finally:
        client.close()


def token_for(user_id: uuid.UUID, *, email: str | None = None, secret: str = SECRET) -> str:
    """A valid Bearer token for ``user_id``."""
    return encode_token(user_id, secret, now=utc_now(), email=email)


class Api:
    """A TestClient with TaskFlow's calls, one user at a time."""

    def __init__(self, client: TestClient) -> None:
        self.client = client

    @staticmethod
    def headers(user: uuid.UUID, email: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token_for(user, email=email)}"}

    def project(
        self, owner: uuid.UUID, *, email: str | None = None, members: list[uuid.UUID] | None = None
    ) -> str:
        response = self.client.post(
            "/v1/projects",
            json={"name": "Launch", "members": [str(m) for m in members or []]},
            headers=self.headers(owner, email),
        )
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    def task(self, user: uuid.UUID, project: str, *, due_date: str | None = None) -> str:
        response = self.client.post(
            f"/v1/projects/{project}/tasks",
            json={"title": "Write the tutorial", "due_date": due_date},
            headers=self.headers(user),
        )
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    def set_status(self, user: uuid.UUID, task: str, status: str) -> Response:
        return self.client.patch(
            f"/v1/tasks/{task}/status", json={"status": status}, headers=self.headers(user)
        )

    def get(self, user: uuid.UUID, task: str) -> Response:
        return self.client.get(f"/v1/tasks/{task}", headers=self.headers(user))


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``predicate`` until true or ``timeout`` seconds passed; return its last value."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def messages(caplog: pytest.LogCaptureFixture, logger_prefix: str = "taskflow") -> list[str]:
    """The formatted messages logged so far by ``logger_prefix`` loggers."""
    return [r.getMessage() for r in list(caplog.records) if r.name.startswith(logger_prefix)]


def records(
    caplog: pytest.LogCaptureFixture, level: int = logging.ERROR
) -> list[logging.LogRecord]:
    """Records at ``level`` or above."""
    return [r for r in list(caplog.records) if r.levelno >= level]
