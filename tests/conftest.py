"""Shared fixtures: a fresh PostgreSQL database per test, copied from an empty template.

Database names carry a random run id, so concurrent runs on one server never collide; databases
left by a crashed run are swept after a day (each is stamped with its creation time).

The server comes from ``SDCORE_TEST_DATABASE_URL`` (or ``DATABASE_URL``; default
``postgresql://postgres@127.0.0.1:5432/postgres``). A missing server is a failure with a hint,
never a silent skip.
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

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


# Unique per run: two runs on one server (CI jobs, containers whose pytest has the same small
# pid) never drop or reuse each other's databases.
RUN_ID = uuid.uuid4().hex[:10]
PREFIX = "sdcore_test_"
STALE_AFTER = "1 day"


def _sweep_stale(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    """Drop test databases that a crashed run left behind more than a day ago."""
    rows = conn.execute(
        "SELECT d.datname FROM pg_database d"
        " WHERE d.datname LIKE %s AND d.datname NOT LIKE %s"
        " AND shobj_description(d.oid, 'pg_database') < %s",
        (PREFIX + "%", f"{PREFIX}{RUN_ID}%", _stamp(f"now() - interval '{STALE_AFTER}'", conn)),
    ).fetchall()
    for (name,) in rows:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _stamp(expression: str, conn: psycopg.Connection[tuple[object, ...]]) -> str:
    row = conn.execute(
        f"SELECT to_char(({expression}) AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS')"
    ).fetchone()
    assert row is not None
    return "sdcore test run created " + str(row[0])


def _create(conn: psycopg.Connection[tuple[object, ...]], name: str, template: str) -> None:
    conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    conn.execute(f"COMMENT ON DATABASE \"{name}\" IS '{_stamp('now()', conn)}'")


@pytest.fixture(scope="session")
def template_db() -> Iterator[str]:
    """An empty template database for this test run (its name is unique to the run)."""
    name = f"{PREFIX}{RUN_ID}_tmpl"
    with _admin() as conn:
        _sweep_stale(conn)
        _create(conn, name, "template0")
    yield name
    with _admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def make_dsn(template_db: str) -> Iterator[Callable[[], str]]:
    """A factory of fresh, empty databases (all dropped after the test)."""
    made: list[str] = []

    def make() -> str:
        name = f"{PREFIX}{RUN_ID}_{next(_counter)}"
        with _admin() as conn:
            _create(conn, name, template_db)
        made.append(name)
        return dsn_for(name)

    yield make
    with _admin() as conn:
        for name in made:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_dsn(make_dsn: Callable[[], str]) -> str:
    """DSN of a fresh, empty database (dropped after the test)."""
    return make_dsn()


@pytest.fixture
async def jobs(pg_dsn: str) -> AsyncIterator[JobSchedulerService]:
    """A connected service with its schema applied."""
    async with JobSchedulerService.connect(pg_dsn) as service:
        await service.ensure_schema()
        yield service
