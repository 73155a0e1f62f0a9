"""Acceptance tests of cluster-safe scheduling with real OS processes (RELIABILITY.md §5.5).

Every replica is a separate ``python -m tests.acceptance._replica`` process: its own
``JobSchedulerService`` (pool), its own ``Scheduler`` and one schedule whose handler writes a row
to ``ledger`` through its own connection. ``ledger`` has no unique constraint, so a tick run twice
shows up as two rows. Verdicts come from ``ledger`` and the ``job_scheduler`` table over a window
that leaves a margin after start-up and before shutdown.

Scenarios: SC-01 + SC-08/SC-10 (three replicas per second, kill -9 and restart one of them mid-run),
SC-02/SC-03 (clock skew with faketime and different ``TZ``), SC-09 (catch-up after every replica
was down), SC-12 (a failed tick retried by another replica), SC-11 (overlap policies), and
shutdown mid-run (the tick's row ends ``FAIL``, not ``RUNNING``). DST is covered by unit tests.

Nothing here asserts speed; the few time bounds are generous deadlines for things that must
happen at all (a process exits instead of waiting for its 30 s handler).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

import psycopg
import pytest

from sdcore.job_scheduler import JobSchedulerService, JobSchedulerStatus
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


@pytest.fixture
def cluster(pg_dsn: str) -> Iterator[Cluster]:
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


# --------------------------------------------------------------------------- SC-01 / SC-08 / SC-10


@pytest.mark.slow
def test_sc01_three_replicas_per_second_kill9_and_restart(pg_dsn: str, cluster: Cluster) -> None:
    """SC-01: three replicas on ``* * * * * *`` for 22 s; each tick runs exactly once. Half-way,
    one replica is killed with SIGKILL while it runs a tick (SC-10) and started again (SC-08).

    The only tick allowed to be missing is the one in flight on the killed replica: its row stays
    ``RUNNING`` until the lease expires, and ``missed_ticks`` reports it (never silent).
    """
    _create_ledger(pg_dsn)
    name, cron = "sc01", "* * * * * *"
    args = ["--cron", cron, "--sleep-ms", "500"]
    replicas = [cluster.spawn(i, name, args) for i in range(3)]
    for replica in replicas:
        replica.wait_for("started")
    t_start = time.time()

    _sleep_until(t_start + 10)
    # Kill the replica that starts the next run, while that run is in flight (the handler sleeps
    # 0.5 s after its ledger row).
    marks = [r.mark() for r in replicas]
    victim: Replica | None = None
    deadline = time.monotonic() + 5
    while victim is None and time.monotonic() < deadline:
        for replica, mark in zip(replicas, marks, strict=True):
            if replica.try_wait_for("ran", 0.005, start=mark) is not None:
                victim = replica
                break
    killed_mid_run = victim is not None
    if victim is None:
        victim = replicas[2]
    victim_id = replicas.index(victim)
    victim_pid = victim.pid
    victim.kill9()
    t_kill = time.time()
    replacement = cluster.spawn(victim_id, name, args, label=f"{name}#{victim_id}-restarted")
    replacement.wait_for("started")
    survivors = [r for r in replicas if r is not victim]

    _sleep_until(t_start + 22)
    t_end = time.time()
    cluster.stop([*survivors, replacement])

    keys = _expected(t_start + 3, t_end - 3, cron=cron)
    ledger = _ledger(pg_dsn, name)
    by_key = _by_key(ledger)
    jobs = _jobs(pg_dsn, name)
    doubled = [k for k in keys if len(by_key.get(k, [])) >= 2]
    missed = [k for k in keys if k not in jobs or jobs[k].status != "SUCCESS"]
    unrun = [k for k in keys if not by_key.get(k)]
    cut_short = [r for r in ledger if r.pid == victim_pid and r.finished_at is None]
    _report(
        f"SC-01: replicas=3 ticks={len(keys)} doubled={len(doubled)} missed={len(missed)}"
        f" killed_mid_run={killed_mid_run} runs_cut_by_kill={len(cut_short)}"
        f" runs_per_replica={dict(sorted(Counter(r.replica_id for r in ledger).items()))}"
    )
    _report(f"ticks={len(keys)} doubled={len(doubled)} missed={len(missed)}")

    assert len(keys) >= 15
    assert all(WHOLE_SECOND_KEY.match(r.run_key) for r in ledger), "a run key is not canonical"
    assert not doubled, {k: [(r.replica_id, r.pid) for r in by_key[k]] for k in doubled}
    assert set(unrun) <= set(missed)
    assert len(missed) <= 1, f"missed ticks: {[(k, jobs.get(k)) for k in missed]}"
    for key in missed:
        # Lost only because its owner was killed during it: still RUNNING under the dead owner's
        # lease, scheduled just before the kill, and run (if at all) by the killed process only.
        job = jobs.get(key)
        assert job is not None, f"{key}: no row at all, nobody even acquired it"
        assert job.status == "RUNNING", f"{key}: {job}"
        assert {r.pid for r in by_key.get(key, [])} <= {victim_pid}
        assert t_kill - 2.5 <= _instant(key).timestamp() <= t_kill, (key, t_kill)
    for key in keys:
        if key in missed:
            continue
        (row,) = by_key[key]
        # One acquisition, never taken over: the run's token is the row's (tokens come from the
        # table's sequence, so not 1 for every key).
        assert row.fencing_token == jobs[key].fencing_token, (key, row, jobs[key])
        assert row.outcome == "ok"
    for row in cut_short:
        assert row.run_key in missed or row.run_key not in keys, (row, missed)
    stuck = sorted(k for k, job in jobs.items() if job.status == "RUNNING")
    assert set(stuck) <= set(missed), f"RUNNING rows left by graceful stops: {stuck}"

    reported = asyncio.run(_missed_via_api(pg_dsn, name, cron, t_start + 3, t_end - 3))
    assert [(m.run_key, m.status) for m in reported] == [
        (k, JobSchedulerStatus.RUNNING) for k in missed
    ]


# --------------------------------------------------------------------------- SC-02 / SC-03


@pytest.mark.slow
def test_sc02_clock_skew_same_run_keys_each_tick_once(pg_dsn: str, cluster: Cluster) -> None:
    """SC-02/SC-03: ``*/5 * * * * *`` on three replicas whose wall clocks are 0, +2 s and -2 s
    (faketime; less than half the period) and whose ``TZ`` differ. Every replica computes the same
    run key for every tick; the fast one fires 2 s early and wins; each tick runs once."""
    faketime = _require_faketime()
    _create_ledger(pg_dsn)
    name, cron = "sc02", "*/5 * * * * *"
    specs = [(0, 0.0, "UTC"), (1, 2.0, "Asia/Kolkata"), (2, -2.0, "America/New_York")]
    replicas: list[Replica] = []
    for replica_id, skew, tz in specs:
        prefix = [] if skew == 0 else [faketime, "-f", f"{skew:+g}"]
        env = {"TZ": tz, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
        replicas.append(
            cluster.spawn(replica_id, name, ["--cron", cron], prefix=prefix, extra_env=env)
        )
    offsets = []
    for (replica_id, skew, tz), replica in zip(specs, replicas, strict=True):
        ready = replica.wait_for("ready")
        offset = float(ready["offset_s"])
        offsets.append(offset)
        _report(
            f"SC-02: replica {replica_id} TZ={tz} wall={ready['wall_iso']}"
            f" offset_vs_db={offset:+.2f}s expected={skew:+.1f}s"
        )
        assert abs(offset - skew) < 0.5, f"replica {replica_id}: faketime not effective?"
    for replica in replicas:
        replica.wait_for("started")
    t_start = time.time()
    _sleep_until(t_start + 21)
    t_end = time.time()
    cluster.stop(replicas)

    keys = _expected(t_start + 3, t_end - 3, cron=cron)
    ledger = _ledger(pg_dsn, name)
    by_key = _by_key(ledger)
    jobs = _jobs(pg_dsn, name)
    fired: dict[int, Counter[str]] = {}
    for (replica_id, _, _), replica in zip(specs, replicas, strict=True):
        seen = Counter(e["run_key"] for e in replica.events("ran"))
        seen.update(
            e["run_key"] for e in replica.events("log") if e.get("action") == "tick_skipped"
        )
        fired[replica_id] = seen
    doubled = [k for k in keys if len(by_key.get(k, [])) > 1]
    lost = [k for k in keys if len(by_key.get(k, [])) == 0 or jobs[k].status != "SUCCESS"]
    early = [
        (_instant(r.run_key) - (r.app_now - timedelta(seconds=offsets[1]))).total_seconds()
        for k in keys
        for r in by_key.get(k, [])
        if r.replica_id == 1
    ]
    distinct = {k: len({rid for rid, seen in fired.items() if seen[k] == 1}) for k in keys}
    _report(
        f"SC-02: ticks={len(keys)} doubled={len(doubled)} lost={len(lost)}"
        f" replicas_with_same_key_per_tick={min(distinct.values(), default=0)}/3"
        f" max_early_s={max(early, default=0.0):.2f}"
    )

    assert len(keys) >= 2
    assert not doubled
    assert not lost
    all_keys = set(fired[0]) | set(fired[1]) | set(fired[2]) | {r.run_key for r in ledger}
    all_keys |= set(jobs)
    off_grid = sorted(
        k for k in all_keys if not WHOLE_SECOND_KEY.match(k) or _instant(k).second % 5
    )
    assert not off_grid, f"run keys off the */5 grid (derived from now?): {off_grid}"
    for key in keys:
        for replica_id, seen in fired.items():
            assert seen[key] == 1, f"replica {replica_id} fired {key} {seen[key]} times"
        (row,) = by_key[key]
        assert row.replica_id == 1, f"{key} ran on replica {row.replica_id}, not the fast one"
        # The fast replica fires by its own clock: 2 s before the scheduled instant. When its
        # handler began in real time is its own clock less its measured offset (the ledger row's
        # database time also counts the insert's wait for the server: reported, not judged).
        began = row.app_now - timedelta(seconds=offsets[1])
        ahead = (_instant(key) - began).total_seconds()
        landed = (_instant(key) - row.started_at).total_seconds()
        assert 1.5 <= ahead <= 2.5, (
            f"{key}: the fast replica's handler began {ahead:+.2f} s before the instant (its"
            f" clock {row.app_now.isoformat()}, offset {offsets[1]:+.2f} s); its ledger row"
            f" landed {landed:+.2f} s before it by the database's clock"
        )


# --------------------------------------------------------------------------- SC-09


def _next_odd_second(after: float) -> float:
    second = math.floor(after) + 1
    return float(second if second % 2 else second + 1)


@pytest.mark.slow
def test_sc09_catch_up_after_every_replica_was_down(pg_dsn: str, cluster: Cluster) -> None:
    """SC-09: an interval of 2 s; run, stop every replica, stay down over 3 ticks, start again
    with ``catch_up_window_ms=10_000``. ``latest``: only the most recent missed tick before the
    start runs; ``all`` (two replicas started at once): each missed tick in the window runs once.
    Ticks that succeeded before the stop and ticks older than the window never run again."""
    _create_ledger(pg_dsn)
    names = {"latest": "cu-latest", "all": "cu-all"}
    base = ["--interval-ms", "2000"]
    first = [
        cluster.spawn(0, names["latest"], base, label="latest-before"),
        cluster.spawn(1, names["all"], base, label="all-before"),
    ]
    for replica in first:
        replica.wait_for("started")
    # Ticks are on even seconds: stop and restart on odd seconds, 1 s away from any tick. The
    # first replicas run the two ticks of the catch-up window that precede the stop.
    t_stop = _next_odd_second(time.time() + 4.5)
    t_restart = t_stop + 6  # odd too; down over the ticks at t_stop + 1, + 3, + 5
    down = _expected(t_stop, t_restart, interval_ms=2000)
    assert len(down) == 3

    # The restarted replicas connect now and enter their scheduler at t_restart, together.
    window = ["--catch-up-window-ms", "10000", "--start-at", repr(t_restart)]
    second = {
        "latest": [
            cluster.spawn(2, names["latest"], [*base, "--catch-up", "latest", *window]),
        ],
        "all": [
            cluster.spawn(3, names["all"], [*base, "--catch-up", "all", *window]),
            cluster.spawn(4, names["all"], [*base, "--catch-up", "all", *window]),
        ],
    }
    restarted = [r for group in second.values() for r in group]
    _sleep_until(t_stop)
    cluster.stop(first)
    assert time.time() < t_restart - 3, "stopping took too long for the scenario"
    for replica in first:
        assert replica.events("ran"), f"{replica.label} ran nothing before the stop"
    before = {mode: _jobs(pg_dsn, name) for mode, name in names.items()}
    for replica in restarted:
        started = replica.wait_for("started", timeout=t_restart - time.time() + STARTUP_S)
        assert abs(float(started["entered"]) - t_restart) < 0.5, f"{replica.label} started late"
    _sleep_until(t_restart + 4.5)  # two regular ticks after the restart
    t_end = time.time()
    cluster.stop(restarted)

    in_window = _expected(t_restart - 10, t_restart, interval_ms=2000)
    after_restart = _expected(t_restart, t_end - 0.5, interval_ms=2000)
    results: dict[str, list[str]] = {}
    for mode, name in names.items():
        missed = [
            k for k in in_window if k not in before[mode] or before[mode][k].status != "SUCCESS"
        ]
        # The first replicas ran the window's ticks before the stop: only the downtime is missing.
        assert missed == down, (mode, down, missed)
        pids = {r.pid for r in second[mode]}
        ledger = _ledger(pg_dsn, name)
        caught_up = sorted(
            r.run_key
            for r in ledger
            if r.pid in pids and _instant(r.run_key).timestamp() < t_restart
        )
        beyond = [k for k in caught_up if _instant(k).timestamp() < t_restart - 10]
        counts = Counter(r.run_key for r in ledger)
        doubled = sorted(k for k, n in counts.items() if n > 1)
        results[mode] = caught_up
        _report(
            f"SC-09 catch_up={mode}: down_ticks={len(down)} missed_in_window={len(missed)}"
            f" ran={len(caught_up)} coalesced={len(missed) - len(caught_up)}"
            f" beyond_window_ran={len(beyond)} doubled={len(doubled)}"
        )
        assert not doubled, f"{mode}: ticks run twice: {doubled}"
        assert not beyond, f"{mode}: ticks older than the window ran: {beyond}"
        said = [
            e for r in second[mode] for e in r.events() if e.get("action", "").startswith("catch")
        ]
        if mode == "latest":
            assert caught_up == [max(missed)], (caught_up, missed, said, ledger)
        else:
            assert caught_up == sorted(missed), (caught_up, missed, said, ledger)
        # Ticks that had succeeded before the stop were not run again.
        succeeded = [k for k in in_window if k not in missed]
        assert all(counts[k] == 1 for k in succeeded), succeeded
        jobs = _jobs(pg_dsn, name)
        for key in [*caught_up, *after_restart]:
            assert counts[key] == 1, (mode, key, counts[key])
            assert jobs[key].status == "SUCCESS", (mode, key, jobs[key])
    assert results["latest"][0] < format_run_key(_utc(t_restart))


# --------------------------------------------------------------------------- SC-12


@pytest.mark.slow
def test_sc12_failed_tick_is_retried_by_another_replica(pg_dsn: str, cluster: Cluster) -> None:
    """Three replicas on ``*/3 * * * * *`` with ``retries=3, retry_backoff_ms=200``; replica 0's
    handler always raises. Replicas 1 and 2 run their scheduler clock 150 ms late
    (``Scheduler(clock=...)``), so replica 0 takes each tick first and fails it; the ``FAIL`` row
    is then taken (fencing token + 1) and completed by another replica. Every tick ends SUCCESS."""
    _create_ledger(pg_dsn)
    name, cron = "retry", "*/3 * * * * *"
    base = ["--cron", cron, "--retries", "3", "--retry-backoff-ms", "200"]
    replicas = [
        cluster.spawn(0, name, [*base, "--fail"]),
        cluster.spawn(1, name, [*base, "--clock-offset-ms", "-150"]),
        cluster.spawn(2, name, [*base, "--clock-offset-ms", "-150"]),
    ]
    for replica in replicas:
        replica.wait_for("started")
    t_start = time.time()
    _sleep_until(t_start + 16)
    t_end = time.time()
    cluster.stop(replicas)

    keys = _expected(t_start + 3, t_end - 3, cron=cron)
    by_key = _by_key(_ledger(pg_dsn, name))
    jobs = _jobs(pg_dsn, name)
    first_by_failing = 0
    attempts = []
    for key in keys:
        job = jobs.get(key)
        rows = by_key.get(key, [])
        assert job is not None, f"{key}: never acquired"
        assert job.status == "SUCCESS", f"{key}: {job} ledger={rows}"
        succeeded = [r for r in rows if r.outcome == "ok"]
        assert len(succeeded) == 1, f"{key}: {len(succeeded)} successful runs: {rows}"
        assert succeeded[0].replica_id != 0
        assert rows[-1] is succeeded[0], f"{key}: a run after the success: {rows}"
        assert all(r.outcome == "failed" for r in rows if r.replica_id == 0), rows
        assert sum(r.replica_id == 0 for r in rows) <= 4, "more attempts than retries=3 allow"
        # Each acquisition (first or takeover of the FAIL row) draws a higher fencing token.
        tokens = [r.fencing_token for r in rows if r.fencing_token is not None]
        assert len(tokens) == len(rows), rows
        assert tokens == sorted(set(tokens)), rows
        assert job.fencing_token == tokens[-1]
        if rows[0].replica_id == 0:
            first_by_failing += 1
            assert len(rows) >= 2
        attempts.append(len(rows))
    _report(
        f"SC-12 retry: ticks={len(keys)} first_attempt_by_failing_replica={first_by_failing}"
        f" completed_by_another={first_by_failing} runs_per_tick={Counter(attempts)}"
    )
    assert len(keys) >= 3
    assert first_by_failing >= 1, "replica 0 never took a tick first: the scenario did not happen"


# --------------------------------------------------------------------------- SC-11


@pytest.mark.slow
def test_sc11_overlap_policies(pg_dsn: str, cluster: Cluster) -> None:
    """SC-11: a per-second schedule whose handler takes 2.5 s. ``skip`` (default) on one replica
    and ``skip_cluster`` on two replicas never run two ticks at once. Controls prove the check
    can see overlap: ``allow`` on one replica, and per-process ``skip`` on two replicas, do."""
    _create_ledger(pg_dsn)
    base = ["--cron", "* * * * * *", "--sleep-ms", "2500"]
    setups = {
        "ov-skip": ("skip", 1),
        "ov-cluster": ("skip_cluster", 2),
        "ov-allow": ("allow", 1),
        "ov-local": ("skip", 2),
    }
    groups: dict[str, list[Replica]] = {}
    for name, (overlap, count) in setups.items():
        groups[name] = [cluster.spawn(i, name, [*base, "--overlap", overlap]) for i in range(count)]
    everyone = [r for group in groups.values() for r in group]
    for replica in everyone:
        replica.wait_for("started")
    t_start = time.time()
    _sleep_until(t_start + 9)
    cluster.stop(everyone)

    peak: dict[str, int] = {}
    runs: dict[str, int] = {}
    for name in setups:
        ledger = _ledger(pg_dsn, name)
        counts = Counter(r.run_key for r in ledger)
        assert all(n == 1 for n in counts.values()), f"{name}: a tick ran twice: {counts}"
        peak[name] = _max_concurrency(ledger)
        runs[name] = len(ledger)
        stuck = [k for k, job in _jobs(pg_dsn, name).items() if job.status == "RUNNING"]
        assert not stuck, f"{name}: RUNNING rows after a graceful stop: {stuck}"
    skipped = {
        name: sum(
            1 for r in group for e in r.events("log") if e.get("action") == "tick_overlap_skipped"
        )
        for name, group in groups.items()
    }
    _report(
        "SC-11: max_concurrent "
        + " ".join(
            f"{name}={peak[name]}(runs={runs[name]},skipped={skipped[name]})" for name in setups
        )
    )
    assert peak["ov-skip"] == 1
    assert peak["ov-cluster"] == 1
    assert runs["ov-skip"] >= 2
    assert runs["ov-cluster"] >= 2
    assert skipped["ov-skip"] >= 1
    assert skipped["ov-cluster"] >= 1
    assert peak["ov-allow"] >= 2, "control: overlap='allow' should overlap"
    assert peak["ov-local"] >= 2, "control: per-process skip does not guard the cluster"


# --------------------------------------------------------------------------- shutdown


@pytest.mark.slow
def test_shutdown_mid_run_leaves_fail_not_running(pg_dsn: str, cluster: Cluster) -> None:
    """SIGTERM while a 30 s handler runs, with ``grace_period_ms=500``: the process exits
    without waiting for the handler, and the tick's row is ``FAIL`` (not stuck ``RUNNING``)."""
    _create_ledger(pg_dsn)
    name = "slow"
    replica = cluster.spawn(
        0, name, ["--cron", "* * * * * *", "--sleep-ms", "30000", "--grace-period-ms", "500"]
    )
    replica.wait_for("started")
    ran = replica.wait_for("ran", timeout=10)
    time.sleep(0.3)
    t0 = time.monotonic()
    replica.send_signal(signal.SIGTERM)
    rc = replica.wait_exit(15)
    exit_s = time.monotonic() - t0
    assert rc == 0, f"rc={rc} after SIGTERM\n{replica.stderr_tail()}"
    replica.wait_for("stopped", timeout=5)

    jobs = _jobs(pg_dsn, name)
    ledger = _ledger(pg_dsn, name)
    job = jobs[ran["run_key"]]
    _report(f"shutdown: exit_s={exit_s:.2f} row={job.status} data={job.data} runs={len(ledger)}")
    assert exit_s < 10, "the process waited for its handler instead of cancelling it"
    assert job.status == "FAIL", job
    assert [k for k, j in jobs.items() if j.status == "RUNNING"] == []
    assert [(r.run_key, r.outcome) for r in ledger] == [(ran["run_key"], "cancelled")]


# --------------------------------------------------------------------------- SC-13 / SC-14


def _attempts(dsn: str, code: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT run_key, attempts FROM job_scheduler WHERE code = %s AND run_key IS NOT NULL",
            (code,),
        ).fetchall()
    return {row[0]: row[1] for row in rows}


@pytest.mark.slow
def test_sc13_failing_tick_runs_at_most_retries_plus_one_times(
    pg_dsn: str, cluster: Cluster
) -> None:
    """SC-13: a cluster of three replicas per setting, all six at once; in each, the wall clocks
    are 0, +300 and +600 ms apart (faketime), ``*/2 * * * * *``, a handler that always fails
    after 100 ms. ``retries=0``: each tick runs exactly once in the cluster, not once per
    replica. ``retries=2``: at most 3 times, never two at once, and the retries do happen."""
    faketime = _require_faketime()
    _create_ledger(pg_dsn)
    cron = "*/2 * * * * *"
    fleets: dict[int, list[Replica]] = {}
    for retries in (0, 2):
        base = ["--cron", cron, "--fail", "--sleep-ms", "100", "--retries", str(retries)]
        base += ["--retry-backoff-ms", "200"]
        fleets[retries] = []
        for replica_id, skew in enumerate((0.0, 0.3, 0.6)):
            prefix = [] if skew == 0 else [faketime, "-f", f"{skew:+g}"]
            env = {"FAKETIME_DONT_FAKE_MONOTONIC": "1"}
            fleets[retries].append(
                cluster.spawn(replica_id, f"sc13-{retries}", base, prefix=prefix, extra_env=env)
            )
    everyone = [r for fleet in fleets.values() for r in fleet]
    for fleet in fleets.values():
        for replica_id, replica in enumerate(fleet):
            offset = float(replica.wait_for("ready")["offset_s"])
            assert abs(offset - 0.3 * replica_id) < 0.25, f"{replica.label}: offset {offset}"
    for replica in everyone:
        replica.wait_for("started")
    t_start = time.time()
    _sleep_until(t_start + 14)
    t_end = time.time()
    cluster.stop(everyone)

    keys = _expected(t_start + 2, t_end - 3, cron=cron)
    assert len(keys) >= 4
    for retries in fleets:
        name = f"sc13-{retries}"
        by_key = _by_key(_ledger(pg_dsn, name))
        attempts = _attempts(pg_dsn, name)
        jobs = _jobs(pg_dsn, name)
        runs = Counter({key: len(by_key.get(key, [])) for key in keys})
        peaks = {key: _max_concurrency(by_key[key]) for key in keys if key in by_key}
        _report(
            f"SC-13 retries={retries}: ticks={len(keys)} runs_per_tick={Counter(runs.values())}"
        )
        for key in keys:
            assert jobs[key].status == "FAIL", (retries, key, jobs[key])
            assert 1 <= runs[key] <= retries + 1, (retries, key, by_key.get(key))
            assert attempts[key] == runs[key], (retries, key, attempts[key], by_key.get(key))
            assert peaks[key] == 1, f"retries={retries} {key}: two runs at once: {by_key[key]}"
            assert [r.attempt for r in by_key[key]] == list(range(1, runs[key] + 1))
        if retries == 0:
            assert set(runs.values()) == {1}
        else:
            assert max(runs.values()) == retries + 1, "the retries never happened"


@pytest.mark.slow
def test_sc14_sigkill_mid_run_the_abandoned_tick_reruns_once_its_lease_expires(
    pg_dsn: str, cluster: Cluster
) -> None:
    """SC-14: a 1 s schedule, the default 1 h catch-up window,
    ``catch_up="all"`` and a 3 s lease; replica 0's handler takes 5 s. While it runs a tick it is
    killed with SIGKILL: another replica's sweep re-runs that tick once its lease has expired, and
    no tick from before the replicas started runs (the window's 3,600 ticks must not hide the
    abandoned one from the sweep)."""
    _create_ledger(pg_dsn)
    name = "sc14"
    common = ["--cron", "* * * * * *", "--catch-up", "all", "--lease-ms", "3000"]
    start_at = time.time() + 4
    replicas = [
        cluster.spawn(0, name, [*common, "--sleep-ms", "5000", "--start-at", str(start_at)]),
        cluster.spawn(1, name, [*common, "--sleep-ms", "100", "--start-at", str(start_at)]),
        cluster.spawn(2, name, [*common, "--sleep-ms", "100", "--start-at", str(start_at)]),
    ]
    entered = [float(r.wait_for("started")["entered"]) for r in replicas]
    victim = replicas[0]
    # The victim must win a tick first; the three race for each one, so that is a matter of luck
    # (it may lose many in a row): give it room rather than rig the race.
    ran = victim.wait_for("ran", timeout=45)
    time.sleep(0.5)
    victim.kill9()
    t_kill = time.time()
    abandoned = ran["run_key"]
    # Wait (9 s at most) for the rerun to finish, then 3 s more: a second rerun, or any other
    # tick run twice, would have to start meanwhile, as the survivors race for every tick.
    deadline = t_kill + 9
    while time.time() < deadline:
        if any(r.outcome == "ok" for r in _ledger(pg_dsn, name) if r.run_key == abandoned):
            _sleep_until(min(deadline, time.time() + 3))
            break
        time.sleep(0.2)
    cluster.stop(replicas[1:])

    by_key = _by_key(_ledger(pg_dsn, name))
    rows = by_key[abandoned]
    jobs = _jobs(pg_dsn, name)
    _report(
        f"SC-14: abandoned={abandoned} runs={[(r.replica_id, r.outcome) for r in rows]}"
        f" rerun_after_kill_s="
        f"{(rows[-1].started_at.timestamp() - t_kill) if len(rows) > 1 else float('nan'):.2f}"
    )
    assert rows[0].replica_id == 0
    assert rows[0].outcome is None, "the victim's run cannot have finished"
    assert len(rows) == 2, f"the abandoned tick ran {len(rows)} times: {rows}"
    assert rows[1].replica_id != 0
    assert rows[1].outcome == "ok"
    # Not before the lease ran out: 3 s after the victim's last heartbeat (every 1 s).
    assert rows[1].started_at.timestamp() >= t_kill + 3 - 1.0 - 0.5
    assert jobs[abandoned].status == "SUCCESS"
    first = min(entered)
    before = sorted(k for k in by_key if _instant(k).timestamp() < first - 0.001)
    assert before == [], f"ticks from before the start ran: {before}"
    doubled = [k for k, group in by_key.items() if len(group) > 1 and k != abandoned]
    assert doubled == [], doubled
