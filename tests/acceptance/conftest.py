"""Acceptance modules take turns across concurrent test runs on one server.

Their process fleets (up to 64 contender processes, three replicas per failover, an embedded
demo…) each need a large share of the server's ``max_connections`` (100 by default). Two test
runs on one server — two CI jobs, two developers — would starve each other, so every
acceptance module holds a server-wide advisory lock (on its own connection to the admin
database) from its first test's setup to its last test's teardown: within one run the lock is
never contended; across runs the modules alternate. A run that dies releases the lock with its
connection.

The lock is taken in an outermost ``pytest_runtest_protocol`` wrapper, before pytest-timeout
starts a test's clock: waiting for the other run's module is not the test's time. The wait has
its own deadline; past it the module runs anyway (and may then fail for want of connections,
which says why).

A module marked ``fills_server`` (``pytestmark``) also takes the server's room exclusively
(``tests/conftest.py``): every other test — of this run's other pytest-xdist workers and of other
runs — holds the room shared while it runs, so none opens connections while a 64-process storm
has them.

Every test here is marked ``acceptance`` (:func:`pytest_collection_modifyitems`). They start real
processes and judge them by the clock, so they run in a step of their own, in one process and
alone on the machine — ``pytest -m acceptance -n 0`` — before the rest, ``pytest -m "not
acceptance"`` (on pytest-xdist's workers).
"""

from __future__ import annotations

import os
from collections.abc import Generator

import psycopg
import pytest

from tests.conftest import ADMIN_DSN, ROOM_LOCK_KEY, ROOM_LOCK_WAIT

# pg_advisory_lock key shared by every sdcore test run ("sdcore-accept" in a bigint).
HEAVY_LOCK_KEY = 0x5DC0_AC_CE_97
HEAVY_LOCK_WAIT = "20min"

# module node id -> its lock's connection (None: the wait ran out, the module runs without it)
_held: dict[str, psycopg.Connection[tuple[object, ...]] | None] = {}


def _take_turn(*, fills_server: bool) -> psycopg.Connection[tuple[object, ...]] | None:
    conn = psycopg.connect(ADMIN_DSN, autocommit=True, application_name="sdcore-test-turn")
    conn.execute(f"SET lock_timeout = '{HEAVY_LOCK_WAIT}'")
    try:
        conn.execute("SELECT pg_advisory_lock(%s)", (HEAVY_LOCK_KEY,))
    except psycopg.errors.LockNotAvailable:
        conn.close()
        print(  # noqa: T201 - shown with the module's output
            f"another test run held the acceptance lock for over {HEAVY_LOCK_WAIT}: "
            "running this module without it"
        )
        return None
    if fills_server:
        conn.execute(f"SET lock_timeout = '{ROOM_LOCK_WAIT}'")
        try:
            conn.execute("SELECT pg_advisory_lock(%s)", (ROOM_LOCK_KEY,))
        except psycopg.errors.LockNotAvailable:
            print(  # noqa: T201 - shown with the module's output
                f"other tests held the server's room for over {ROOM_LOCK_WAIT}: "
                "running this module beside them"
            )
    return conn


HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of this folder ``acceptance`` (pytest calls this hook with the whole
    session's items: the others are left alone)."""
    del config
    for item in items:
        if str(item.path).startswith(HERE + os.sep):
            item.add_marker(pytest.mark.acceptance)


def _module_of(item: pytest.Item | None) -> str | None:
    return None if item is None else item.nodeid.split("::", 1)[0]


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, None, None]:
    if not str(item.path).startswith(HERE + os.sep):
        # pytest (and pytest-xdist) call this hook through ``config.hook``, for every item of the
        # session, not only for this folder's: the rest of the suite takes no turn.
        yield
        return
    module = _module_of(item)
    assert module is not None
    if module not in _held:
        for conn in _held.values():  # a module that ended without reaching its last item
            if conn is not None:
                conn.close()
        _held.clear()
        _held[module] = _take_turn(fills_server=item.get_closest_marker("fills_server") is not None)
    yield
    if _module_of(nextitem) != module and module in _held:
        conn = _held.pop(module)  # after the module's teardown: the other run's turn
        if conn is not None:
            conn.close()
