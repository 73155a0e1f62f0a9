"""The control plane end to end: three replica processes (``sdcore run``) on one database
steered through the CLI — pause, trigger while paused, backfill, resume, a SIGKILL mid-backfill,
and a stored schedule created, changed and removed at run time.

Replica 3 polls only (``ControlSettings(listen=False)``, as under PgBouncer transaction pooling)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.acceptance._control_app:runtime"

EVENTS_DDL = """
CREATE TABLE control_events (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    schedule text NOT NULL, run_key text NOT NULL, pid integer NOT NULL, phase text NOT NULL,
    fence bigint, args jsonb, at timestamptz NOT NULL DEFAULT clock_timestamp())
"""

pytestmark = pytest.mark.slow


class Cluster:
    def __init__(self, dsn: str, tmp: Path, work_s: float) -> None:
        self.dsn = dsn
        self.tmp = tmp
        self.work_s = work_s
        self.procs: list[subprocess.Popen[str]] = []
        self.logs: list[Any] = []

    def start(self, count: int) -> None:
        for index in range(count):
            ready = self.tmp / f"ready-{index}"
            env = {
                **os.environ,
                "SDCORE_CONTROL_DSN": self.dsn,
                "SDCORE_CONTROL_WORK_S": str(self.work_s),
                "SDCORE_CONTROL_LISTEN": "0" if index == 2 else "1",
            }
            log = open(self.tmp / f"replica-{index}.log", "w")  # noqa: SIM115
            self.logs.append(log)
            proc = subprocess.Popen(
                [sys.executable, "-m", "sdcore.cli", "run", APP, "--ready-file", str(ready)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
                text=True,
            )
            self.procs.append(proc)
            wait_for(ready.exists, 60, f"replica {index} ready")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [sys.executable, "-m", "sdcore.cli", "schedules", *args],
            cwd=ROOT,
            env={**os.environ, "DATABASE_URL": self.dsn},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if check:
            assert out.returncode == 0, out.stderr
        return out

    def query(self, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return list(conn.execute(statement, params).fetchall())

    def now(self) -> datetime:
        value = self.query("SELECT clock_timestamp()")[0][0]
        assert isinstance(value, datetime)
        return value

    def count(
        self, phase: str, schedule: str, key_like: str = "%", after: datetime | None = None
    ) -> int:
        rows = self.query(
            "SELECT count(*) FROM control_events WHERE phase = %s AND schedule = %s"
            " AND run_key LIKE %s AND at > %s",
            (phase, schedule, key_like, after or datetime(2000, 1, 1, tzinfo=UTC)),
        )
        return int(rows[0][0])

    def duplicates(self, phase: str) -> list[tuple[Any, ...]]:
        return self.query(
            "SELECT schedule, run_key, count(*) FROM control_events WHERE phase = %s"
            " GROUP BY 1, 2 HAVING count(*) > 1",
            (phase,),
        )


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def cluster(pg_dsn: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(EVENTS_DDL)
    work = getattr(request, "param", 0.2)
    c = Cluster(pg_dsn, tmp_path, work)
    try:
        c.start(3)
        yield c
    finally:
        c.stop()


def _window() -> tuple[datetime, datetime, list[str]]:
    """Ten per-second ticks an hour ago (before the schedule was ever deployed)."""
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)
    keys = [(start + timedelta(seconds=i)).strftime("%Y-%m-%dT%H:%M:%SZ") for i in range(10)]
    return start, start + timedelta(seconds=9), keys


def test_pause_trigger_backfill_resume_across_three_replicas(cluster: Cluster) -> None:
    wait_for(lambda: cluster.count("done", "beat") >= 2, 30, "beat running")
    listed = [json.loads(line) for line in cluster.cli("list", "--json").stdout.splitlines()]
    beat = next(item for item in listed if item["name"] == "beat")
    assert len(beat["replicas"]) == 3
    assert beat["versions"] == 1
    assert beat["last_seen_at"].endswith("Z")

    # pause: within 2 s no tick starts on any replica, for as long as it stays paused
    cluster.cli("pause", "beat", "--reason", "incident 7", "--actor", "alice")
    paused_at = cluster.now()
    time.sleep(5)
    assert cluster.count("start", "beat", "2%", after=paused_at + timedelta(seconds=2)) == 0
    skipped = cluster.query(
        "SELECT count(*) FROM job_scheduler WHERE code = 'beat' AND data ->> 'skipped' = 'paused'"
    )
    assert skipped[0][0] >= 2

    # trigger while paused: exactly once
    action = json.loads(cluster.cli("trigger", "beat", "--json").stdout)
    key = f"trigger:{action['id']}"
    wait_for(lambda: cluster.count("done", "beat", key) == 1, 15, "the trigger")
    time.sleep(2)
    assert cluster.count("start", "beat", key) == 1

    # backfill of ten past ticks (while paused, as in an incident): each exactly once
    start, end, keys = _window()
    out = cluster.cli(
        "backfill",
        "beat",
        "--from",
        start.isoformat(),
        "--to",
        end.isoformat(),
        "--wait",
        "--timeout",
        "90",
    )
    assert "finished: SUCCESS" in out.stdout
    for tick in keys:
        assert cluster.count("done", "beat", tick) == 1, tick
        assert cluster.count("start", "beat", tick) == 1, tick
    # still paused: no regular tick started
    assert cluster.count("start", "beat", "2%", after=paused_at + timedelta(seconds=2)) == 10

    # resume: ticks start again
    cluster.cli("resume", "beat", "--actor", "alice")
    resumed = cluster.now()
    wait_for(
        lambda: cluster.count("done", "beat", "2%", after=resumed) >= 2, 15, "ticks after resume"
    )
    assert cluster.duplicates("start") == []
    assert cluster.duplicates("done") == []

    history = [
        json.loads(line)
        for line in cluster.cli("history", "beat", "--json", "--limit", "200").stdout.splitlines()
    ]
    sources = {h["source"] for h in history}
    assert {"tick", "trigger", "backfill"} <= sources
    assert all(h["fencing_token"] is not None and h["pid"] > 0 for h in history)
    pids = {p.pid for p in cluster.procs}
    assert {h["pid"] for h in history} <= pids
    log = [json.loads(line) for line in cluster.cli("log", "beat", "--json").stdout.splitlines()]
    assert [entry["action"] for entry in log][:4] == ["resume", "backfill", "trigger", "pause"]
    assert log[3]["actor"] == "alice"
    assert log[3]["reason"] == "incident 7"
    assert log[1]["progress"] == {
        "total": 10,
        "succeeded": 10,
        "failed": 0,
        "remaining": 0,
        "already_succeeded": 0,
    }

    # refusals change nothing
    bad = cluster.cli("pause", "nope", check=False)
    assert bad.returncode == 1
    assert "no such schedule" in bad.stderr
    bad = cluster.cli(
        "backfill", "beat", "--from", end.isoformat(), "--to", start.isoformat(), check=False
    )
    assert bad.returncode == 1
    assert "before it starts" in bad.stderr
    assert len(cluster.cli("log", "beat", "--json").stdout.splitlines()) == len(log)


@pytest.mark.parametrize("cluster", [0.6], indirect=True)
def test_backfill_survives_a_sigkilled_coordinator(cluster: Cluster) -> None:
    wait_for(lambda: cluster.count("done", "beat") >= 1, 30, "beat running")
    start, end, keys = _window()
    action = json.loads(
        cluster.cli(
            "backfill", "beat", "--from", start.isoformat(), "--to", end.isoformat(), "--json"
        ).stdout
    )

    def coordinator() -> int | None:
        rows = cluster.query(
            "SELECT pid FROM control_events WHERE run_key = ANY(%s) AND phase = 'done' LIMIT 1",
            (keys,),
        )
        return int(rows[0][0]) if rows else None

    wait_for(lambda: coordinator() is not None, 30, "the backfill to run a tick")
    victim = coordinator()
    for proc in cluster.procs:
        if proc.pid == victim:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert victim in {p.pid for p in cluster.procs}

    def finished() -> bool:
        rows = cluster.query(
            "SELECT finished_at FROM sdcore_schedules_actions WHERE id = %s", (action["id"],)
        )
        return rows[0][0] is not None

    wait_for(finished, 90, "another replica to finish the backfill")
    for tick in keys:
        assert cluster.count("done", "beat", tick) >= 1, tick
    # Each tick ran to its end once, but for one the victim ended in the instant before its
    # SIGKILL (it is killed as soon as it reports a tick done): its success was not recorded
    # yet, so a survivor took the tick over with a higher token and ran it again (at least once
    # across a crash between a handler's end and its finalize).
    for schedule, run_key, _ in cluster.duplicates("done"):
        runs = cluster.query(
            "SELECT pid, fence FROM control_events WHERE phase = 'done' AND schedule = %s"
            " AND run_key = %s ORDER BY fence",
            (schedule, run_key),
        )
        assert len(runs) == 2, (run_key, runs)
        (first_pid, first_fence), (second_pid, second_fence) = runs
        assert first_pid == victim != second_pid, (run_key, runs)
        assert first_fence < second_fence, (run_key, runs)
    survivors = {
        int(r[0])
        for r in cluster.query(
            "SELECT DISTINCT pid FROM control_events WHERE run_key = ANY(%s)", (keys,)
        )
    }
    assert len(survivors) >= 2  # the victim ran some, a survivor took over


def test_stored_schedule_created_changed_removed_through_the_cli(cluster: Cluster) -> None:
    cluster.cli(
        "create",
        "digest-acme",
        "--handler",
        "digest",
        "--every-ms",
        "1000",
        "--args",
        '{"customer": "acme"}',
        "--reason",
        "new customer",
    )
    wait_for(lambda: cluster.count("done", "digest-acme") >= 3, 20, "the stored schedule")
    assert cluster.duplicates("start") == []
    args = cluster.query("SELECT DISTINCT args FROM control_events WHERE schedule = 'digest-acme'")
    assert args == [({"customer": "acme"},)]

    cluster.cli("update", "digest-acme", "--handler", "digest", "--every-ms", "3000")
    changed = cluster.now()
    time.sleep(8)
    late = cluster.query(
        "SELECT run_key FROM control_events WHERE schedule = 'digest-acme' AND phase = 'start'"
        " AND at > %s",
        (changed + timedelta(seconds=2),),
    )
    assert late, "no run after the change"
    epoch = [int(datetime.fromisoformat(r[0].replace("Z", "+00:00")).timestamp()) for r in late]
    assert all(second % 3 == 0 for second in epoch), late

    cluster.cli("remove", "digest-acme")
    removed = cluster.now()
    time.sleep(4)
    assert cluster.count("start", "digest-acme", after=removed + timedelta(seconds=2)) == 0
    assert cluster.duplicates("start") == []
    listed = [json.loads(line) for line in cluster.cli("list", "--json").stdout.splitlines()]
    assert "digest-acme" not in {item["name"] for item in listed}
