"""Shared fixtures: a fresh PostgreSQL database per test, copied from an empty template.

The server comes from ``SDCORE_TEST_DATABASE_URL`` (or ``DATABASE_URL``; default
``postgresql://postgres@127.0.0.1:5432/postgres``). A missing server is a failure with a hint,
never a silent skip.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator, Iterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from sdcore.job_scheduler import JobSchedulerService

ADMIN_DSN = os.environ.get(
    "SDCORE_TEST_DATABASE_URL",
    os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"),
)
_counter = itertools.count()


def dsn_for(dbname: str) -> str:
    """Return the admin DSN pointed at another database."""
    params = conninfo_to_dict(ADMIN_DSN)
    params["dbname"] = dbname
    return make_conninfo(**{k: str(v) for k, v in params.items()})


def _admin() -> psycopg.Connection[tuple[object, ...]]:
    try:
        return psycopg.connect(ADMIN_DSN, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(
            f"PostgreSQL is not reachable ({exc}). Start it (see .ci/run) or set "
            "SDCORE_TEST_DATABASE_URL.",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def template_db() -> Iterator[str]:
    """An empty template database for this test session."""
    name = f"sdcore_tmpl_{os.getpid()}"
    with _admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
    yield name
    with _admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_dsn(template_db: str) -> Iterator[str]:
    """DSN of a fresh, empty database (dropped after the test)."""
    name = f"sdcore_t_{os.getpid()}_{next(_counter)}"
    with _admin() as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    yield dsn_for(name)
    with _admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
async def jobs(pg_dsn: str) -> AsyncIterator[JobSchedulerService]:
    """A connected service with its schema applied."""
    async with JobSchedulerService.connect(pg_dsn) as service:
        await service.ensure_schema()
        yield service
