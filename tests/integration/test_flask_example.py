"""``examples/flask_app`` in one process, through Flask's test client: its readiness route, its
nightly report's SQL (the schedule made to fire every second), and the outbox write of a signup.
Under real Gunicorn workers: ``tests/acceptance/test_gunicorn_workers.py``."""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType

import psycopg
import pytest

APP = Path(__file__).resolve().parents[2] / "examples" / "flask_app" / "app.py"


@pytest.fixture
def example(schema_dsn: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    monkeypatch.setenv("DATABASE_URL", schema_dsn)
    monkeypatch.setenv("NIGHTLY_CRON", "* * * * * *")
    monkeypatch.setenv("SDCORE_GRACE_MS", "2000")
    monkeypatch.delenv("HEARTBEAT_CRON", raising=False)
    spec = importlib.util.spec_from_file_location("flask_app_example", APP)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.create_tables()
    try:
        yield module
    finally:
        module.runtime.stop()
        sys.modules.pop("flask_app_example", None)


def test_readiness_route_and_nightly_report(example: ModuleType, schema_dsn: str) -> None:
    client = example.app.test_client()
    assert client.get("/healthz").status_code == 503  # not started: not ready
    today = datetime.now(UTC).date()
    with psycopg.connect(schema_dsn) as conn:
        conn.execute(
            "INSERT INTO signups (email, created_at) VALUES"
            " ('yesterday@example.com', %s::date - 1 + time '12:00'),"
            " ('today@example.com', %s::date + time '00:00:01')",
            (today, today),
        )
    example.runtime.start()
    response = client.get("/healthz")
    assert response.status_code == 200, response.json
    assert response.json["checks"]["scheduler"]["ok"]
    deadline = time.monotonic() + 20
    row = None
    while row is None and time.monotonic() < deadline:
        with psycopg.connect(schema_dsn) as conn:
            row = conn.execute(
                "SELECT signups, fencing_token FROM daily_signups WHERE day = %s", (today,)
            ).fetchone()
        time.sleep(0.2)
    assert row is not None, "the nightly report did not run"
    assert row[0] == 1
    assert row[1] >= 1


def test_a_signup_writes_its_row_and_outbox_message_together(
    example: ModuleType, schema_dsn: str
) -> None:
    client = example.app.test_client()
    with example.runtime:
        assert client.post("/signups", json={"email": "nope"}).status_code == 400
        for _ in range(2):
            response = client.post("/signups", json={"email": "Ada@Example.com"})
            assert response.status_code == 201, response.data
    with psycopg.connect(schema_dsn) as conn:
        signups = conn.execute("SELECT email FROM signups").fetchall()
        messages = conn.execute(
            "SELECT idempotency_key, queue, name, payload FROM outbox"
        ).fetchall()
    assert signups == [("ada@example.com",)]
    assert messages == [
        ("welcome:ada@example.com", "mail", "welcome", {"email": "ada@example.com"})
    ]
