"""Alerting with real OS processes: a tick whose replica is killed -9 mid-run pages once.

Three replica processes (``_alert_replica``) run one exclusive interval schedule with catch-up
and a webhook sink pointed at a real HTTP server in this process. The first tick to start hangs
(a hold file); the test kills its replica with SIGKILL mid-run. When its lease expires, a
surviving replica's sweep starts the tick again (attempt 2): the three replicas together must
send exactly one ``missed`` alert for it, and once it (or the next tick) succeeds, exactly one
``resolved``; every delivery carries a valid signature. Nothing else is alerted.
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
from pathlib import Path
from typing import IO, Any

from sdcore.alerting import verify_webhook
from tests._http_sink import HttpRecorder, http_recorder
from tests.acceptance._alert_replica import SECRET

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


def test_a_killed_replicas_tick_alerts_missed_once_and_resolves_once(
    pg_dsn: str, tmp_path: Path
) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    lines: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT / 'src'}{os.pathsep}{REPO_ROOT}"}
    procs: list[subprocess.Popen[str]] = []
    with http_recorder() as recorder:
        try:
            for i in range(REPLICAS):
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "tests.acceptance._alert_replica",
                        pg_dsn,
                        recorder.url,
                        str(hold),
                        str(i),
                    ],
                    cwd=REPO_ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
                procs.append(proc)
                assert proc.stdout is not None
                threading.Thread(target=_reader, args=(proc.stdout, i, lines), daemon=True).start()
            # The first start of the tick that hangs: kill its replica mid-run.
            deadline = time.monotonic() + STARTUP_S
            held: tuple[int, str] | None = None
            while held is None:
                replica, line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
                if "started" in line:
                    held = (replica, line["started"])
            victim, run_key = held
            hold.unlink()
            procs[victim].send_signal(signal.SIGKILL)
            procs[victim].wait(5)
            killed_at = time.monotonic()

            def resolved(r: HttpRecorder) -> bool:
                return _kinds(r)["resolved"] >= 1

            assert recorder.wait_for(resolved, timeout_s=20), _kinds(recorder)
            took = time.monotonic() - killed_at
            time.sleep(2.0)  # room for a duplicate from another replica or a relay retry
        finally:
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
        hooks = recorder.ok("/hook")
        for request in hooks:
            verify_webhook(SECRET, request.body, request.headers)
        kinds = Counter(r.json()["kind"] for r in hooks)
        missed = [r.json() for r in hooks if r.json()["kind"] == "missed"]
        resolved_alerts = [r.json() for r in hooks if r.json()["kind"] == "resolved"]
    print(f"alerting: missed+resolved {took:.1f} s after the kill; deliveries {dict(kinds)}")  # noqa: T201
    assert kinds == Counter({"missed": 1, "resolved": 1}), kinds
    assert missed[0]["run_key"] == run_key
    assert missed[0]["attempt"] >= 2  # the sweep's start of the tick the killed replica held
    assert resolved_alerts[0]["incident"] == {"kind": "missed", "run_key": run_key}
