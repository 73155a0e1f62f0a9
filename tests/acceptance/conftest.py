"""Acceptance modules take turns across concurrent test runs on one server.

Their process fleets (up to 64 contender processes, three replicas per failover, an embedded
demo…) each need a large share of the server's ``max_connections`` (100 by default). Two test
runs on one server — two CI jobs, two developers — would starve each other, so every
acceptance module holds a server-wide advisory lock (on its own connection to the admin
database) while it runs: within one run the lock is never contended; across runs the modules
alternate. The wait has a deadline, and a run that dies releases the lock with its connection.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from tests.conftest import ADMIN_DSN

# pg_advisory_lock key shared by every sdcore test run ("sdcore-accept" in a bigint).
HEAVY_LOCK_KEY = 0x5DC0_AC_CE_97
HEAVY_LOCK_WAIT = "20min"


@pytest.fixture(scope="module", autouse=True)
def _one_heavy_module_per_server() -> Iterator[None]:
    conn = psycopg.connect(ADMIN_DSN, autocommit=True, application_name="sdcore-test-turn")
    try:
        conn.execute(f"SET lock_timeout = '{HEAVY_LOCK_WAIT}'")
        try:
            conn.execute("SELECT pg_advisory_lock(%s)", (HEAVY_LOCK_KEY,))
        except psycopg.errors.LockNotAvailable:
            pytest.fail(
                f"another test run held the acceptance lock for over {HEAVY_LOCK_WAIT} "
                f"(pg_advisory_lock({HEAVY_LOCK_KEY}) on {conn.info.dbname})"
            )
        yield
    finally:
        conn.close()  # ends the session: the lock goes with it
