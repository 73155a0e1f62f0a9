"""The README's main command: ``sdcore demo``, and a verdict that can say FAIL."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from sdcore.demo import DemoOptions, compute_verdict, run_demo
from sdcore.demo._run import LEDGER_TABLE, _prepare


@pytest.mark.slow
def test_demo_against_a_database_every_tick_once(pg_dsn: str) -> None:
    lines: list[str] = []
    status = run_demo(DemoOptions(replicas=3, duration_s=12, database_url=pg_dsn), lines.append)
    text = "\n".join(lines)
    assert status == 0, text
    assert "killed replica" in text
    assert "restarted replica" in text
    assert "doubled=0 missed=0" in text
    assert "PASS" in text


def test_verdict_detects_doubles_and_misses(pg_dsn: str) -> None:
    _prepare(pg_dsn)
    start = datetime(2026, 7, 20, 3, 0, 0, 500_000, tzinfo=UTC)
    keys = [
        (start.replace(microsecond=0) + timedelta(seconds=s)).strftime("%Y-%m-%dT%H:%M:%SZ")
        for s in range(1, 5)
    ]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for key, replicas in zip(keys, [[1], [1, 2], [], [3]], strict=True):
            for replica in replicas:
                conn.execute(
                    f"INSERT INTO {LEDGER_TABLE} (run_key, replica, pid, fencing_token)"
                    " VALUES (%s, %s, 1, 1)",
                    (key, replica),
                )
    verdict = compute_verdict(pg_dsn, start, start + timedelta(seconds=4.5))
    assert verdict.expected == 4
    assert verdict.doubled == [keys[1]]
    assert verdict.missed == [keys[2]]
    assert verdict.ran_once == 2
    assert not verdict.ok


@pytest.mark.slow
def test_demo_command_with_no_database_configured_uses_the_embedded_postgres() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "PGHOST", "PGDATABASE")}
    result = subprocess.run(
        [sys.executable, "-m", "sdcore.cli", "demo", "--duration", "10", "--replicas", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "embedded PostgreSQL" in result.stdout
    assert "PASS: every tick ran exactly once." in result.stdout
