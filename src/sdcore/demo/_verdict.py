"""The demo's tables and its verdict, measured from the ledger and the lease table."""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import psycopg
from psycopg import sql

from sdcore.demo._replica import SCHEDULE
from sdcore.postgres import migrate

JOBS_TABLE = "sdcore_demo_jobs"
LEDGER_TABLE = "sdcore_demo_ledger"
RUN_KEY_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


@dataclass(frozen=True, slots=True, kw_only=True)
class Takeover:
    """A tick whose first owner died mid-run and that another owner finished.

    Attributes:
        run_key: The tick.
        started_by: ``(replica, pid, fencing_token)`` of each run that started, never finished.
        finished_by: ``(replica, pid)`` of the run that finished it.
        fencing_token: The finishing run's fencing token (above the dead owner's).
    """

    run_key: str
    started_by: list[tuple[int, int, int]]
    finished_by: tuple[int, int]
    fencing_token: int


@dataclass(slots=True, kw_only=True)
class Verdict:
    """What the ledger and the lease table say about the observed window.

    Attributes:
        window_start: First whole second judged.
        window_end: End of the window (exclusive).
        expected: Ticks in the window.
        ran_once: Ticks with exactly one finished run.
        doubled: Ticks that finished more than once.
        missed: Ticks that never finished.
        unfinished: Ticks still running when a partial verdict was taken (not counted as missed).
        not_success: Ticks whose lease row is not ``SUCCESS``.
        skipped: Missed ticks a replica recorded as skipped on purpose, with the reason the
            lease row gives (``overlap``).
        per_replica: Finished runs per replica.
        takeovers: Ticks finished by another replica after their owner died mid-run.
        partial: The demo was interrupted; the window ends at the interruption.
    """

    window_start: datetime
    window_end: datetime
    expected: int
    ran_once: int
    doubled: list[str] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)
    not_success: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    per_replica: dict[int, int] = field(default_factory=dict)
    takeovers: list[Takeover] = field(default_factory=list)
    partial: bool = False

    @property
    def ok(self) -> bool:
        """Every tick of the window ran exactly once (ticks still running excepted if partial)."""
        return not self.doubled and not self.missed


async def _migrate(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await migrate(conn, "lease", table=JOBS_TABLE)


def prepare(dsn: str) -> None:
    """Create or upgrade (sdcore's migrations), then empty, the demo's lease table and ledger."""
    asyncio.run(_migrate(dsn))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (id bigserial PRIMARY KEY, run_key text NOT NULL,"
                " replica int NOT NULL, pid int NOT NULL, fencing_token bigint NOT NULL,"
                " ran_at timestamptz NOT NULL DEFAULT clock_timestamp())"
            ).format(sql.Identifier(LEDGER_TABLE))
        )
        # Older demo ledgers have no phase: every row was a finished run.
        conn.execute(
            sql.SQL(
                "ALTER TABLE {} ADD COLUMN IF NOT EXISTS phase text NOT NULL DEFAULT 'done'"
            ).format(sql.Identifier(LEDGER_TABLE))
        )
        conn.execute(
            sql.SQL("TRUNCATE {}, {}").format(
                sql.Identifier(JOBS_TABLE), sql.Identifier(LEDGER_TABLE)
            )
        )


def window_keys(start: datetime, end: datetime) -> list[str]:
    """Run keys of the whole seconds after ``start`` and before ``end``."""
    keys = []
    current = start.replace(microsecond=0) + timedelta(seconds=1)
    while current < end:
        keys.append(current.strftime(RUN_KEY_FORMAT))
        current += timedelta(seconds=1)
    return keys


def compute_verdict(dsn: str, start: datetime, end: datetime, *, partial: bool = False) -> Verdict:
    """Judge the whole seconds in ``(start, end)`` from the ledger and the lease table.

    Args:
        dsn: The demo's database.
        start: When the replicas were all ready.
        end: End of the window (exclusive).
        partial: The demo was interrupted: a tick whose lease is still ``RUNNING`` is reported as
            unfinished instead of missed.
    """
    expected = window_keys(start, end)
    with psycopg.connect(dsn, autocommit=True) as conn:
        ledger = conn.execute(
            sql.SQL(
                "SELECT run_key, replica, pid, fencing_token, phase FROM {} WHERE run_key = ANY(%s)"
                " ORDER BY id"
            ).format(sql.Identifier(LEDGER_TABLE)),
            (expected,),
        ).fetchall()
        rows = conn.execute(
            sql.SQL(
                "SELECT run_key, status, data ->> 'skipped' FROM {}"
                " WHERE code = %s AND run_key = ANY(%s)"
            ).format(sql.Identifier(JOBS_TABLE)),
            (SCHEDULE, expected),
        ).fetchall()
    done = [_Run.of(row) for row in ledger if row[4] == "done"]
    started = [_Run.of(row) for row in ledger if row[4] == "started"]
    runs = Counter(run.key for run in done)
    status = {str(run_key): str(state) for run_key, state, _ in rows}
    reasons = {str(run_key): str(reason) for run_key, _, reason in rows if reason is not None}
    never = [key for key in expected if runs[key] == 0]
    unfinished = [key for key in never if partial and status.get(key) == "RUNNING"]
    missed = [key for key in never if key not in unfinished]
    return Verdict(
        window_start=start.replace(microsecond=0) + timedelta(seconds=1),
        window_end=end,
        expected=len(expected),
        ran_once=sum(1 for key in expected if runs[key] == 1),
        doubled=[key for key in expected if runs[key] > 1],
        missed=missed,
        unfinished=unfinished,
        not_success=[key for key in expected if status.get(key) != "SUCCESS"],
        skipped={key: reasons[key] for key in missed if key in reasons},
        per_replica=dict(sorted(Counter(run.replica for run in done).items())),
        takeovers=_takeovers(started, done),
        partial=partial,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Run:
    key: str
    replica: int
    pid: int
    token: int

    @classmethod
    def of(cls, row: tuple[object, ...]) -> _Run:
        key, replica, pid, token = row[:4]
        return cls(
            key=str(key), replica=int(str(replica)), pid=int(str(pid)), token=int(str(token))
        )


def _takeovers(started: list[_Run], done: list[_Run]) -> list[Takeover]:
    finished = {(run.key, run.token) for run in done}
    abandoned: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for run in started:
        if (run.key, run.token) not in finished:
            abandoned[run.key].append((run.replica, run.pid, run.token))
    return [
        Takeover(
            run_key=run.key,
            started_by=abandoned[run.key],
            finished_by=(run.replica, run.pid),
            fencing_token=run.token,
        )
        for run in done
        if abandoned.get(run.key) and run.token > max(t for _, _, t in abandoned[run.key])
    ]


def report(verdict: Verdict, out: Callable[[str], None]) -> None:
    """Print ``verdict``: the counts, the takeovers, then PASS, FAIL or PARTIAL last."""
    share = ", ".join(f"replica-{n}: {count}" for n, count in verdict.per_replica.items())
    out("")
    window = f"{verdict.window_start:%H:%M:%S}–{verdict.window_end:%H:%M:%S} UTC"
    kind = "partial verdict (interrupted)" if verdict.partial else "verdict"
    out(f"{kind} over {window} (measured from the ledger and the lease table):")
    counts = (
        f"  ticks={verdict.expected} ran_once={verdict.ran_once}"
        f" doubled={len(verdict.doubled)} missed={len(verdict.missed)}"
    )
    if verdict.partial:
        counts += f" still_running={len(verdict.unfinished)}"
    out(counts + f" lease_rows_not_success={len(verdict.not_success)}")
    out(f"  runs per replica: {share or 'none'}")
    for takeover in verdict.takeovers:
        first = ", ".join(
            f"replica-{r} (pid {p}, fencing_token={t})" for r, p, t in takeover.started_by
        )
        replica, pid = takeover.finished_by
        out(
            f"  takeover: tick {takeover.run_key} was started by {first}, which died mid-run;"
            f" replica-{replica} (pid {pid}) took it over with fencing_token="
            f"{takeover.fencing_token}"
        )
    missed = [
        f"{key} (recorded as skipped: {verdict.skipped[key]})" if key in verdict.skipped else key
        for key in verdict.missed
    ]
    for label, keys in (
        ("doubled", verdict.doubled),
        ("missed", missed),
        ("still running", verdict.unfinished),
    ):
        if keys:
            out(f"  {label}: {', '.join(keys[:10])}")
    if not verdict.ok:
        out("  FAIL: see above.")
    elif verdict.partial:
        out("  PARTIAL: every finished tick so far ran exactly once (interrupted).")
    else:
        out("  PASS: every tick ran exactly once.")
