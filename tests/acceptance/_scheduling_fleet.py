"""The fleet of the scheduling acceptance tests: replica processes, the cluster, the ledger.

Every replica is a separate ``python -m tests.acceptance._replica`` process: its own
``JobSchedulerService`` (pool), its own ``Scheduler`` and one schedule whose handler writes a row
to ``ledger`` through its own connection. ``ledger`` has no unique constraint, so a tick run twice
shows up as two rows. Verdicts come from ``ledger`` and the ``job_scheduler`` table over a window
that leaves a margin after start-up and before shutdown. The scenarios are in
``test_scheduling_processes.py`` and ``test_scheduling_retries.py`` (two modules, so that the
acceptance step runs them side by side).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import psycopg
import pytest

from sdcore.job_scheduler import JobSchedulerService
from sdcore.postgres import PoolSettings
from sdcore.scheduling import MissedTick, Scheduler, Tick, format_run_key

Json = dict[str, Any]

REPO_ROOT = Path(__file__).resolve().parents[2]
MODULE = "tests.acceptance._replica"
STARTUP_S = 30.0
STOP_S = 20.0
FAKETIME = shutil.which("faketime")
WHOLE_SECOND_KEY = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")

LEDGER_DDL = """\
CREATE TABLE ledger (
    id            bigserial PRIMARY KEY,
    schedule      text        NOT NULL,
    run_key       text        NOT NULL,
    replica_id    int         NOT NULL,
    fencing_token bigint,
    attempt       int,
    pid           int         NOT NULL,
    scheduled_at  timestamptz NOT NULL,
    app_now       timestamptz NOT NULL,
    started_at    timestamptz NOT NULL,
    finished_at   timestamptz,
    outcome       text
)"""


def _report(line: str) -> None:
    """The RELIABILITY.md metric line (shown with ``pytest -s``)."""
    print(line)  # noqa: T201


# --------------------------------------------------------------------------- processes


class ReplicaError(AssertionError):
    """A replica did not behave as its protocol says (exited, or stayed silent)."""


class Replica:
    """One replica process; its stdout JSON lines are collected by a thread."""

    def __init__(
        self,
        label: str,
        argv: Sequence[str],
        *,
        prefix: Sequence[str] = (),
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.label = label
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT), str(REPO_ROOT / "src"), env.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra_env or {})
        self.stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        self.popen = subprocess.Popen(
            [*prefix, sys.executable, "-m", MODULE, *argv],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group: kill9/close reach a faketime child
        )
        self._events: list[Json] = []
        self._eof = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._pump, name=f"pump-{label}", daemon=True)
        self._thread.start()

    @property
    def pid(self) -> int:
        """The replica's own pid (``faketime`` forks: the Python process is its child)."""
        with self._cond:
            for event in self._events:
                if event.get("event") == "ready":
                    return int(event["pid"])
        return self.popen.pid

    def _pump(self) -> None:
        stdout = self.popen.stdout
        assert stdout is not None
        try:
            for line in stdout:
                try:
                    event: Json = json.loads(line)
                except ValueError:
                    event = {"event": "garbage", "line": line[:300]}
                with self._cond:
                    self._events.append(event)
                    self._cond.notify_all()
        except (OSError, ValueError):
            pass
        finally:
            with self._cond:
                self._eof = True
                self._cond.notify_all()

    def events(self, kind: str | None = None) -> list[Json]:
        with self._cond:
            return [e for e in self._events if kind is None or e.get("event") == kind]

    def mark(self) -> int:
        """The number of events so far (to wait only for later ones)."""
        with self._cond:
            return len(self._events)

    def stderr_tail(self, size: int = 4000) -> str:
        try:
            self.stderr.seek(0)
            return self.stderr.read().decode("utf-8", "replace")[-size:]
        except (OSError, ValueError):
            return "<stderr unavailable>"

    def try_wait_for(
        self,
        kind: str,
        timeout: float,
        *,
        start: int = 0,
        where: Callable[[Json], bool] | None = None,
    ) -> Json | None:
        """The first event ``kind`` at index ``start`` or later, or ``None`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        index = start
        with self._cond:
            while True:
                while index < len(self._events):
                    event = self._events[index]
                    index += 1
                    if event.get("event") == kind and (where is None or where(event)):
                        return event
                if self._eof:
                    raise ReplicaError(
                        f"{self.label} exited (rc={self.popen.poll()}) before {kind!r}\n"
                        f"{self.stderr_tail()}"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def wait_for(
        self,
        kind: str,
        timeout: float = STARTUP_S,
        *,
        start: int = 0,
        where: Callable[[Json], bool] | None = None,
    ) -> Json:
        event = self.try_wait_for(kind, timeout, start=start, where=where)
        if event is None:
            raise ReplicaError(
                f"{self.label}: no {kind!r} event within {timeout:.0f} s\n{self.stderr_tail()}"
            )
        return event

    def send_signal(self, sig: int) -> None:
        """Signal the replica itself (not a ``faketime`` wrapper, which would not forward it)."""
        if self.popen.poll() is None:
            os.kill(self.pid, sig)

    def kill9(self) -> None:
        """SIGKILL the whole process group (wrapper and replica), then reap."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        """Kill the process if it is still alive, reap it and close every pipe and file."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL does not fail
            self.popen.wait(timeout=10)
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self._thread.join(timeout=10)
        self.stderr.close()


class Cluster:
    """The replicas of one test; :meth:`close` kills and reaps every one of them."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.replicas: list[Replica] = []

    def spawn(
        self,
        replica_id: int,
        name: str,
        schedule_args: Sequence[str],
        *,
        label: str | None = None,
        prefix: Sequence[str] = (),
        extra_env: dict[str, str] | None = None,
    ) -> Replica:
        argv = ["--dsn", self.dsn, "--replica-id", str(replica_id), "--name", name]
        replica = Replica(
            label or f"{name}#{replica_id}",
            [*argv, *schedule_args],
            prefix=prefix,
            extra_env=extra_env,
        )
        self.replicas.append(replica)
        return replica

    def stop(self, replicas: Sequence[Replica], timeout: float = STOP_S) -> None:
        """SIGTERM ``replicas`` at once; require a graceful exit (rc 0) from each."""
        for replica in replicas:
            replica.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        problems = []
        for replica in replicas:
            rc = replica.wait_exit(deadline - time.monotonic())
            if rc is None:
                replica.close()
                problems.append(f"{replica.label} ignored SIGTERM for {timeout:.0f} s")
            elif rc != 0:
                problems.append(f"{replica.label} exited with rc={rc}")
            else:
                continue
            problems.append(replica.stderr_tail())
        if problems:
            raise ReplicaError("\n".join(problems))

    def close(self) -> None:
        errors: list[BaseException] = []
        for replica in self.replicas:
            try:
                replica.close()
            except BaseException as exc:  # keep reaping the others
                errors.append(exc)
        if errors:
            raise errors[0]


@pytest.fixture(name="cluster")
def cluster_fixture(pg_dsn: str) -> Iterator[Cluster]:
    """Replica processes for ``pg_dsn``, all killed and reaped when the test ends (even failed).

    Depends on ``pg_dsn``, so it is torn down first: no replica outlives its database.
    """
    fleet = Cluster(pg_dsn)
    try:
        yield fleet
    finally:
        fleet.close()


def _require_faketime() -> str:
    if FAKETIME is None:
        message = "faketime is not installed (apt-get install -y faketime)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return FAKETIME


def _sleep_until(epoch: float) -> None:
    time.sleep(max(0.0, epoch - time.time()))


def _utc(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


def _instant(run_key: str) -> datetime:
    return datetime.fromisoformat(run_key)


# --------------------------------------------------------------------------- database


@dataclass(frozen=True, slots=True)
class LedgerRow:
    id: int
    schedule: str
    run_key: str
    replica_id: int
    fencing_token: int | None
    attempt: int | None
    pid: int
    scheduled_at: datetime
    started_at: datetime
    finished_at: datetime | None
    outcome: str | None
    app_now: datetime  # the replica's own wall clock (faketime included) as its handler began


@dataclass(frozen=True, slots=True)
class JobRow:
    run_key: str | None
    status: str
    fencing_token: int
    data: Any
    modified_at: datetime


def _create_ledger(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(LEDGER_DDL)


def _ledger(dsn: str, schedule: str) -> list[LedgerRow]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT id, schedule, run_key, replica_id, fencing_token, attempt, pid, scheduled_at,"
            " started_at, finished_at, outcome, app_now FROM ledger WHERE schedule = %s"
            " ORDER BY id",
            (schedule,),
        ).fetchall()
    return [LedgerRow(*row) for row in rows]


def _jobs(dsn: str, code: str) -> dict[str, JobRow]:
    """The schedule's rows by run key (the overlap guard's row is keyed ``overlap-guard``)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT run_key, status, fencing_token, data, modified_at FROM job_scheduler"
            " WHERE code = %s AND type = 'SCHEDULE' AND run_key IS NOT NULL",
            (code,),
        ).fetchall()
    return {row[0]: JobRow(*row) for row in rows}


def _by_key(rows: Sequence[LedgerRow]) -> dict[str, list[LedgerRow]]:
    grouped: dict[str, list[LedgerRow]] = defaultdict(list)
    for row in rows:
        grouped[row.run_key].append(row)
    for group in grouped.values():
        group.sort(key=lambda r: (r.started_at, r.id))
    return grouped


async def _noop(tick: Tick) -> None:
    return None


def _expected(
    start: float, end: float, *, cron: str | None = None, interval_ms: int | None = None
) -> list[str]:
    """Run keys of the schedule's ticks in ``[start, end)`` (epoch seconds), by the library."""
    scheduler = Scheduler()
    if cron is not None:
        scheduler.add_cron("expected", cron, _noop)
    else:
        assert interval_ms is not None
        scheduler.add_interval("expected", interval_ms, _noop)
    return [format_run_key(t) for t in scheduler.expected_ticks("expected", _utc(start), _utc(end))]


async def _missed_via_api(
    dsn: str, name: str, cron: str, start: float, end: float
) -> list[MissedTick]:
    async with JobSchedulerService.connect(dsn, pool=PoolSettings(min_size=1, max_size=1)) as jobs:
        scheduler = Scheduler(jobs=jobs)
        scheduler.add_cron(name, cron, _noop)
        return await scheduler.missed_ticks(name, _utc(start), _utc(end))


def _max_concurrency(rows: Sequence[LedgerRow]) -> int:
    """Most runs in progress at one instant, from ``[started_at, finished_at)`` (database clock)."""
    points: list[tuple[datetime, int]] = []
    for row in rows:
        assert row.finished_at is not None, f"run {row.run_key} by {row.replica_id} never finished"
        points.append((row.started_at, 1))
        points.append((row.finished_at, -1))
    points.sort(key=lambda p: (p[0], p[1]))  # a finish before a start at the same instant
    running = peak = 0
    for _, delta in points:
        running += delta
        peak = max(peak, running)
    return peak
