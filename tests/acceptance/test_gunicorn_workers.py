"""``sdcore.sync.Runtime`` under real Gunicorn: the Flask example, two masters of two workers each.

Two ``gunicorn`` masters (two pods) serve ``examples/flask_app`` on one database, each with two
sync workers: four runtimes, each started by the example's ``post_fork`` hook. The example's
``heartbeat`` schedule fires every second and its plain-function handler writes one
``heartbeats`` row per run (no unique constraint: a tick run twice shows as two rows). Verdicts:

- every tick ran at most once over the whole run, and exactly once in the steady window (after
  every worker started, before the masters were told to stop), from ``heartbeats`` and from the
  lease table;
- SIGTERM to each master stops every worker's runtime (its ``sdcore stopped`` line, by pid) within
  the grace period: no worker is killed by the master's ``graceful_timeout``, and each master
  exits with status 0.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO

import psycopg
import pytest

from tests._servers import free_port

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "examples" / "flask_app"
GRACE_MS = 3_000
GRACEFUL_TIMEOUT_S = 20  # the master's SIGKILL deadline: far past the grace period
RUN_S = 16.0
START_S = 40.0
_STARTED = re.compile(r"\[(\d+)\] INFO sdcore\.runtime: sdcore started")
_STOPPED = re.compile(r"\[(\d+)\] INFO sdcore\.runtime: sdcore stopped")


@dataclass
class Master:
    """One ``gunicorn`` master and its log (gunicorn's and the app's, both on stderr)."""

    popen: subprocess.Popen[bytes]
    log: IO[bytes]

    def text(self) -> str:
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")

    def pids(self, pattern: re.Pattern[str]) -> set[int]:
        return {int(pid) for pid in pattern.findall(self.text())}


@pytest.fixture
def masters(
    make_dsn: Callable[..., str], tmp_path: Path
) -> Iterator[tuple[str, Callable[[], Master]]]:
    dsn = make_dsn(schema=True)
    started: list[Master] = []

    def start() -> Master:
        index = len(started)
        run_dir = tmp_path / f"master{index}"  # the control socket's folder: one per master
        run_dir.mkdir()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(EXAMPLE)]),
            "PYTHONUNBUFFERED": "1",
            "DATABASE_URL": dsn,
            "HEARTBEAT_CRON": "* * * * * *",
            "SDCORE_GRACE_MS": str(GRACE_MS),
            "GRACEFUL_TIMEOUT": str(GRACEFUL_TIMEOUT_S),
            "WEB_CONCURRENCY": "2",
            "BIND": f"127.0.0.1:{free_port()}",
            "XDG_RUNTIME_DIR": str(run_dir),
        }
        log = (tmp_path / f"master{index}.log").open("w+b")
        popen = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "app:app"],
            cwd=EXAMPLE,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        master = Master(popen=popen, log=log)
        started.append(master)
        return master

    yield dsn, start
    for master in started:
        if master.popen.poll() is None:
            master.popen.kill()
            master.popen.wait()
        master.log.close()


def _wait(check: Callable[[], bool], timeout: float, what: str, masters: list[Master]) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline or any(m.popen.poll() is not None for m in masters):
            logs = "\n".join(m.text()[-3000:] for m in masters)
            pytest.fail(f"{what} (within {timeout:.0f} s)\n{logs}", pytrace=False)
        time.sleep(0.1)


def _key(instant: datetime) -> str:
    return instant.strftime("%Y-%m-%dT%H:%M:%SZ")


def test_four_gunicorn_workers_run_every_tick_once_and_stop_on_sigterm(
    masters: tuple[str, Callable[[], Master]],
) -> None:
    dsn, start = masters
    fleet = [start(), start()]
    _wait(
        lambda: all(len(m.pids(_STARTED)) == 2 for m in fleet),
        START_S,
        "every worker's runtime starts",
        fleet,
    )
    all_started = datetime.now(UTC)
    workers = set().union(*(m.pids(_STARTED) for m in fleet))
    assert len(workers) == 4
    time.sleep(RUN_S)

    told = datetime.now(UTC)
    for master in fleet:
        master.popen.send_signal(signal.SIGTERM)
    exited: list[float] = []
    for master in fleet:
        status = master.popen.wait(timeout=GRACEFUL_TIMEOUT_S + 10)
        exited.append((datetime.now(UTC) - told).total_seconds())
        assert status == 0, master.text()[-3000:]
    logs = "\n".join(m.text() for m in fleet)
    stopped = set().union(*(m.pids(_STOPPED) for m in fleet))
    assert stopped == workers, logs[-4000:]
    assert "SIGKILL" not in logs, logs[-4000:]

    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT run_key, pid FROM heartbeats").fetchall()
        leases = conn.execute(
            "SELECT run_key, count(*), min(status) FROM job_scheduler"
            " WHERE code = 'heartbeat' GROUP BY run_key"
        ).fetchall()
    runs = Counter(str(key) for key, _ in rows)
    twice = {key: n for key, n in runs.items() if n > 1}
    assert twice == {}, f"ticks run more than once: {twice}"
    assert all(count == 1 for _, count, _ in leases)

    # The steady window: from the first whole second after every worker started (plus one for
    # the last one's first timer) to the last whole second before the masters were told to stop.
    first = all_started.replace(microsecond=0) + timedelta(seconds=2)
    last = told.replace(microsecond=0) - timedelta(seconds=1)
    window = {_key(first + timedelta(seconds=s)) for s in range((last - first).seconds + 1)}
    missing = sorted(window - set(runs))
    assert missing == [], f"ticks missed in the steady window: {missing}"
    assert len(window) >= RUN_S - 4
    by_worker = Counter(int(pid) for _, pid in rows)
    print(  # noqa: T201 - the figures, shown with -s
        f"gunicorn: {len(runs)} ticks, {len(window)} in the steady window, none twice; by "
        f"worker {dict(by_worker)}; masters exited {', '.join(f'{s:.2f}' for s in exited)} s "
        f"after SIGTERM (grace {GRACE_MS / 1000:.0f} s)"
    )
