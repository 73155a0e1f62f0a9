"""A replica suspended (SIGSTOP) while a pause is committed does not run the overdue tick when
it wakes (SIGCONT) before it has read the pause: a replica real process, the real CLI."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.acceptance.test_control_processes import EVENTS_DDL, Cluster, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def replica(pg_dsn: str, tmp_path: Path) -> Iterator[Cluster]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(EVENTS_DDL)
    one = Cluster(pg_dsn, tmp_path, 0.05)
    try:
        one.start(1)
        yield one
    finally:
        for proc in one.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        one.stop()


def test_a_woken_replica_reads_the_pause_before_it_starts_a_tick(replica: Cluster) -> None:
    wait_for(lambda: replica.count("done", "beat") >= 2, 30, "beat running")
    proc = replica.procs[0]
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        time.sleep(0.5)
        replica.cli("pause", "beat", "--reason", "while it slept")
        paused_at = replica.now()
        time.sleep(3.0)  # several ticks fall due, and the replica's view is seconds old
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    time.sleep(3.0)
    started = replica.query(
        "SELECT run_key, at FROM control_events WHERE schedule = 'beat' AND phase = 'start'"
        " AND at > %s ORDER BY at",
        (paused_at,),
    )
    assert started == [], f"ticks started after the pause was committed: {started}"
    assert proc.poll() is None, "the replica died"
