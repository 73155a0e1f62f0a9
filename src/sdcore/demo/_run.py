"""``sdcore demo``: N replicas, one per-second schedule, a SIGKILL mid-run, a measured verdict."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import psycopg
from psycopg import sql

from sdcore.demo._embedded import embedded_postgres
from sdcore.demo._replica import DSN_ENV, LEASE_MS
from sdcore.demo._verdict import (
    JOBS_TABLE,
    LEDGER_TABLE,
    compute_verdict,
    prepare,
    report,
    window_keys,
)
from sdcore.postgres import redact_text

_COLORS = ["\033[36m", "\033[33m", "\033[35m", "\033[32m", "\033[34m", "\033[91m"]
RESTART_AFTER_S = 2.5
# After the window: time for a takeover still under way (lease expiry plus one sweep) to finish.
SETTLE_S = LEASE_MS / 1000 * 2 + 6


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoOptions:
    """What ``sdcore demo`` runs.

    Attributes:
        replicas: Replica processes (2–16).
        duration_s: Seconds of ticks to observe (10–600).
        database_url: A PostgreSQL to use; ``None`` starts the embedded one.
        kill: SIGKILL the replica running a tick half-way, in the middle of that run, and start
            it again.
    """

    replicas: int = 3
    duration_s: int = 30
    database_url: str | None = None
    kill: bool = True


class _Kill:
    """Half-way, the first replica to report a started run is SIGKILLed right then."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.armed = False
        self.victim: _Replica | None = None
        self.run_key = ""
        self.fencing_token = 0

    def started(self, replica: _Replica, run_key: str, fencing_token: int) -> None:
        with self._lock:
            if not self.armed or self.victim is not None:
                return
            replica.process.send_signal(signal.SIGKILL)
            self.victim, self.run_key, self.fencing_token = replica, run_key, fencing_token


class _Replica:
    def __init__(self, number: int, dsn: str, epoch: float, kill: _Kill) -> None:
        # The URL (and its password) goes in the environment, readable by this user only; the
        # command line is visible to every local user (ps).
        command = [
            sys.executable,
            "-m",
            "sdcore.demo._replica",
            "--replica",
            str(number),
            "--table",
            JOBS_TABLE,
            "--ledger",
            LEDGER_TABLE,
            "--epoch",
            repr(epoch),
        ]
        self.number = number
        self.ready = threading.Event()
        self.error: str | None = None
        self._kill = kill
        # stdin: a pipe never written to; the replica stops at its EOF, i.e. when we are gone.
        self.process = subprocess.Popen(  # noqa: S603 - our own module, argument list
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, DSN_ENV: dsn},
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None  # noqa: S101
        with self.process.stdout:
            for line in self.process.stdout:
                self._handle(line)

    def _handle(self, line: str) -> None:
        with contextlib.suppress(ValueError, TypeError):
            message = json.loads(line)
            if "started" in message:
                self._kill.started(self, str(message["started"]), int(message["fencing_token"]))
            elif "ready" in message:
                self.ready.set()
            elif "error" in message:
                self.error = str(message["error"])
                self.ready.set()

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)

    def wait(self) -> None:
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        self.reader.join(5)


def _color(number: int, text: str, tty: bool) -> str:
    return f"{_COLORS[number % len(_COLORS)]}{text}\033[0m" if tty else text


@contextlib.contextmanager
def _database(options: DemoOptions, out: Callable[[str], None]) -> Iterator[str]:
    if options.database_url:
        out("database: the one you gave (tables sdcore_demo_jobs and sdcore_demo_ledger)")
        yield options.database_url
        return
    out("database: none configured, starting an embedded PostgreSQL in a temporary folder…")
    with embedded_postgres(out=lambda line: out(f"database: {line}")) as uri:
        yield uri


class _Session:
    """One run of the demo: the replicas, the live view, the kill and the restart."""

    def __init__(self, options: DemoOptions, dsn: str, out: Callable[[str], None]) -> None:
        self.options = options
        self.dsn = dsn
        self.out = out
        self.tty = sys.stdout.isatty()
        self.kill = _Kill()
        self.epoch = time.time()
        self.start: datetime | None = None
        self.replicas: dict[int, _Replica] = {}
        self._stopped = False

    def spawn(self, number: int) -> _Replica:
        replica = _Replica(number, self.dsn, self.epoch, self.kill)
        self.replicas[number] = replica
        return replica

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for replica in self.replicas.values():
            replica.stop()
        for replica in self.replicas.values():
            replica.wait()

    def run(self) -> int:
        self.out(
            f"starting {self.options.replicas} replicas, each firing schedule 'demo-tick' every"
            " second…"
        )
        for number in range(1, self.options.replicas + 1):
            self.spawn(number)
        for replica in self.replicas.values():
            if not replica.ready.wait(60) or replica.error:
                raise RuntimeError(
                    f"replica {replica.number} did not start: "
                    + redact_text(replica.error or "timeout", self.dsn)
                )
        self.start = start = datetime.now(UTC)
        end = start + timedelta(seconds=self.options.duration_s)
        self.out(
            f"all replicas ready; watching for {self.options.duration_s} s (Ctrl-C for a partial"
            " verdict)\n"
        )
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            view = _LiveView(conn, window_keys(start, end), self.out, self.tty)
            self._watch(view, start, end)
            view.settle(time.monotonic() + SETTLE_S)
        self.stop()
        verdict = compute_verdict(self.dsn, start, end)
        report(verdict, self.out)
        return 0 if verdict.ok else 1

    def _watch(self, view: _LiveView, start: datetime, end: datetime) -> None:
        kill_at = start + timedelta(seconds=self.options.duration_s / 2)
        restart_at: float | None = None
        announced = False
        while datetime.now(UTC) < end:
            view.poll()
            if self.options.kill and not self.kill.armed and datetime.now(UTC) >= kill_at:
                self.kill.armed = True
            victim = self.kill.victim
            if victim is not None and not announced:
                announced = True
                victim.wait()
                view.killed = (victim.number, self.kill.run_key)
                self.out(
                    _color(
                        victim.number,
                        f"  ✖ killed replica-{victim.number} with SIGKILL in the middle of tick"
                        f" {self.kill.run_key} (fencing_token={self.kill.fencing_token})",
                        self.tty,
                    )
                )
                restart_at = time.monotonic() + RESTART_AFTER_S
            if victim is not None and restart_at is not None and time.monotonic() >= restart_at:
                restart_at = None
                self.spawn(victim.number).ready.wait(60)
                self.out(
                    _color(
                        victim.number,
                        f"  ↻ restarted replica-{victim.number}; its tick's lease expires"
                        f" {LEASE_MS // 1000} s after its last heartbeat and a replica's catch-up"
                        " takes it over",
                        self.tty,
                    )
                )
            time.sleep(0.1)


class _LiveView:
    """Prints each finished run of the window as it lands, and nothing outside the window."""

    def __init__(
        self,
        conn: psycopg.Connection[tuple[object, ...]],
        keys: list[str],
        out: Callable[[str], None],
        tty: bool,
    ) -> None:
        self.conn = conn
        self.keys = keys
        self.out = out
        self.tty = tty
        self.last_id = 0
        self.seen: set[str] = set()
        self.killed: tuple[int, str] | None = None

    def poll(self) -> None:
        query = sql.SQL(
            "SELECT id, run_key, replica, pid, fencing_token FROM {}"
            " WHERE id > %s AND phase = 'done' AND run_key = ANY(%s) ORDER BY id"
        ).format(sql.Identifier(LEDGER_TABLE))
        for row_id, run_key, number, pid, fencing in self.conn.execute(
            query, (self.last_id, self.keys)
        ).fetchall():
            self.last_id = int(str(row_id))
            self.seen.add(str(run_key))
            label = _color(int(str(number)), f"replica-{number} (pid {pid})", self.tty)
            line = f"  tick {run_key}  ran on {label}  fencing_token={fencing}"
            if self.killed is not None and self.killed[1] == run_key and int(str(fencing)) > 1:
                line += f"  ← took over from the killed replica-{self.killed[0]}"
            self.out(line)

    def settle(self, deadline: float) -> None:
        """Wait (until ``deadline``) for every tick of the window to finish once."""
        while True:
            self.poll()
            if self.seen.issuperset(self.keys) or time.monotonic() >= deadline:
                return
            time.sleep(0.1)


def run_demo(options: DemoOptions, out: Callable[[str], None] = print) -> int:
    """Run the demo and return 0 if every tick ran exactly once, 1 otherwise.

    On Ctrl-C (``KeyboardInterrupt``) it stops the replicas, prints a partial verdict over the
    seconds observed so far, and re-raises.
    """
    with _database(options, out) as dsn:
        prepare(dsn)
        session = _Session(options, dsn, out)
        try:
            return session.run()
        except KeyboardInterrupt:
            interrupted = datetime.now(UTC)
            session.stop()
            if session.start is not None:
                verdict = compute_verdict(
                    dsn, session.start, interrupted.replace(microsecond=0), partial=True
                )
                report(verdict, out)
            raise
        finally:
            session.stop()
