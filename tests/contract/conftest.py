"""Contract suites: one set of tests per port, run against every implementation.

Each suite is parametrized by a fixture whose parameters name the implementation (``memory``,
``postgres``, ``postgres-upgraded-from-0.1.0``). The hook below marks every test by the
implementations it runs on (one without an implementation parameter: ``postgres`` if it asks for
a database, else ``memory``), so ``pytest tests/contract -m "not postgres"`` and ``-k memory``
both run the in-memory halves with no server, and ``-m postgres`` only the database halves.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.contract._lease import (
    BACKENDS,
    NOT_FOR_SYNC,
    Backend,
    memory_backend,
    postgres_backend,
    sync_backend,
)
from tests.contract._outbox import STORES, StoreBackend, memory_store, postgres_store
from tests.contract._schedules import (
    SCHEDULE_STORES,
    Schedules,
    memory_schedules,
    postgres_schedules,
)

HERE = Path(__file__).parent

# The fixtures whose parameter names the implementation under test.
IMPLEMENTATION_FIXTURES = ("backend", "store", "schedules")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each contract test ``memory`` or ``postgres`` by the implementation it runs on."""
    sync_only = [
        item
        for item in items
        if item.path.is_relative_to(HERE)
        and getattr(item, "callspec", None) is not None
        and item.callspec.params.get("backend") == "postgres-sync"  # type: ignore[attr-defined]
        and getattr(item, "originalname", item.name) in NOT_FOR_SYNC
    ]
    if sync_only:
        config.hook.pytest_deselected(items=sync_only)
        items[:] = [item for item in items if item not in sync_only]
    for item in items:
        if not item.path.is_relative_to(HERE):
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is None or not any(n in callspec.params for n in IMPLEMENTATION_FIXTURES):
            # A test with no implementation parameter: it uses a server if it asks for one.
            if {"pg_dsn", "empty_dsn", "schema_dsn"} & set(getattr(item, "fixturenames", ())):
                item.add_marker(pytest.mark.postgres)
            else:
                item.add_marker(pytest.mark.memory)
            continue
        params = callspec.params
        implementations = [str(params[n]) for n in IMPLEMENTATION_FIXTURES if n in params]
        if any(value.startswith("postgres") for value in implementations):
            item.add_marker(pytest.mark.postgres)
        elif "memory" in implementations:
            item.add_marker(pytest.mark.memory)


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """Each implementation of the lease port in turn (the database ones need ``pg_dsn``)."""
    if request.param == "memory":
        yield await memory_backend()
        return
    if request.param == "postgres-sync":
        async for value in sync_backend(request.getfixturevalue("schema_dsn")):
            yield value
        return
    # The upgrade starts from the 0.1.0 tables in an empty database; the plain one starts from
    # the current schema, copied from this run's template.
    upgraded = request.param != "postgres"
    dsn: str = request.getfixturevalue("empty_dsn" if upgraded else "schema_dsn")
    async for value in postgres_backend(dsn, upgraded=upgraded):
        yield value


@pytest.fixture(params=STORES)
async def store(request: pytest.FixtureRequest) -> AsyncIterator[StoreBackend]:
    """Each implementation of the outbox store port in turn (PostgreSQL needs ``pg_dsn``)."""
    if request.param == "memory":
        yield await memory_store()
        return
    dsn = request.getfixturevalue("schema_dsn")
    async for value in postgres_store(dsn, sync_writer=request.param == "postgres-sync-writer"):
        yield value


@pytest.fixture(params=SCHEDULE_STORES)
async def schedules(request: pytest.FixtureRequest) -> AsyncIterator[Schedules]:
    """Each implementation of the schedule store port in turn (PostgreSQL needs ``pg_dsn``)."""
    if request.param == "memory":
        yield await memory_schedules()
        return
    async for value in postgres_schedules(request.getfixturevalue("schema_dsn")):
        yield value
