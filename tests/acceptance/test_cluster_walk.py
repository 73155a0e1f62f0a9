"""The PostgreSQL counterpart of the cluster simulation (tests/unit/test_cluster_simulation.py):
three real replicas (``sdcore run`` of tests/acceptance/_walk_app.py, control plane on) steered by a
seeded random walk of operator actions and process faults, and the simulation's invariants
checked from the database's records at checkpoints and at the end.

The walk: pause, resume, trigger (with request ids, some sent twice), backfill (windows of a few
past seconds, some sent twice), create/update/remove of a stored schedule, SIGKILL and SIGTERM of
a replica and its restart — through ``ScheduleAdmin`` on the test's own pool, and some through the
real CLI (``python -m sdcore.cli schedules ...``). At least one replica stays alive throughout.

``SDCORE_WALK_SEED`` picks the seed (default: a new one per run, printed on failure),
``SDCORE_WALK_STEPS`` the number of steps (default 40, about 45 s on a loaded 2 vCPU). Each kind of
step (pause or resume, trigger, backfill, stored-schedule change, kill or restart, stop or
restart, wait) is drawn at least once, at a seeded random step; the others are drawn by weight.

Every check is a judgement on the database's records against a documented bound, never a
wall-clock deadline of the test's own (waits only bound how long it waits for work to finish).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TextIO

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from sdcore.scheduling import ControlSettings, PostgresScheduleStore, ScheduleAdmin
from sdcore.scheduling._owners import MEMBER_TTL_BEATS, OWNERS
from tests.acceptance._walk_plan import CODE, LEASE_MS

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.acceptance._walk_app:runtime"
STEPS = int(os.environ.get("SDCORE_WALK_STEPS", "40"))
SEED = int(os.environ.get("SDCORE_WALK_SEED", str(random.SystemRandom().randrange(1, 10**6))))
# The documented bound: a replica applies a pause within 2 s of its commit, and never starts a
# tick on a paused state older than 2 s (max(2 s, poll interval 1 s + 1 s)).
PAUSE_BOUND = timedelta(seconds=2)
CLOCK_SLACK = timedelta(milliseconds=50)  # the database and the replicas share this host's clock
REPLICAS = 3
# The kinds of step and their weights in the draw.
KINDS = {"pause": 3, "trigger": 4, "backfill": 2, "stored": 3, "kill": 1, "term": 1, "wait": 2}

EVENTS_DDL = """
CREATE TABLE walk_events (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    schedule text NOT NULL, run_key text NOT NULL, attempt integer NOT NULL,
    pid integer NOT NULL, phase text NOT NULL, fence bigint, args jsonb,
    at timestamptz NOT NULL DEFAULT clock_timestamp())
"""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@dataclass
class Life:
    """One replica process's life, by the database clock."""

    index: int
    pid: int
    began: datetime  # the database clock once its ready file was written
    log: Path
    ended: datetime | None = None
    how: str | None = None  # "kill" | "term"


@dataclass
class Stored:
    """A stored schedule the walk created (each creation gets a new name)."""

    name: str
    every_ms: int
    retries: int
    created: datetime
    removed: datetime | None = None


@dataclass
class Pause:
    schedule: str
    committed_by: datetime  # the database clock after the pause's call returned (>= its commit)
    resumed_at: datetime | None = None  # the resume action's created_at (<= its commit)


@dataclass
class Walk:
    """What the walk did, for the checks."""

    started: datetime
    pauses: list[Pause] = field(default_factory=list)
    requests: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    actions: dict[int, str] = field(default_factory=dict)  # trigger/backfill id -> schedule
    # trigger/backfill id -> the stored schedule's incarnation it was asked of
    incarnation: dict[int, Stored] = field(default_factory=dict)
    backfills: list[tuple[str, datetime, datetime]] = field(default_factory=list)
    stored: list[Stored] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    tally: dict[str, int] = field(default_factory=lambda: defaultdict(int))


class Cluster:
    def __init__(self, dsn: str, tmp: Path) -> None:
        self.dsn = dsn
        self.tmp = tmp
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.lives: list[Life] = []
        self.logs: list[TextIO] = []
        self.starts = 0

    def now(self) -> datetime:
        value = self.query("SELECT clock_timestamp()")[0][0]
        assert isinstance(value, datetime)
        return value

    def query(self, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return list(conn.execute(statement, params).fetchall())

    def start(self, index: int) -> None:
        self.starts += 1
        ready = self.tmp / f"ready-{index}-{self.starts}"
        env = {**os.environ, "SDCORE_WALK_DSN": self.dsn, "SDCORE_WALK_SEED": str(SEED)}
        log = open(self.tmp / f"replica-{index}-{self.starts}.log", "w")  # noqa: SIM115

        self.logs.append(log)
        path = self.tmp / f"replica-{index}-{self.starts}.log"
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "sdcore.cli", "run", APP, "--ready-file", str(ready)),
                *("--log-level", "INFO", "--log-json"),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
            text=True,
        )
        self.procs[index] = proc
        wait_for(ready.exists, 90, f"replica {index} ready")
        self.lives.append(Life(index, proc.pid, self.now(), path))

    def end(self, index: int, how: str) -> None:
        proc = self.procs.pop(index)
        proc.send_signal(signal.SIGKILL if how == "kill" else signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        life = next(life for life in self.lives if life.pid == proc.pid)
        life.ended = self.now()
        life.how = how

    def alive(self) -> list[int]:
        return sorted(self.procs)

    def stop_all(self) -> None:
        for index in list(self.procs):
            self.end(index, "term")
        for log in self.logs:
            log.close()

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [sys.executable, "-m", "sdcore.cli", "schedules", *args],
            cwd=ROOT,
            env={**os.environ, "DATABASE_URL": self.dsn},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 0, (args, out.stderr)
        return out


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    pytest.fail(f"seed {SEED}: timed out after {timeout} s waiting for {what}")


def key_instant(run_key: str) -> datetime | None:
    """The scheduled instant of a regular tick's run key (``None`` for trigger/backfill keys)."""
    if run_key.startswith(("trigger:", "backfill:")):
        return None
    return datetime.fromisoformat(run_key.replace("Z", "+00:00"))


def parse_utc(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def run_key(instant: datetime) -> str:
    return instant.strftime("%Y-%m-%dT%H:%M:%SZ")  # whole seconds: every period is


class Violations:
    def __init__(self) -> None:
        self.found: list[str] = []

    def add(self, invariant: str, detail: str) -> None:
        self.found.append(f"{invariant}: {detail}")


def budget(walk: Walk, schedule: str, key: str) -> int:
    """``retries + 1`` of the schedule a run key belongs to: a code schedule's, or that of the
    incarnation of a stored name (created and removed again under one name) it was run by."""
    if schedule in CODE:
        return CODE[schedule][1] + 1
    instant = key_instant(key)
    if instant is None:
        asked = walk.incarnation.get(int(key.split(":")[1]))
        candidates = [asked] if asked is not None else []
    else:
        slack = timedelta(seconds=1)
        candidates = [
            s
            for s in walk.stored
            if s.name == schedule
            and s.created - slack <= instant
            and (s.removed is None or instant <= s.removed + slack)
        ]
    if not candidates:
        candidates = [s for s in walk.stored if s.name == schedule]
    return max((s.retries for s in candidates), default=0) + 1


def check(cluster: Cluster, walk: Walk, *, final: bool) -> list[str]:
    """Check the invariants on the database's records; return the violations."""
    v = Violations()
    walk.tally.clear()
    now = cluster.now()
    ends = {life.pid: (life.ended or now) for life in cluster.lives}
    rows = cluster.query(
        "SELECT schedule, run_key, attempt, pid, phase, fence, at FROM walk_events ORDER BY id"
    )
    runs: dict[tuple[str, str, int, int, int | None], dict[str, Any]] = {}
    for schedule, key, attempt, pid, phase, fence, at in rows:
        ident = (schedule, key, attempt, pid, fence)
        if phase == "start":
            runs[ident] = {"start": at, "end": None, "phase": None}
        elif ident in runs:
            runs[ident]["end"] = at
            runs[ident]["phase"] = phase
    by_key: dict[tuple[str, str], list[tuple[Any, ...]]] = defaultdict(list)
    for (schedule, key, attempt, pid, fence), run in runs.items():
        end = run["end"] or ends[pid]  # a run without an end row ended with its process at latest
        by_key[(schedule, key)].append((run["start"], end, attempt, pid, fence, run["phase"]))

    # 1. No tick ran twice at once (recorded intervals lie inside the real ones, so an overlap
    # of recorded intervals is a real one).
    for (schedule, key), items in by_key.items():
        items.sort()
        latest_end, latest = None, None
        for item in items:
            if latest_end is not None and item[0] < latest_end:
                v.add("concurrent_run", f"{schedule} {key}: {latest} and {item}")
            if latest_end is None or item[1] > latest_end:
                latest_end, latest = item[1], item

    # 2. No tick ran more than retries + 1 times (runs whose process died or that were cancelled
    # are abandoned, re-run whatever the budget; each backfill covering a tick may start a new
    # budget for it).
    walk.tally["runs"] = len(runs)
    for (schedule, key), items in by_key.items():
        counted = [i for i in items if i[5] in ("done", "failed")]
        instant = key_instant(key)
        covers = sum(
            1
            for name, low, high in walk.backfills
            if name == schedule and instant is not None and low <= instant <= high
        )
        allowed = budget(walk, schedule, key) * (1 + covers)
        if len(counted) > allowed:
            v.add("too_many_runs", f"{schedule} {key}: {len(counted)} runs > {allowed}")
        if sum(1 for i in items if i[5] == "done") > 1:
            v.add("too_many_runs", f"{schedule} {key}: succeeded more than once")

    # 3. One trigger request (one request id) is one action.
    for request, ids in walk.requests.items():
        if len(ids) != 1:
            v.add("trigger_idempotency", f"request {request} recorded actions {sorted(ids)}")

    # 4. Nothing but a trigger or backfill starts on a paused schedule once the pause is older
    # than the documented bound: a first attempt of a tick scheduled after the bound (its gate
    # was asked at or after its instant), or a retry whose previous attempt ended after it,
    # that started before the resume was even written.
    for pause in walk.pauses:
        limit = pause.committed_by + PAUSE_BOUND + CLOCK_SLACK
        for (schedule, key), items in by_key.items():
            instant = key_instant(key)
            if schedule != pause.schedule or instant is None:
                continue
            if any(n == schedule and lo <= instant <= hi for n, lo, hi in walk.backfills):
                continue  # a backfill's run of this tick may start while paused
            ordered = sorted(items)
            for n, item in enumerate(ordered):
                if pause.resumed_at is not None and item[0] >= pause.resumed_at:
                    continue
                if item[0] < pause.committed_by:
                    continue
                gate_after = instant if n == 0 else ordered[n - 1][1]
                if gate_after > limit:
                    v.add(
                        "paused_started",
                        f"{schedule} {key} attempt {item[2]} started at {item[0]:%T.%f} on pid "
                        f"{item[3]}; paused by {pause.committed_by:%T.%f}",
                    )

    # 5. Every due tick of an active schedule in the checked window ran, was recorded (skipped,
    # failed, given back, running on a dead owner), or has no row only where a documented
    # exception allows it; missed_ticks (the CLI) agrees with the lease rows.
    low = walk.started + timedelta(seconds=5)
    high = now - timedelta(seconds=LEASE_MS / 1000 + 3)
    spans = [(name, every_ms, low, high, True) for name, (every_ms, _) in CODE.items()]
    for stored in walk.stored:
        start = max(low, stored.created + timedelta(seconds=3))
        stop = high if stored.removed is None else min(high, stored.removed - timedelta(seconds=3))
        spans.append((stored.name, stored.every_ms, start, stop, stored.removed is None))
    for name, every_ms, start, stop, cli in spans:
        if stop > start:
            for key in due_ticks(cluster, walk, name, every_ms, start, stop, cli=cli):
                v.add("clean_tick_lost", f"{name} {key}")

    # 6. A tick is skipped as paused only around a pause of its schedule: not before the pause
    # (a tick fires at most grace_period_ms late, 1.5 s), and not past the resume's propagation
    # bound (nor on a stored schedule re-created after the remove of a paused one).
    grace = timedelta(milliseconds=1_500)
    for schedule, key, modified in cluster.query(
        "SELECT code, run_key, modified_at FROM job_scheduler WHERE data ->> 'skipped' = 'paused'"
    ):
        instant = key_instant(key)
        if instant is None or instant < walk.started:
            continue
        inside = any(
            p.schedule == schedule
            and p.committed_by - PAUSE_BOUND - grace <= instant
            and (p.resumed_at is None or instant <= p.resumed_at + PAUSE_BOUND + CLOCK_SLACK)
            for p in walk.pauses
        )
        if not inside:
            v.add("paused_skip_unpaused", f"{schedule} {key} skipped as paused at {modified:%T.%f}")

    if final:
        # 7. Every trigger and backfill finished (CANCELLED only by a remove of its schedule).
        for action_id, schedule in walk.actions.items():
            found = cluster.query(
                "SELECT outcome, finished_at, progress FROM sdcore_schedules_actions WHERE id = %s",
                (action_id,),
            )
            outcome, finished, _ = found[0]
            removed = any(s.name == schedule and s.removed is not None for s in walk.stored)
            if finished is None:
                v.add("action_never_finishes", f"action {action_id} of {schedule} is open")
            elif outcome == "CANCELLED" and not removed:
                v.add("action_never_finishes", f"action {action_id} of {schedule} CANCELLED")
        # A trigger runs only into the schedule it was asked of: not into another one, nor (past
        # the propagation bound) after the remove of the stored schedule it was asked of.
        for (schedule, key), items in by_key.items():
            if key.startswith("trigger:"):
                action_id = int(key.split(":")[1])
                if walk.actions.get(action_id) != schedule:
                    v.add("remove_open_actions", f"{key} ran in {schedule}")
                asked = walk.incarnation.get(action_id)
                if asked is not None and asked.removed is not None:
                    late = [i for i in items if i[0] > asked.removed + PAUSE_BOUND]
                    if late:
                        v.add("remove_open_actions", f"{key} started after its remove: {late}")
    return v.found


def due_ticks(
    cluster: Cluster,
    walk: Walk,
    name: str,
    every_ms: int,
    low: datetime,
    high: datetime,
    *,
    cli: bool,
) -> list[str]:
    """The due ticks of ``name`` in ``[low, high]`` that no documented exception explains."""
    step = timedelta(milliseconds=every_ms)
    first = datetime.fromtimestamp(
        -(-int(low.timestamp() * 1000) // every_ms) * every_ms / 1000, UTC
    )
    instants = []
    at = first
    while at <= high:
        instants.append(at)
        at += step
    keys = [run_key(i) for i in instants]

    def read_rows() -> dict[str, tuple[Any, ...]]:
        return {
            r[0]: r[1:]
            for r in cluster.query(
                "SELECT run_key, status, attempts, data, given_back FROM job_scheduler"
                " WHERE code = %s AND run_key = ANY(%s)",
                (name, keys),
            )
        }

    rows = read_rows()
    if not instants:
        return []
    # a removed stored schedule has no definition left to ask missed_ticks about
    missed = missed_ticks(cluster, name, instants[0], instants[-1]) if cli else {}
    # A row that changed while missed_ticks ran (a resume's catch-up or a backfill ran the tick
    # meanwhile) cannot be compared with its answer; its latest state is judged below.
    after = read_rows() if cli else rows
    lost = []
    for instant, key in zip(instants, keys, strict=True):
        row = after.get(key)
        succeeded = row is not None and row[0] == "SUCCESS"
        walk.tally["ticks checked"] += 1
        if cli and rows.get(key) == row and succeeded == (key in missed):
            lost.append(f"{key}: missed_ticks says {missed.get(key)}, the lease row {row}")
            continue
        if row is not None:
            walk.tally["ticks with a row: " + outcome(row)] += 1
            continue
        why = excused(cluster, walk, name, instant)
        if why is None:
            lost.append(
                f"{key}: no row, a replica alive, no disturbance around it\n"
                + trace(cluster, name, instant)
            )
        else:
            walk.tally[f"ticks without a row: {why}"] += 1
    return lost


def trace(cluster: Cluster, name: str, instant: datetime) -> str:
    """What each replica alive around ``instant`` logged about ``name`` from 3 s before to 4 s
    after it: the evidence a lost tick's report carries."""
    low, high = instant - timedelta(seconds=3), instant + timedelta(seconds=4)
    lines = []
    for life in cluster.lives:
        if life.began > high or (life.ended is not None and life.ended < low):
            continue
        lines.append(
            f"    replica {life.index} pid {life.pid} {life.began:%T.%f}.."
            f"{'' if life.ended is None else f'{life.ended:%T.%f} ({life.how})'}"
        )
        for line in life.log.read_text().splitlines():
            try:
                record = json.loads(line)
                at = parse_utc(record["time"])
            except (ValueError, KeyError, TypeError):
                continue
            about = record.get("schedule") == name or (
                record.get("schedule") is None and repr(name) in str(record.get("message"))
            )
            if low <= at <= high and about:
                lines.append(
                    f"      {at:%T.%f} {record.get('action')} {record.get('run_key', '')}"
                    f" {str(record.get('message', ''))[:140]}"
                )
    return "\n".join(lines)


def missed_ticks(
    cluster: Cluster, name: str, first: datetime, last: datetime
) -> dict[str, dict[str, Any]]:
    """``sdcore schedules missed --json`` of ``name`` over ``[first, last]``, by run key."""
    out = cluster.cli(
        "missed",
        name,
        "--json",
        "--since",
        first.isoformat(),
        "--until",
        (last + timedelta(milliseconds=1)).isoformat(),
    )
    return {m["run_key"]: m for m in map(json.loads, out.stdout.splitlines())}


def outcome(row: tuple[Any, ...]) -> str:
    status, attempts, data, given_back = row
    data = data or {}
    if data.get("skipped"):
        return f"skipped ({data['skipped']})"
    if given_back:
        return "given back"
    return f"{status}" if status != "FAIL" else f"FAIL after {attempts} attempt(s)"


# What a replica logs for a due tick it leaves without a row (documented: each is a missed tick
# that the catch-up policy, off here, decides about).
EXPLAINED = {
    "tick_gate_unknown": "the paused state was not fresh",
    "ticks_coalesced": "the replica's loop was late",
    # A live fire that waited for the runs in its way (a backfill or catch-up run, or the
    # previous run waiting on the database), and whose successor came first
    # (docs/explanation/scheduling.md: a missed tick).
    "tick_deferred_missed": "its successor was due before the runs in its way ended",
}


def explanations(life: Life, periods: dict[str, int]) -> dict[tuple[str, str], str]:
    """(schedule, run key) -> why this replica left the tick without a row, from its log."""
    out: dict[tuple[str, str], str] = {}
    for line in life.log.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        action = record.get("action") if isinstance(record, dict) else None
        if action not in EXPLAINED:
            continue
        schedule = record.get("schedule")
        if action != "ticks_coalesced":
            out[(schedule, record.get("run_key"))] = EXPLAINED[action]
            continue
        # "n tick(s) passed while the loop was late; firing the latest": the n before the
        # latest due instant at the record's time
        every_ms = periods.get(schedule)
        skipped = int(record.get("message", "").split(": ", 1)[-1].split(" ", 1)[0] or 0)
        if every_ms is None or not skipped:
            continue
        at = int(parse_utc(record["time"]).timestamp() * 1000) // every_ms * every_ms
        for k in range(1, min(skipped, 1_000) + 1):
            instant = datetime.fromtimestamp((at - k * every_ms) / 1000, UTC)
            out[(schedule, run_key(instant))] = EXPLAINED[action]
    return out


def excused(cluster: Cluster, walk: Walk, name: str, instant: datetime) -> str | None:
    """Why a tick without a row is allowed, or ``None``. The documented exceptions (each a
    missed tick that the catch-up policy, off here, decides about):

    - no replica was alive at its instant (a replica counts from its ready file);
    - every replica that was up around its instant (ready for a second, and not ending within
      2 s) logged why it left the tick without a row (:data:`EXPLAINED`: its successor was due
      before the runs in its way ended, a not-fresh paused state, a late loop);
    - its schedule was paused, from 3 s before the pause's commit to 3 s after the resume (a
      replica whose view was not fresh held the tick as unknown);
    - at least :data:`OWNERS` replicas were killed in the membership TTL before it (3 heartbeats,
      and up to one more until the next read): they may be all three owners of its epoch in the
      live replicas' views, and then nobody asks for it until the views drop them (the
      documented trade of owners, ``docs/explanation/scheduling.md``).

    A replica's kill or stop alone is no exception: its epoch's other owners ask for the same
    tick, and a tick the victim had won keeps its ``RUNNING`` row."""
    margin = PAUSE_BOUND + timedelta(seconds=1)
    for pause in walk.pauses:
        if pause.schedule != name:
            continue
        until = pause.resumed_at + margin if pause.resumed_at else None
        if pause.committed_by - margin <= instant and (until is None or instant <= until):
            return "paused"
    alive = [
        life
        for life in cluster.lives
        if life.began <= instant and (life.ended is None or instant < life.ended)
    ]
    if not alive:
        return "no replica alive"
    up = [
        life
        for life in alive
        if life.began + timedelta(seconds=1) <= instant
        and (life.ended is None or instant <= life.ended - PAUSE_BOUND)
    ]
    if not up:
        return "its only replicas were starting or ending"
    in_view = timedelta(milliseconds=(MEMBER_TTL_BEATS + 1) * ControlSettings().heartbeat_ms)
    killed = [
        life
        for life in cluster.lives
        if life.how == "kill"
        and life.ended is not None
        and instant - in_view <= life.ended
        and life.ended <= instant
    ]
    if len(killed) >= OWNERS:
        return f"{len(killed)} replicas killed in the membership TTL before it"
    periods = {n: every for n, (every, _) in CODE.items()}
    periods.update({stored.name: stored.every_ms for stored in walk.stored})
    key = (name, run_key(instant))
    why = {explanations(life, periods).get(key) for life in up}
    if None in why:
        return None
    return " / ".join(sorted(w for w in why if w is not None))


class Walker:
    """Draws and performs the walk's steps."""

    def __init__(self, cluster: Cluster, admin: ScheduleAdmin, rng: random.Random) -> None:
        self.cluster = cluster
        self.admin = admin
        self.rng = rng
        self.walk = Walk(started=cluster.now())
        self.paused: dict[str, Pause] = {}
        self.requests = 0
        # Every kind at least once per walk (when it has that many steps), at seeded positions.
        kinds = list(KINDS)
        positions = rng.sample(range(STEPS), min(STEPS, len(kinds)))
        self.planned = dict(zip(positions, rng.sample(kinds, len(positions)), strict=True))

    def live_stored(self) -> list[Stored]:
        return [s for s in self.walk.stored if s.removed is None]

    def request_id(self) -> str:
        self.requests += 1
        return f"walk-{SEED}-{self.requests}"

    async def step(self, n: int) -> str:
        rng, cluster, admin = self.rng, self.cluster, self.admin
        names = [*CODE, *(s.name for s in self.live_stored())]
        choice = self.planned.get(n) or rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        if choice == "pause":
            name = rng.choice(names)
            cli = rng.random() < 0.3
            if name in self.paused:
                if cli:
                    out = cluster.cli("resume", name, "--actor", "walk", "--json")
                    resumed = parse_utc(json.loads(out.stdout)["created_at"])
                else:
                    resumed = (await admin.resume(name, actor="walk")).created_at
                self.paused.pop(name).resumed_at = resumed
                return f"resume {name}{' (cli)' if cli else ''}"
            if cli:
                cluster.cli("pause", name, "--actor", "walk", "--reason", "walk")
            else:
                await admin.pause(name, actor="walk", reason="walk")
            pause = Pause(name, cluster.now())
            self.paused[name] = pause
            self.walk.pauses.append(pause)
            return f"pause {name}{' (cli)' if cli else ''}"
        if choice == "trigger":
            name = rng.choice(names)
            request = self.request_id()
            sends = 2 if rng.random() < 0.4 else 1
            cli = rng.random() < 0.3
            for _ in range(sends):
                if cli:
                    out = cluster.cli(
                        "trigger", name, "--request-id", request, "--actor", "walk", "--json"
                    )
                    action_id = int(json.loads(out.stdout)["id"])
                else:
                    action_id = (await admin.trigger(name, actor="walk", request_id=request)).id
                self.walk.requests[request].add(action_id)
                self.walk.actions[action_id] = name
                for stored in self.live_stored():
                    if stored.name == name:
                        self.walk.incarnation[action_id] = stored
            return f"trigger {name} {request} x{sends}{' (cli)' if cli else ''}"
        if choice == "backfill":
            name = rng.choice(list(CODE))
            now = cluster.now()
            back = rng.randint(4, 15)
            high = (now - timedelta(seconds=back)).replace(microsecond=0)
            low = high - timedelta(seconds=rng.randint(0, 3))
            request = self.request_id()
            sends = 2 if rng.random() < 0.3 else 1
            for _ in range(sends):
                action = await admin.backfill(name, low, high, actor="walk", request_id=request)
                self.walk.requests[request].add(action.id)
                self.walk.actions[action.id] = name
            self.walk.backfills.append((name, low, high))
            return f"backfill {name} {low:%T}..{high:%T} {request} x{sends}"
        if choice == "stored":
            live = self.live_stored()
            if not live:
                every = rng.choice([1_000, 2_000])
                retries = rng.choice([0, 1])
                name = rng.choice(["s1", "s2"])  # a name may come back after its remove
                if rng.random() < 0.3:
                    cluster.cli(
                        "create",
                        name,
                        "--handler",
                        "work",
                        "--every-ms",
                        str(every),
                        "--option",
                        f"retries={retries}",
                        "--option",
                        f"lease_ms={LEASE_MS}",
                    )
                else:
                    await admin.create(
                        name,
                        handler="work",
                        every_ms=every,
                        options={"retries": retries, "lease_ms": LEASE_MS},
                        actor="walk",
                    )
                self.walk.stored.append(Stored(name, every, retries, cluster.now()))
                return f"create {name} every {every} retries {retries}"
            target = live[0]
            if rng.random() < 0.5:
                await admin.remove(target.name, actor="walk")
                target.removed = cluster.now()
                if target.name in self.paused:  # the remove ends its pause
                    self.paused.pop(target.name).resumed_at = target.removed
                return f"remove {target.name}"
            args = {"n": rng.randint(1, 9)}
            await admin.update(target.name, args=args, actor="walk")
            return f"update {target.name} args {args}"
        if choice in ("kill", "term"):
            alive = cluster.alive()
            dead = [i for i in range(REPLICAS) if i not in alive]
            if dead and (len(alive) == 1 or rng.random() < 0.6):
                index = rng.choice(dead)
                cluster.start(index)
                return f"restart replica {index}"
            index = rng.choice(alive)
            cluster.end(index, choice)
            return f"{choice} replica {index}"
        await asyncio.sleep(rng.uniform(1.0, 2.0))
        return "wait"


@pytest.fixture
def cluster(pg_dsn: str, tmp_path: Path) -> Iterator[Cluster]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(EVENTS_DDL)
    c = Cluster(pg_dsn, tmp_path)
    try:
        for index in range(REPLICAS):
            c.start(index)
        yield c
    finally:
        c.stop_all()


def test_random_walk_keeps_the_invariants(cluster: Cluster) -> None:
    rng = random.Random(SEED)
    began = time.monotonic()
    wait_for(
        lambda: cluster.query("SELECT count(*) FROM walk_events WHERE phase = 'start'")[0][0] >= 2,
        60,
        "the schedules running",
    )

    async def walk() -> tuple[Walker, list[str]]:
        pool = AsyncConnectionPool(cluster.dsn, min_size=1, max_size=2, open=False)
        await pool.open()
        try:
            admin = ScheduleAdmin(PostgresScheduleStore(pool))
            walker = Walker(cluster, admin, rng)
            found: list[str] = []
            checkpoints = {STEPS // 3, 2 * STEPS // 3}
            for n in range(STEPS):
                walker.walk.steps.append(f"{n:3d} {await walker.step(n)}")
                await asyncio.sleep(rng.uniform(0.2, 1.2))
                if n in checkpoints:
                    found = check(cluster, walker.walk, final=False)
                    if found:
                        return walker, found
            # The end: every replica up, every pause resumed, then wait for the open actions.
            for index in range(REPLICAS):
                if index not in cluster.procs:
                    cluster.start(index)
                    walker.walk.steps.append(f"end: restart replica {index}")
            for name in list(walker.paused):
                action = await admin.resume(name, actor="walk")
                walker.paused.pop(name).resumed_at = action.created_at
                walker.walk.steps.append(f"end: resume {name}")
            return walker, found
        finally:
            await pool.close()

    walker, found = asyncio.run(walk())
    report = "\n".join(walker.walk.steps)
    if not found:

        def open_actions() -> bool:
            ids = list(walker.walk.actions)
            rows = cluster.query(
                "SELECT count(*) FROM sdcore_schedules_actions"
                " WHERE id = ANY(%s) AND finished_at IS NULL",
                (ids,),
            )
            return bool(rows[0][0] == 0)

        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not open_actions():
            time.sleep(0.5)
        found = check(cluster, walker.walk, final=True)
    elapsed = time.monotonic() - began
    tally = ", ".join(f"{k}: {n}" for k, n in sorted(walker.walk.tally.items()))
    print(f"seed {SEED}: {STEPS} steps in {elapsed:.1f} s; {tally}\n{report}")  # noqa: T201
    if found:
        pytest.fail(
            f"seed {SEED} (reproduce with SDCORE_WALK_SEED={SEED} SDCORE_WALK_STEPS={STEPS}):\n"
            + "\n".join(found[:20])
            + f"\nwalk:\n{report}"
        )
