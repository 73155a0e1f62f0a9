"""Alerting with real OS processes: a missed tick pages once across three replicas.

Three replica processes (``_alert_replica``) run one exclusive interval schedule with catch-up
``all`` and a webhook sink pointed at a real HTTP server in this process; every delivery must
carry a valid signature, and nothing but the expected alerts may arrive.

- Killed mid-tick: the first tick to start hangs (a hold file) and its replica is killed with
  SIGKILL. Once its lease expires another replica takes the tick over (attempt 2): exactly one
  ``missed`` alert for it, then, when a tick runs on time again, exactly one ``resolved``.
- An outage: every replica stops, ticks pass with nobody running them, three replicas start
  again and their start-up catch-up runs the missed ticks one after the other: still exactly one
  ``missed`` (the outage is one incident) and one ``resolved``.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from sdcore.alerting import verify_webhook
from sdcore.scheduling import format_run_key
from tests._http_sink import HttpRecorder, http_recorder
from tests.acceptance._alert_replica import EVERY_MS, SECRET

REPO_ROOT = Path(__file__).resolve().parents[2]
REPLICAS = 3
STARTUP_S = 20.0


def _reader(stream: IO[str], replica: int, lines: queue.Queue[tuple[int, dict[str, Any]]]) -> None:
    for line in stream:
        try:
            lines.put((replica, json.loads(line)))
        except ValueError:
            continue  # a log line


def _kinds(recorder: HttpRecorder) -> Counter[str]:
    return Counter(r.json()["kind"] for r in recorder.ok("/hook"))


def _start(
    dsn: str, url: str, hold: Path, lines: queue.Queue[tuple[int, dict[str, Any]]]
) -> list[subprocess.Popen[str]]:
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT / 'src'}{os.pathsep}{REPO_ROOT}"}
    procs = []
    for i in range(REPLICAS):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.acceptance._alert_replica", dsn, url, str(hold), str(i)],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None
        threading.Thread(target=_reader, args=(proc.stdout, i, lines), daemon=True).start()
    return procs


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        if proc.stdout is not None:
            proc.stdout.close()


def _wait_line(
    lines: queue.Queue[tuple[int, dict[str, Any]]], key: str, timeout_s: float
) -> tuple[int, dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        replica, line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        if key in line:
            return replica, line


def _signed_kinds(recorder: HttpRecorder) -> tuple[Counter[str], dict[str, dict[str, Any]]]:
    """The alerts' kinds counted, and the last alert of each kind. Not in arrival order: each
    replica relays the alert rows it claims, so a ``resolved`` may arrive before its ``missed``
    (the ``incident`` it carries ties them)."""
    hooks = recorder.ok("/hook")
    for request in hooks:
        verify_webhook(SECRET, request.body, request.headers)
    alerts = [r.json() for r in hooks]
    return Counter(a["kind"] for a in alerts), {a["kind"]: a for a in alerts}


def _resolved(recorder: HttpRecorder) -> bool:
    return _kinds(recorder)["resolved"] >= 1


def test_a_killed_replicas_tick_alerts_missed_once_and_resolves_once(
    pg_dsn: str, tmp_path: Path
) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    lines: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
    with http_recorder() as recorder:
        procs = _start(pg_dsn, recorder.url, hold, lines)
        try:
            # The first start of the tick that hangs: kill its replica mid-run.
            victim, line = _wait_line(lines, "started", STARTUP_S)
            run_key = line["started"]
            hold.unlink()
            procs[victim].send_signal(signal.SIGKILL)
            procs[victim].wait(5)
            killed_at = time.monotonic()
            assert recorder.wait_for(_resolved, timeout_s=20), _kinds(recorder)
            took = time.monotonic() - killed_at
            time.sleep(1.5)  # room for a duplicate from another replica or a relay retry
        finally:
            _stop(procs)
        kinds, alerts = _signed_kinds(recorder)
    print(f"alerting: kill -9 mid-tick: resolved {took:.1f} s after the kill; {dict(kinds)}")  # noqa: T201
    assert kinds == Counter({"missed": 1, "resolved": 1}), kinds
    missed, resolved = alerts["missed"], alerts["resolved"]
    assert missed["run_key"] == run_key
    assert missed["attempt"] >= 2  # the takeover of the tick the killed replica held
    assert resolved["incident"] == {"kind": "missed", "run_key": run_key}
    assert resolved["run_key"] > run_key  # a tick run on time, not the late run itself


def test_an_outage_of_every_replica_alerts_missed_once_and_resolves_once(
    pg_dsn: str, tmp_path: Path
) -> None:
    hold = tmp_path / "no-hold"
    lines: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
    with http_recorder() as recorder:
        procs = _start(pg_dsn, recorder.url, hold, lines)
        try:
            _, line = _wait_line(lines, "started", STARTUP_S)
        finally:
            _stop(procs)
        last_before = line["started"]
        time.sleep(2 * EVERY_MS / 1000 + 1)  # two or three ticks nobody runs
        while not lines.empty():
            lines.get()
        restart = format_run_key(datetime.now(UTC))
        procs = _start(pg_dsn, recorder.url, hold, lines)
        try:
            assert recorder.wait_for(_resolved, timeout_s=25), _kinds(recorder)
            time.sleep(2.0)  # the scans after the start, late catch-up runs, relay retries
        finally:
            _stop(procs)
        caught_up = set()
        while not lines.empty():
            _, line = lines.get()
            if "started" in line and last_before < line["started"] < restart:
                caught_up.add(line["started"])
        kinds, alerts = _signed_kinds(recorder)
    print(f"alerting: outage of every replica: {dict(kinds)}")  # noqa: T201
    assert len(caught_up) >= 2, caught_up  # one incident, however many late runs
    assert kinds == Counter({"missed": 1, "resolved": 1}), alerts
    missed, resolved = alerts["missed"], alerts["resolved"]
    # The incident is a tick of the outage: one before the restart, or one that fell while the
    # replicas were still starting (slow on a loaded machine); the tick that resolves it is later.
    assert last_before < missed["run_key"] < resolved["run_key"], (missed, resolved, caught_up)
    assert resolved["incident"] == {"kind": "missed", "run_key": missed["run_key"]}
