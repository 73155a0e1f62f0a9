"""``sdcore run MODULE:ATTR``: a Runtime as a worker process, SIGTERM, readiness, errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from sdcore.postgres import PoolSettings
from sdcore.runtime import Runtime, RuntimeStateError

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.integration._run_app"


def _start(dsn: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "SDCORE_RUN_TEST_DSN": dsn}
    return subprocess.Popen(
        [sys.executable, "-m", "sdcore.cli", "run", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def _ticks(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        if conn.execute("SELECT to_regclass('job_scheduler')").fetchone() == (None,):
            return 0
        row = conn.execute(
            "SELECT count(*) FROM job_scheduler WHERE code = 'heartbeat-row' AND status = 'SUCCESS'"
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.slow
def test_runs_the_schedules_until_sigterm_then_stops_gracefully(
    pg_dsn: str, tmp_path: Path
) -> None:
    ready = tmp_path / "ready"
    proc = _start(pg_dsn, f"{APP}:runtime", "--ready-file", str(ready))
    try:
        _wait_for(ready.exists, 30, "the ready file")
        assert ready.read_text().strip() == str(proc.pid)
        _wait_for(lambda: _ticks(pg_dsn) >= 2, 30, "two ticks")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert lines[0] == (
        f"ready: {APP}:runtime (scheduler on, queues off (no redis_url)); SIGTERM stops"
    )
    assert lines[-1] == "stopped"
    assert not ready.exists()
    with psycopg.connect(pg_dsn) as conn:
        running = conn.execute("SELECT count(*) FROM job_scheduler WHERE status = 'RUNNING'")
        assert running.fetchone() == (0,)


def _run_for_a_while(dsn: str, tmp_path: Path, *args: str) -> str:
    """Start ``sdcore run`` with ``args``, let it run 2.5 s once ready (two ticks' time of the
    app's per-second schedule), stop it with SIGINT; return its output once it exited cleanly."""
    ready = tmp_path / "ready"
    proc = _start(dsn, *args, "--ready-file", str(ready))
    try:
        _wait_for(ready.exists, 30, "the ready file")
        time.sleep(2.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    return out


@pytest.mark.slow
def test_no_scheduler_runs_no_tick_and_a_factory_is_called(pg_dsn: str, tmp_path: Path) -> None:
    out = _run_for_a_while(pg_dsn, tmp_path, f"{APP}:factory", "--no-scheduler")
    assert "(scheduler off," in out
    assert _ticks(pg_dsn) == 0


@pytest.mark.slow
def test_a_runtime_built_without_its_scheduler_keeps_it_off(pg_dsn: str, tmp_path: Path) -> None:
    out = _run_for_a_while(pg_dsn, tmp_path, f"{APP}:no_scheduling")
    assert "(scheduler off," in out, out
    assert _ticks(pg_dsn) == 0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nocolon", "expected MODULE:ATTR"),
        ("no_such_module_xyz:app", "cannot import no_such_module_xyz"),
        (f"{APP}:missing", f"{APP} has no attribute missing"),
        (f"{APP}:not_a_runtime", "is a int: name a sdcore Runtime"),
        (f"{APP}:broken_factory", "broken_factory() failed: RuntimeError: cannot reach"),
    ],
    ids=["no-colon", "no-module", "no-attribute", "wrong-type", "factory-fails"],
)
def test_bad_targets_are_one_line_errors(pg_dsn: str, spec: str, message: str) -> None:
    proc = _start(pg_dsn, spec)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, (out, err)
    assert err.startswith("sdcore: error: ")
    assert message in err
    assert len(err.splitlines()) == 1
    assert "hunter2" not in err


def test_a_runtime_that_cannot_reach_its_database_is_one_line(tmp_path: Path) -> None:
    dsn = "postgresql://app:hunter2@127.0.0.1:1/app?connect_timeout=2"
    proc = _start(dsn, f"{APP}:runtime")
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 1, (out, err)
    assert "did not start" in err
    assert len(err.splitlines()) == 1
    assert "hunter2" not in err


def test_runtime_refuses_a_pool_it_would_exhaust() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        Runtime(database_url="postgresql://x@127.0.0.1/x", pool=PoolSettings(max_size=1))


async def test_runtime_start_twice_is_an_error_and_stop_is_idempotent(pg_dsn: str) -> None:
    runtime = Runtime(database_url=pg_dsn, pool=PoolSettings(max_size=2))
    states = []
    async with runtime:
        states.append(runtime.started)
        with pytest.raises(RuntimeStateError, match="already started"):
            await runtime.start()
        health = await runtime.health()
        assert health["database"].ok
    states.append(runtime.started)
    assert states == [True, False]
    await runtime.stop()
