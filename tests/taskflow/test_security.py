"""TaskFlow's request handling at its edges, one request/response test each.

Body limit before parsing and before auth, unstorable text as 422, JWT issuer / audience /
lifetime and weak secrets (the token cases are in ``test_unit_domain.py``), ``/health`` details
for operators only, one-line start-up errors.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.exc import DataError
from taskflow.app import create_app
from taskflow.errors import PROBLEM_JSON
from taskflow.settings import Settings, SettingsError

from tests.taskflow._support import EXAMPLE, SECRET, SettingsFactory, token_for

USER = uuid.UUID(int=7)
OPERATOR = uuid.UUID(int=99)
NOWHERE = "postgresql://nobody@127.0.0.1:1/none"
LIMIT = 64 * 1024


def _settings(**changes: Any) -> Settings:
    values: dict[str, Any] = {"database_url": NOWHERE, "jwt_secret": SECRET}
    values.update(changes)
    return Settings(**values)


def _auth(user: uuid.UUID = USER) -> dict[str, str]:
    return {"Authorization": f"Bearer {token_for(user)}"}


class _Asgi:
    """Drive the app at the ASGI level to see how much of the body it reads."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.read = 0
        self.receives = 0
        self.status = 0
        self.body = b""

    def post(
        self, path: str, headers: dict[str, str], chunks: Iterator[bytes]
    ) -> tuple[int, dict[str, Any]]:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
            "client": ("127.0.0.1", 5000),
            "server": ("127.0.0.1", 8000),
        }
        pending = iter(chunks)

        async def receive() -> dict[str, Any]:
            self.receives += 1
            chunk = next(pending, None)
            if chunk is None:
                return {"type": "http.request", "body": b"", "more_body": False}
            self.read += len(chunk)
            return {"type": "http.request", "body": chunk, "more_body": True}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]
            elif message["type"] == "http.response.body":
                self.body += message.get("body", b"")

        asyncio.run(self.app(scope, receive, send))  # type: ignore[arg-type]
        return self.status, json.loads(self.body)


def _chunks(total: int, size: int = 16 * 1024) -> Iterator[bytes]:
    sent = 0
    while sent < total:
        chunk = b"a" * min(size, total - sent)
        sent += len(chunk)
        yield chunk


# --------------------------------------------------------------------------- body limit


@pytest.mark.parametrize("authorized", [False, True], ids=["anonymous", "with-token"])
def test_a_declared_large_body_gets_413_unread(authorized: bool) -> None:
    driver = _Asgi(create_app(_settings()))
    headers = {"content-type": "application/json", "content-length": str(100 * 1024 * 1024)}
    if authorized:
        headers.update({k.lower(): v for k, v in _auth().items()})
    status, body = driver.post("/v1/projects", headers, _chunks(100 * 1024 * 1024))
    assert status == 413
    assert body["title"] == "Request Entity Too Large"
    assert str(LIMIT) in body["detail"]
    assert driver.read == 0


def test_a_streamed_large_body_is_cut_at_the_limit() -> None:
    driver = _Asgi(create_app(_settings()))
    headers = {"content-type": "application/json", "transfer-encoding": "chunked"}
    headers.update({k.lower(): v for k, v in _auth().items()})
    status, _ = driver.post("/v1/projects", headers, _chunks(50 * 1024 * 1024))
    assert status == 413
    assert driver.read <= LIMIT + 16 * 1024  # one chunk past the limit, not 50 MB


def test_an_anonymous_body_gets_401_before_it_is_read() -> None:
    driver = _Asgi(create_app(_settings()))
    headers = {"content-type": "application/json", "content-length": "60000"}
    status, body = driver.post("/v1/projects", headers, _chunks(60_000))
    assert status == 401
    assert body["detail"] == "A Bearer token is required."
    assert driver.read == 0


def test_the_limit_comes_from_the_settings() -> None:
    client = TestClient(create_app(_settings(max_body_bytes=2048)))
    response = client.post("/v1/projects", json={"name": "x" * 3000}, headers=_auth())
    assert response.status_code == 413
    assert response.headers["content-type"] == PROBLEM_JSON
    with pytest.raises(SettingsError, match="TASKFLOW_MAX_BODY_BYTES"):
        _settings(max_body_bytes=10)


def test_a_body_under_the_limit_reaches_the_app(make_settings: SettingsFactory) -> None:
    members = [str(uuid.uuid4()) for _ in range(100)]  # the largest real body: ~4 KB
    with TestClient(create_app(make_settings())) as client:
        response = client.post(
            "/v1/projects", json={"name": "Launch", "members": members}, headers=_auth()
        )
    assert response.status_code == 201, response.text


def test_responses_are_nosniff_and_api_responses_not_cached() -> None:
    client = TestClient(create_app(_settings()))
    api = client.get(f"/v1/tasks/{uuid.UUID(int=1)}")
    assert api.status_code == 401
    assert api.headers["x-content-type-options"] == "nosniff"
    assert api.headers["cache-control"] == "no-store"
    docs = client.get("/openapi.json")
    assert docs.headers["x-content-type-options"] == "nosniff"
    assert "cache-control" not in docs.headers


# --------------------------------------------------------------------------- text


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/projects", "name", "a\u0000b"),
        ("/v1/projects", "name", "a\u0007b"),
        (f"/v1/projects/{uuid.UUID(int=1)}/tasks", "title", "a\u0000b"),
    ],
    ids=["nul-in-name", "bell-in-name", "nul-in-title"],
)
def test_unstorable_text_is_a_422(
    path: str, field: str, value: str, caplog: pytest.LogCaptureFixture
) -> None:
    client = TestClient(create_app(_settings()))
    caplog.set_level(logging.INFO)
    response = client.post(path, json={field: value}, headers=_auth())
    assert response.status_code == 422, response.text
    [error] = response.json()["errors"]
    assert error["loc"] == ["body", field]
    assert "control character" in error["msg"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_value_the_database_refuses_is_a_422_without_its_parameters(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = create_app(_settings())
    assert app.state.taskflow.engine.sync_engine.hide_parameters

    async def boom() -> None:
        raise DataError("INSERT INTO t VALUES (%(v)s)", {"v": "ada@example.com"}, Exception("x"))

    app.add_api_route("/boom", boom)
    caplog.set_level(logging.INFO)
    response = TestClient(app).get("/boom")
    assert response.status_code == 422
    assert response.headers["content-type"] == PROBLEM_JSON
    assert "ada@example.com" not in caplog.text
    assert "ada@example.com" not in response.text


def test_a_nul_in_the_tokens_email_is_refused_before_the_database() -> None:
    client = TestClient(create_app(_settings()))
    headers = {"Authorization": f"Bearer {token_for(USER, email='a' + chr(0) + '@example.com')}"}
    response = client.post("/v1/projects", json={"name": "x"}, headers=headers)
    assert response.status_code == 401
    assert "email" in response.json()["detail"]


# --------------------------------------------------------------------------- secrets


@pytest.mark.parametrize(
    "secret",
    ["a" * 32, " " * 32, "changeme" * 4, "😀" * 8, "passwordpasswordpasswordpassword"],
    ids=["a-32", "spaces", "changeme", "emoji", "password"],
)
def test_weak_secrets_are_refused_by_entropy(secret: str) -> None:
    assert len(secret.encode()) >= 32  # length alone would accept every one of them
    with pytest.raises(SettingsError, match="too predictable"):
        _settings(jwt_secret=secret)


def test_generated_secrets_are_accepted() -> None:
    for _ in range(50):
        _settings(jwt_secret=secrets.token_urlsafe(32))
        _settings(jwt_secret=secrets.token_hex(32))


def test_a_token_from_another_issuer_gets_401_over_http() -> None:
    import jwt

    now = int(time.time())
    claims = {"sub": str(USER), "iat": now, "exp": now + 60, "aud": "taskflow-api"}
    forged = jwt.encode({**claims, "iss": "https://evil.example"}, SECRET, algorithm="HS256")
    client = TestClient(create_app(_settings()))
    response = client.get(
        f"/v1/tasks/{uuid.UUID(int=1)}", headers={"Authorization": f"Bearer {forged}"}
    )
    assert response.status_code == 401
    assert response.json()["detail"] == "The token was not issued for this service."


# --------------------------------------------------------------------------- /health


def test_health_details_only_for_operators(make_settings: SettingsFactory) -> None:
    settings = make_settings(operator_ids=frozenset({OPERATOR}))
    with TestClient(create_app(settings)) as client:
        anonymous = client.get("/health")
        member = client.get("/health", headers=_auth(USER))
        operator = client.get("/health", headers=_auth(OPERATOR))
        forged = client.get("/health", headers={"Authorization": "Bearer not-a-jwt"})
    assert anonymous.status_code == 200
    assert anonymous.json() == {"status": "ok"}
    assert anonymous.headers["cache-control"] == "no-store"
    assert member.json() == {"status": "ok"}
    body = operator.json()
    assert body["status"] == "ok"
    assert body["database"] == {"ok": True, "detail": "reachable"}
    assert "redis" in body
    assert forged.status_code == 401


def test_degraded_health_hides_the_cause_from_anonymous_callers() -> None:
    app = create_app(_settings(operator_ids=frozenset({OPERATOR})))
    client = TestClient(app)  # no lifespan: the pool never opened, the database check fails
    anonymous = client.get("/health")
    assert anonymous.status_code == 503
    assert anonymous.json() == {"status": "degraded"}
    operator = client.get("/health", headers=_auth(OPERATOR))
    assert operator.status_code == 503
    assert operator.json()["database"]["ok"] is False


def test_operator_ids_must_be_uuids() -> None:
    with pytest.raises(SettingsError, match="TASKFLOW_OPERATOR_IDS"):
        Settings.from_env(
            {
                "DATABASE_URL": NOWHERE,
                "TASKFLOW_JWT_SECRET": SECRET,
                "TASKFLOW_OPERATOR_IDS": "admin",
            }
        )
    settings = Settings.from_env(
        {
            "DATABASE_URL": NOWHERE,
            "TASKFLOW_JWT_SECRET": SECRET,
            "TASKFLOW_OPERATOR_IDS": f"{OPERATOR}, {USER}",
        }
    )
    assert settings.operator_ids == {OPERATOR, USER}


# --------------------------------------------------------------------------- start-up errors


def _start(**values: str) -> subprocess.CompletedProcess[str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("TASKFLOW_", "PG")) and key not in ("DATABASE_URL", "REDIS_URL")
    }
    env.update({"PYTHONPATH": str(EXAMPLE), "TASKFLOW_JWT_SECRET": SECRET, **values})
    return subprocess.run(
        [sys.executable, "-m", "taskflow", "--port", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("values", "status", "message"),
    [
        (
            {"DATABASE_URL": NOWHERE, "TASKFLOW_OVERDUE_CRON": "61 * * * *"},
            2,
            "taskflow: TASKFLOW_OVERDUE_CRON is not valid: invalid cron expression '61 * * * *'",
        ),
        (
            {"DATABASE_URL": "postgresql://postgres:hunter2hunter2@127.0.0.1:1/none"},
            1,
            "taskflow: cannot connect to the database: ",
        ),
        ({"DATABASE_URL": NOWHERE, "TASKFLOW_JWT_SECRET": "a" * 32}, 2, "too predictable"),
    ],
    ids=["bad-cron", "unreachable-database", "weak-secret"],
)
def test_start_up_errors_are_one_line(values: dict[str, str], status: int, message: str) -> None:
    done = _start(**values)
    assert done.returncode == status, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert message in lines[0]
    assert "hunter2" not in done.stderr
