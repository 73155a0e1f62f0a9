"""Two ``manage.py sdcore run`` processes × a per-second schedule: every tick runs once.

The schedule's handler is a plain def that writes an ORM row (``tests/django_project/tickapp``);
over ~10 s, each second between the first and the last row has exactly one row, whichever
worker ran it, and each row carries its own lease's idempotency key and fencing token.
"""

from __future__ import annotations

import signal
import subprocess
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from tests.django_project.harness import environment, manage, start

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
RUN_S = 10


def test_two_workers_run_every_tick_exactly_once(empty_dsn: str) -> None:
    migrated = manage(empty_dsn, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    env = environment(empty_dsn, SDCORE_DJANGO_TICKS="1")
    workers: list[subprocess.Popen[Any]] = [
        start(empty_dsn, "sdcore", "run", env=env) for _ in "ab"
    ]
    try:
        time.sleep(RUN_S)
        assert [w.poll() for w in workers] == [None, None], [w.communicate() for w in workers]
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        outputs = [worker.communicate(timeout=15) for worker in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    with psycopg.connect(empty_dsn) as conn:
        rows = conn.execute(
            "SELECT scheduled_at, idempotency_key, fencing_token FROM tickapp_tickrow"
            " ORDER BY scheduled_at"
        ).fetchall()
        failed = conn.execute(
            "SELECT count(*) FROM job_scheduler WHERE code = 'every-second' AND status <> 'SUCCESS'"
        ).fetchone()
    instants = [row[0] for row in rows]
    assert len(rows) >= 3, outputs
    assert len(set(instants)) == len(instants), "a tick ran twice"
    seconds = int((instants[-1] - instants[0]) / timedelta(seconds=1))
    assert len(instants) == seconds + 1, f"a tick is missing: {instants}"
    assert len({row[1] for row in rows}) == len(rows)
    assert all(row[2] >= 1 for row in rows)
    assert failed == (0,)
