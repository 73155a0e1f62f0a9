"""``sdcore demo``: N replicas, one per-second schedule, a SIGKILL half-way, a measured verdict."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import psycopg
from psycopg import sql

from sdcore.demo._embedded import embedded_postgres
from sdcore.demo._replica import SCHEDULE
from sdcore.postgres import redact_text, schema_sql

JOBS_TABLE = "sdcore_demo_jobs"
LEDGER_TABLE = "sdcore_demo_ledger"
_COLORS = ["\033[36m", "\033[33m", "\033[35m", "\033[32m", "\033[34m", "\033[91m"]


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoOptions:
    """What ``sdcore demo`` runs.

    Attributes:
        replicas: Replica processes (2–16).
        duration_s: Seconds of ticks to observe (10–600).
        database_url: A PostgreSQL to use; ``None`` starts the embedded one.
        kill: SIGKILL one replica half-way and start it again.
    """

    replicas: int = 3
    duration_s: int = 30
    database_url: str | None = None
    kill: bool = True


@dataclass(slots=True, kw_only=True)
class Verdict:
    """What the ledger and the lease table say about the observed window."""

    window_start: datetime
    window_end: datetime
    expected: int
    ran_once: int
    doubled: list[str] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)
    not_success: list[str] = field(default_factory=list)
    per_replica: dict[int, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every tick of the window ran exactly once."""
        return not self.doubled and not self.missed


class _Replica:
    def __init__(self, number: int, dsn: str, catch_up_ms: int) -> None:
        command = [
            sys.executable,
            "-m",
            "sdcore.demo._replica",
            "--dsn",
            dsn,
            "--replica",
            str(number),
            "--table",
            JOBS_TABLE,
            "--ledger",
            LEDGER_TABLE,
        ]
        if catch_up_ms:
            # Catch up only ticks since the demo started, not the ones before it.
            command += ["--catch-up-ms", str(catch_up_ms)]
        self.number = number
        self.ready = threading.Event()
        self.error: str | None = None
        self.process = subprocess.Popen(  # noqa: S603 - our own module, argument list
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None  # noqa: S101
        with self.process.stdout:
            for line in self.process.stdout:
                self._handle(line)

    def _handle(self, line: str) -> None:
        with contextlib.suppress(ValueError):
            message = json.loads(line)
            if "ready" in message:
                self.ready.set()
            elif "error" in message:
                self.error = str(message["error"])
                self.ready.set()

    def alive(self) -> bool:
        return self.process.poll() is None


def _color(number: int, text: str, tty: bool) -> str:
    return f"{_COLORS[number % len(_COLORS)]}{text}\033[0m" if tty else text


def _prepare(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(schema_sql(table=JOBS_TABLE).encode())
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (id bigserial PRIMARY KEY, run_key text NOT NULL,"
                " replica int NOT NULL, pid int NOT NULL, fencing_token bigint NOT NULL,"
                " ran_at timestamptz NOT NULL DEFAULT clock_timestamp())"
            ).format(sql.Identifier(LEDGER_TABLE))
        )
        conn.execute(
            sql.SQL("TRUNCATE {}, {}").format(
                sql.Identifier(JOBS_TABLE), sql.Identifier(LEDGER_TABLE)
            )
        )


def _new_rows(conn: psycopg.Connection[tuple[object, ...]], after: int) -> list[tuple[object, ...]]:
    query = sql.SQL(
        "SELECT id, run_key, replica, pid, fencing_token FROM {} WHERE id > %s ORDER BY id"
    ).format(sql.Identifier(LEDGER_TABLE))
    return conn.execute(query, (after,)).fetchall()


def compute_verdict(dsn: str, start: datetime, end: datetime) -> Verdict:
    """Judge the whole seconds in ``[start, end)`` from the ledger and the lease table."""
    first = start.replace(microsecond=0) + timedelta(seconds=1)
    expected = []
    current = first
    while current < end:
        expected.append(current.strftime("%Y-%m-%dT%H:%M:%SZ"))
        current += timedelta(seconds=1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        ledger = conn.execute(
            sql.SQL("SELECT run_key, replica FROM {} WHERE run_key = ANY(%s)").format(
                sql.Identifier(LEDGER_TABLE)
            ),
            (expected,),
        ).fetchall()
        rows = conn.execute(
            sql.SQL("SELECT run_key, status FROM {} WHERE code = %s AND run_key = ANY(%s)").format(
                sql.Identifier(JOBS_TABLE)
            ),
            (SCHEDULE, expected),
        ).fetchall()
    runs = Counter(str(run_key) for run_key, _ in ledger)
    status = {str(run_key): str(state) for run_key, state in rows}
    per_replica = Counter(int(str(replica)) for _, replica in ledger)
    return Verdict(
        window_start=first,
        window_end=end,
        expected=len(expected),
        ran_once=sum(1 for key in expected if runs[key] == 1),
        doubled=[key for key in expected if runs[key] > 1],
        missed=[key for key in expected if runs[key] == 0],
        not_success=[key for key in expected if status.get(key) != "SUCCESS"],
        per_replica=dict(sorted(per_replica.items())),
    )


@contextlib.contextmanager
def _database(options: DemoOptions, out: Callable[[str], None]) -> Iterator[str]:
    if options.database_url:
        out("database: the one you gave (tables sdcore_demo_jobs and sdcore_demo_ledger)")
        yield options.database_url
        return
    out("database: none configured, starting an embedded PostgreSQL in a temporary folder…")
    with embedded_postgres() as uri:
        yield uri


def run_demo(options: DemoOptions, out: Callable[[str], None] = print) -> int:
    """Run the demo and return 0 if every tick ran exactly once, 1 otherwise."""
    tty = sys.stdout.isatty()
    with _database(options, out) as dsn:
        _prepare(dsn)
        out(
            f"starting {options.replicas} replicas, each firing schedule {SCHEDULE!r} every second…"
        )
        replicas = {n: _Replica(n, dsn, 0) for n in range(1, options.replicas + 1)}
        try:
            return _observe(options, dsn, replicas, out, tty)
        finally:
            for replica in replicas.values():
                if replica.alive():
                    replica.process.send_signal(signal.SIGTERM)
            for replica in replicas.values():
                try:
                    replica.process.wait(10)
                except subprocess.TimeoutExpired:
                    replica.process.kill()
                    replica.process.wait()
                replica.reader.join(5)


def _observe(
    options: DemoOptions,
    dsn: str,
    replicas: dict[int, _Replica],
    out: Callable[[str], None],
    tty: bool,
) -> int:
    for replica in replicas.values():
        if not replica.ready.wait(60) or replica.error:
            raise RuntimeError(
                f"replica {replica.number} did not start: "
                + redact_text(replica.error or "timeout", dsn)
            )
    start = datetime.now(UTC)
    end = start + timedelta(seconds=options.duration_s)
    kill_at = start + timedelta(seconds=options.duration_s / 2)
    restart_at: datetime | None = None
    victim: _Replica | None = None
    last_id = 0
    last_runner = 1
    out(f"all replicas ready; watching for {options.duration_s} s (Ctrl-C to stop early)\n")
    with psycopg.connect(dsn, autocommit=True) as conn:
        while datetime.now(UTC) < end:
            for row_id, run_key, number, pid, fencing in _new_rows(conn, last_id):
                last_id = int(str(row_id))
                last_runner = int(str(number))
                label = _color(int(str(number)), f"replica-{number} (pid {pid})", tty)
                out(f"  tick {run_key}  ran on {label}  fencing_token={fencing}")
            now = datetime.now(UTC)
            if options.kill and victim is None and now >= kill_at:
                # Kill the replica that ran the latest tick: the one most likely to own the next.
                victim = replicas[last_runner]
                victim.process.send_signal(signal.SIGKILL)
                victim.process.wait()
                victim.reader.join(5)
                out(_color(victim.number, f"  ✖ killed replica-{victim.number} with SIGKILL", tty))
                restart_at = now + timedelta(seconds=2.5)
            if victim is not None and restart_at is not None and now >= restart_at:
                since_start = int((now - start).total_seconds() * 1000)
                replicas[victim.number] = _Replica(victim.number, dsn, since_start)
                replicas[victim.number].ready.wait(60)
                out(
                    _color(
                        victim.number,
                        f"  ↻ restarted replica-{victim.number} (catches up missed ticks)",
                        tty,
                    )
                )
                restart_at = None
            time.sleep(0.2)
        time.sleep(2.5)  # let the last ticks (and any catch-up) finish
        for _, run_key, number, pid, fencing in _new_rows(conn, last_id):
            out(f"  tick {run_key}  ran on replica-{number} (pid {pid})  fencing_token={fencing}")
    verdict = compute_verdict(dsn, start, end)
    _report(verdict, out)
    return 0 if verdict.ok else 1


def _report(verdict: Verdict, out: Callable[[str], None]) -> None:
    share = ", ".join(f"replica-{n}: {count}" for n, count in verdict.per_replica.items())
    out("")
    window = f"{verdict.window_start:%H:%M:%S}–{verdict.window_end:%H:%M:%S} UTC"
    out(f"verdict over {window} (measured from the ledger and the lease table):")
    out(
        f"  ticks={verdict.expected} ran_once={verdict.ran_once}"
        f" doubled={len(verdict.doubled)} missed={len(verdict.missed)}"
        f" lease_rows_not_success={len(verdict.not_success)}"
    )
    out(f"  runs per replica: {share}")
    for label, keys in (("doubled", verdict.doubled), ("missed", verdict.missed)):
        if keys:
            out(f"  {label}: {', '.join(keys[:10])}")
    out("  PASS: every tick ran exactly once." if verdict.ok else "  FAIL: see above.")
