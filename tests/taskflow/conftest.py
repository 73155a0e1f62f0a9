"""TaskFlow test fixtures: settings on a fresh database, a Redis key prefix per test.

The root ``tests/conftest.py`` provides ``pg_dsn`` (a fresh database per test). Redis is the
shared server (``SDCORE_TEST_REDIS_URL``); each test that uses it gets its own BullMQ prefix and
its keys are deleted afterwards. ``examples/taskflow`` is put on ``sys.path`` here.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "taskflow"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))

from taskflow.settings import Settings  # noqa: E402

from tests.taskflow._support import REDIS_URL, SECRET, SettingsFactory, database_url_of  # noqa: E402


@pytest.fixture
def database_url(pg_dsn: str) -> str:
    """A fresh database, as the URL TaskFlow reads from ``DATABASE_URL``."""
    return database_url_of(pg_dsn)


@pytest.fixture
def make_settings(database_url: str) -> SettingsFactory:
    """``make_settings(**overrides)``: settings on this test's database, without Redis."""

    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "database_url": database_url,
            "jwt_secret": SECRET,
            "replica_name": "test",
        }
        values.update(overrides)
        return Settings(**values)

    return make


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    """A BullMQ key prefix of this test on the shared Redis; its keys are deleted after."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as exc:
        client.close()
        pytest.fail(
            f"Redis is not reachable at {REDIS_URL} ({exc}). Start it (see .ci/run) or set "
            "SDCORE_TEST_REDIS_URL.",
            pytrace=False,
        )
    prefix = f"taskflow-test-{uuid.uuid4().hex[:12]}"
    try:
        yield prefix
    finally:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()
