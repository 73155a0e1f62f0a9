"""Fleet: exclusive schedules on N replica processes, each a ``Runtime`` with its control plane.

Every replica is its own OS process running ``Runtime(database_url=..., redis_url=None, ...)``
(control plane on, as users run it) with the schedules registered on ``runtime.scheduler``
(``add_cron(..., exclusive=True)``, catch-up off: the defaults). Its handler appends
``S schedule instant time`` at its first line and ``E …`` at its last to a ledger file of its own
(one ``write`` each, ``O_APPEND``: a line survives a ``kill -9`` after it). Each case runs in a
scratch database of its own, created and dropped, so no case sees an earlier fleet's replicas.
Four modes (``--only``; all by default):

``steady``
    20 per-second crons (``* * * * * *``) on R replicas for each R of ``--replicas``. Once all are
    up and ``--warmup`` seconds have passed, a window of ``--seconds`` instants is measured:
    **PostgreSQL CPU** (``/proc/PID/schedstat``, scanned every 0.5 s) of the
    scratch database's backends (found by the database name in their process title, so backends
    that come and go are counted too), and separately of the postmaster and its background
    processes (shared with whatever else uses the server); the **fleet's CPU** (every replica
    process, summed). Both per tick run in the window. Correctness: every (schedule, instant) of
    the window started exactly once (union of the ledgers) and its lease row is ``SUCCESS``.
    Also the scratch database's transactions (``pg_stat_database``) per tick. Printed: the
    figures per R and the ratios largest R / smallest R (targets ≤ 1.5× for PostgreSQL, ≤ 2×
    for the fleet). ``--steady-schedules 0`` measures an idle fleet (control plane only), per
    second.
``burst``
    ``--burst-schedules`` crons all naming the same second of the day, on each R of
    ``--burst-replicas``; the instant is chosen ``--burst-lead`` seconds ahead (auto: long enough
    for the fleet to start). First/median/last handler start after the instant over the fleet,
    and each tick exactly once (ledgers, and the lease rows all ``SUCCESS``). Target: last ≤ 1 s.
    Also each replica's CPU from 50 ms before the instant to 500 ms after it: the first owner's
    (the replica that started most ticks) and the others' (what they took from it).
``kill``
    ``--kill-replicas`` replicas, ``--kill-schedules`` per-second crons, handlers of ``--work-ms``.
    At a half second, ``kill -9`` the first owner of the coming instants (the top of their
    epoch's rendezvous order, computed from the replicas' rows as the replicas compute it); then,
    in a fresh fleet, the first two owners. For each
    schedule they ran: which replica started the next tick, how long after the first instant past
    the kill, and which replicas ran it before and after (all its owners killed: skipped instants
    or a late start).
``churn``
    10 replicas and 5 per-second crons; every 2 s start a replica or ``kill -9`` a random live one
    (random, seeded; kept between 5 and 15) for ``--churn-seconds``; then doubled and missed ticks.

Counting (every mode, over the window's instants): a tick ran *once* when its lease row is
``SUCCESS`` and one run started that was not abandoned; *doubled* when two such runs started;
*abandoned* when its row is not ``SUCCESS`` and its run started on (or, with no start in any
ledger, its row was left ``RUNNING`` within 2 s of) a replica killed before the row was finalized
— with catch-up off (the default) such a tick stays ``RUNNING`` until its lease expires and
``Scheduler.missed_ticks`` lists it, so it is counted apart, not as missed; *missed* when its row
is not ``SUCCESS`` otherwise (nobody ran it, or it failed; the first rows are printed).

Connections: a replica holds its pool (it grows to ``pool_max_size``), one control-plane
connection and one for LISTEN. With ``--pool-max-size 0`` and ``--listen auto`` (defaults) the
script keeps the Runtime's defaults (pool 10, LISTEN on) when the fleet fits in the server's free
slots (``max_connections`` less those in use less 16 left to others), else shrinks the pool, then
turns LISTEN off (the control plane then polls only, every second, with unprepared statements).
``steady`` decides once for its largest R, so its ratios compare like with like; ``burst`` per R.
What was used is printed. ``--own-server`` starts a PostgreSQL of its own (``max_connections``
400, ``fsync`` on, ``pg_stat_statements``) so that every fleet runs the defaults, and prints the
scratch database's most frequent statements after each steady window.

CPU is the scheduler's own count of each process's time on a CPU (``/proc/PID/schedstat``, in
nanoseconds).

Usage::

    python benchmarks/fleet.py [--database-url URL] [--only MODE ...] [--replicas 3,24]
                               [--seconds 30] [--steady-schedules 20] [--burst-replicas 3,24]
                               [--burst-schedules 10000] [--gc-freeze] [--json PATH] [--keep]

``--gc-freeze``: each burst replica calls ``gc.collect()`` and ``gc.freeze()`` once started (the
schedules, triggers and caches leave the collector's sight), as an application may.

``--keep`` keeps the ledgers and each replica's log (stderr, warnings and up) in a directory it
prints. The fleet waits (up to 10 minutes) until the server has the connections it needs free.

Exits 0 whatever the figures (a benchmark, not a test). Needs ``/proc`` and a server on this
machine (its processes' CPU is read from ``/proc``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from sdcore import Runtime
from sdcore.postgres import DEFAULT_TABLES, PoolSettings
from sdcore.scheduling import ControlSettings, Tick
from sdcore.scheduling._owners import EPOCH_S, OWNERS, _score

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _harness import base_parser, machine, percentile, scratch_database

_DSN_ENV = "SDCORE_BENCH_REPLICA_DSN"  # keeps a password out of the process list
RESERVE = 16  # connection slots left to the server's other users
# --own-server: durable commits as on the shared server, room for 24 Runtimes' defaults.
OWN_SERVER = {
    "fsync": "on",
    "synchronous_commit": "on",
    "shared_buffers": "128MB",
    "max_connections": "400",
    "shared_preload_libraries": "'pg_stat_statements'",
}
Key = tuple[str, int]  # (schedule, instant)


# --------------------------------------------------------------------------- replica process


async def _replica(cfg: dict[str, Any]) -> None:
    logging.basicConfig(level=logging.WARNING)  # stderr goes to the replica's log file
    runtime = Runtime(
        database_url=os.environ[_DSN_ENV],
        pool=PoolSettings(max_size=cfg["pool"], application_name=f"fleet-r{cfg['index']}"),
        control=ControlSettings(listen=cfg["listen"]),
    )
    ledger = os.open(cfg["ledger"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    work = cfg["work_ms"] / 1000

    async def handler(tick: Tick) -> None:
        started = time.time()
        line = f"{tick.schedule} {tick.scheduled_at.timestamp():.0f}"
        os.write(ledger, f"S {line} {started:.6f}\n".encode())
        if work:
            await asyncio.sleep(work)
        os.write(ledger, f"E {line} {time.time():.6f}\n".encode())

    for name, cron in _schedules(cfg["spec"]):
        runtime.scheduler.add_cron(name, cron, handler, exclusive=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with runtime:
        if cfg.get("gc_freeze"):
            gc.collect()
            gc.freeze()  # what an application may do once started (docs/benchmarks.md)
        Path(cfg["ready"] + ".tmp").write_text(f"{time.time()}")
        Path(cfg["ready"] + ".tmp").rename(cfg["ready"])  # seen whole or not at all
        await stop.wait()


def _schedules(spec: dict[str, Any]) -> list[tuple[str, str]]:
    if "at" in spec:  # one 6-field cron per schedule naming the burst's second of the day
        at = datetime.fromtimestamp(spec["at"], UTC)
        cron = f"{at.second} {at.minute} {at.hour} * * *"
        return [(f"burst-{i:05d}", cron) for i in range(spec["count"])]
    return [(f"{spec['prefix']}-{i:02d}", "* * * * * *") for i in range(spec["count"])]


# --------------------------------------------------------------------------- the fleet


@dataclass
class Replica:
    index: int
    proc: subprocess.Popen[bytes]
    ready: Path
    ledger: Path
    log: Path
    killed_at: float | None = None

    def is_ready(self) -> bool:
        return self.ready.exists()


@dataclass
class Run:
    replica: int
    start: float
    ended: bool = False


@dataclass
class Fleet:
    dsn: str
    work: Path
    pool: int
    listen: bool
    spec: dict[str, Any]
    work_ms: int = 0
    gc_freeze: bool = False
    replicas: list[Replica] = field(default_factory=list)

    def start(self) -> Replica:
        index = len(self.replicas)
        self.work.mkdir(exist_ok=True)
        paths = [self.work / f"{kind}.{index}" for kind in ("ready", "ledger", "log")]
        cfg = {
            "index": index, "pool": self.pool, "listen": self.listen, "spec": self.spec,
            "work_ms": self.work_ms, "ready": str(paths[0]), "ledger": str(paths[1]),
            "gc_freeze": self.gc_freeze,
        }  # fmt: skip
        with paths[2].open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, __file__, "--replica", json.dumps(cfg)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                env={**os.environ, _DSN_ENV: self.dsn},
            )  # fmt: skip
        replica = Replica(index, proc, paths[0], paths[1], paths[2])
        self.replicas.append(replica)
        return replica

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.killed_at is None and r.proc.poll() is None]

    def wait_ready(self, deadline: float) -> bool:
        """Wait until every live replica is up; ``False`` if ``deadline`` passed first."""
        while True:
            for r in self.replicas:
                if r.killed_at is None and r.proc.poll() is not None:
                    tail = r.log.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"replica r{r.index} exited {r.proc.returncode}:\n{tail}")
            if all(r.is_ready() for r in self.live()):
                return True
            if time.time() > deadline:
                return False
            time.sleep(0.2)

    def kill(self, replica: Replica) -> None:
        os.kill(replica.proc.pid, signal.SIGKILL)
        replica.killed_at = time.time()

    def stop(self) -> None:
        for r in self.live():
            r.proc.send_signal(signal.SIGTERM)
        for r in self.replicas:
            try:
                r.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()

    def runs(self) -> dict[Key, list[Run]]:
        """The union of the ledgers: every handler start per (schedule, instant)."""
        out: dict[Key, list[Run]] = defaultdict(list)
        for r in self.replicas:
            if not r.ledger.exists():
                continue
            for line in r.ledger.read_text().splitlines():
                kind, name, instant, at = line.split()
                key = (name, int(instant))
                if kind == "S":
                    out[key].append(Run(r.index, float(at)))
                else:
                    run = next(x for x in out[key] if x.replica == r.index and not x.ended)
                    run.ended = True
        return out


# burst: the window in which each replica's CPU is read, around the instant.
_BURST_CPU_BEFORE_S = 0.05
_BURST_CPU_AFTER_S = 0.5


def _sleep_until(at: float) -> None:
    time.sleep(max(0.0, at - time.time()))


def _lease_rows(dsn: str, names: list[str]) -> dict[Key, dict[str, Any]]:
    """Each tick's lease row as JSON (whatever columns this version's table has)."""
    table = sql.Identifier(DEFAULT_TABLES["lease"])
    query = sql.SQL("SELECT code, run_key, to_jsonb(t) FROM {} t WHERE code = ANY(%s)")
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(query.format(table), (names,)).fetchall()
    out = {}
    for code, run_key, row in rows:
        at = datetime.strptime(run_key, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
        out[(code, int(at.timestamp()))] = row
    return out


def verdict(counts: dict[str, Any]) -> str:
    """``once/ticks once, doubled, missed`` and the abandoned or unrecorded ticks if any."""
    text = f"{counts['once']}/{counts['ticks']} once, {counts['doubled']} doubled, "
    text += f"{counts['missed']} missed"
    for name in ("abandoned", "unrecorded"):
        text += f", {counts[name]} {name}" if counts[name] else ""
    for name, instant, ran, row in counts["missed_ticks"][:3]:
        text += f"\n    missed: {name} at {instant}, started on {ran}, row {json.dumps(row)}"
    return text


def tally(fleet: Fleet, names: list[str], instants: range) -> dict[str, Any]:
    """Classify every (schedule, instant) of the window (see the module docstring)."""
    runs, rows = fleet.runs(), _lease_rows(fleet.dsn, names)
    killed = {r.index: r.killed_at for r in fleet.replicas if r.killed_at is not None}
    kills = list(killed.values())
    counts: Counter[str] = Counter()
    lateness: list[float] = []
    odd: list[list[Any]] = []
    for key in ((n, t) for n in names for t in instants):
        started = runs.get(key, [])
        lost = [x for x in started if x.replica in killed and not x.ended]
        kept = len(started) - len(lost)
        lateness += [(x.start - key[1]) * 1000 for x in started[:1]]
        row = rows.get(key, {})
        status = row.get("status")
        counts["ticks"] += 1
        near_kill = any(key[1] - 2 <= k <= key[1] + 2 for k in kills)
        if kept >= 2:
            counts["doubled"] += 1
        elif status == "SUCCESS" and kept == 1:
            counts["once"] += 1
        elif status != "SUCCESS" and (
            any(x.replica in killed for x in started) or (status == "RUNNING" and near_kill)
        ):
            counts["abandoned"] += 1
        elif status != "SUCCESS":
            counts["missed"] += 1
            keep = ("status", "attempts", "given_back", "released", "data", "modified_at")
            odd.append([*key, [x.replica for x in started], {k: row.get(k) for k in keep}])
        else:
            counts["unrecorded"] += 1  # SUCCESS without a start in any ledger
    result: dict[str, Any] = {**counts, "missed_ticks": odd[:20]}  # for --json
    for name in ("ticks", "once", "doubled", "abandoned", "missed", "unrecorded"):
        result.setdefault(name, 0)
    result["lateness_ms"] = {
        "p50": statistics.median(lateness) if lateness else math.nan,
        "p99": percentile(lateness, 99),
        "max": max(lateness, default=math.nan),
    }
    return result


# --------------------------------------------------------------------------- CPU from /proc


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, CPU time in nanoseconds), or ``None`` for a process that is gone.

    The time is the scheduler's own count (``/proc/PID/schedstat``), exact to the nanosecond:
    ``utime + stime`` of ``/proc/PID/stat`` comes in 10 ms clock ticks, too coarse for the
    backends of a large fleet, each of which runs a few milliseconds in a window.
    """
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
        ran = int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    rest = data[data.rindex(")") + 2 :].split()
    return int(rest[1]), ran


class CpuMeter:
    """CPU of PostgreSQL's processes (by kind) and of the fleet between the first and last scan.

    A process first seen after the first scan started inside the window and counts from 0; one
    that exits between scans loses at most its last 0.5 s.
    """

    def __init__(self, postmaster: int, dbname: str, fleet: dict[int, int]) -> None:
        self.postmaster, self.dbname, self.fleet = postmaster, dbname, fleet  # fleet: pid→index
        self.kinds: dict[int, str] = {}
        self.first: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.scans = 0

    def _kind(self, pid: int, ppid: int) -> str | None:
        if pid in self.fleet:
            return "fleet"
        if pid != self.postmaster and ppid != self.postmaster:
            return None
        if pid not in self.kinds:
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                return None
            if f" {self.dbname} " in f"{title} ":
                self.kinds[pid] = "db"
            elif re.search(r"\(\d+\)|\[local\]", title):
                self.kinds[pid] = "other"  # a client backend of another database
            else:
                self.kinds[pid] = "background"
        return self.kinds[pid]

    def scan(self) -> None:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            stat = _stat(pid)
            if stat is None or self._kind(pid, stat[0]) is None:
                continue
            if self.scans == 0:
                self.first[pid] = stat[1]
            self.last[pid] = stat[1]
        self.scans += 1

    def seconds(self) -> dict[str, float]:
        out: Counter[str] = Counter()
        for pid, ticks in self.last.items():
            out[self.kinds.get(pid, "fleet")] += ticks - self.first.get(pid, 0)
        return {kind: out[kind] / 1e9 for kind in ("db", "background", "fleet")}


def _server(url: str) -> tuple[int, int, int]:
    """(postmaster pid, max_connections, client connections in use)."""
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT pg_backend_pid(), current_setting('max_connections')::int, "
            "(SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')"
        ).fetchone()
        assert row is not None
        stat = _stat(int(row[0]))  # while the backend lives
    assert stat is not None, "the server's processes are not visible in /proc"
    return stat[0], int(row[1]), int(row[2])


def _xacts(url: str, dbname: str) -> int:
    """Transactions committed and rolled back in ``dbname`` (read from another database)."""
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
            (dbname,),
        ).fetchone()
    return int(row[0]) if row else 0


def connections_for(url: str, replicas: int, pool: int, listen: str) -> tuple[int, bool, str]:
    """The pool size and LISTEN setting for ``replicas`` Runtimes, and why (see the docstring)."""
    _, limit, used = _server(url)
    free = limit - used - RESERVE
    per = free // replicas  # a pool of at least 2, the control connection, LISTEN
    on = listen == "on" or (listen == "auto" and per >= 4)
    chosen = pool or max(2, min(10, per - 1 - on))
    why = (
        f"{replicas} replicas x ~{chosen + 1 + on} connections (pool_max_size={chosen}, "
        f"control 1, LISTEN {'on' if on else 'off'}); server: max_connections {limit}, "
        f"{used} in use, {RESERVE} left to others"
    )
    return chosen, on, why


# --------------------------------------------------------------------------- modes


def _room(url: str, replicas: int, pool: int, listen: bool) -> None:
    """Wait until ``replicas`` Runtimes fit in the server's free slots (others come first)."""
    need, waited = replicas * (pool + 1 + listen), time.time()
    while True:
        _, limit, used = _server(url)
        if (free := limit - used - RESERVE) >= need:
            return
        if time.time() - waited > 600:
            raise RuntimeError(f"{need} connections needed, {free} free for 10 minutes")
        print(f"  waiting for {need} free connections ({free} free)", flush=True)
        time.sleep(10)


def _backends(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        ).fetchone()
    return int(row[0]) - 1 if row else 0


def _settled(dsn: str, limit: float) -> tuple[int, float, bool]:
    """Wait (up to ``limit`` seconds) until the scratch database's backends stop growing for
    15 s: each replica's pool opens connections as it first needs them (a replica owns one
    instant in R/3), and a backend's start-up is not what a tick costs once the fleet runs.
    Returns the count, the seconds waited and whether it settled."""
    began = time.monotonic()
    count, since = _backends(dsn), began
    while time.monotonic() - began < limit:
        time.sleep(5)
        now = _backends(dsn)
        if now != count:
            count, since = now, time.monotonic()
        elif time.monotonic() - since >= 15:
            return count, time.monotonic() - began, True
    return count, time.monotonic() - began, False


def _epoch_owners(dsn: str, fleet: Fleet, instant: int) -> list[int]:
    """The fleet's replicas (indexes) in the rendezvous order of ``instant``'s epoch, as each
    replica ranks them (``sdcore.scheduling._owners``): its first owners first."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            f"SELECT replica_id::text, pid FROM {DEFAULT_TABLES['schedules']}_replicas"
        ).fetchall()
    by_pid = {r.proc.pid: r.index for r in fleet.replicas}
    key = str(int(instant // EPOCH_S))
    order = sorted(rows, key=lambda row: (_score(key, row[0]), row[0]), reverse=True)
    return [by_pid[pid] for _, pid in order if pid in by_pid]


def _reset_statements(dsn: str) -> None:
    """Start ``pg_stat_statements``' counts at the window (``--own-server``)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        conn.execute("SELECT pg_stat_statements_reset()")


def _by_backend_kind(conn: psycopg.Connection[Any], meter: CpuMeter, seconds: int) -> None:
    """The window's CPU of the scratch database's backends by what each last ran: ``listen``
    (a LISTEN connection), ``control`` (a control-plane poll or heartbeat), ``other`` (the
    pools' tick, history and lease statements), per second."""
    kinds: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for pid, query in conn.execute(
        "SELECT pid, query FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid()"
    ).fetchall():
        text_ = " ".join(str(query).split())
        kind = (
            "listen"
            if text_.startswith("LISTEN")
            else "control"
            if "A poll's one statement" in text_ or "The heartbeat:" in text_
            else "other"
        )
        kinds[kind] += meter.last.get(pid, 0) - meter.first.get(pid, 0)
        count[kind] += 1
    shown = ", ".join(
        f"{kind} {count[kind]} backends {kinds[kind] / 1e6 / seconds:.2f} ms/s"
        for kind in ("listen", "control", "other")
    )
    print(f"    backends by what they last ran: {shown}", flush=True)


def _top_statements(conn: psycopg.Connection[Any], seconds: int) -> None:
    """With ``--own-server``: the scratch database's statements by calls in the window
    (``pg_stat_statements``); nothing when the extension is absent."""
    try:
        rows = conn.execute(
            r"SELECT calls, total_exec_time, left(regexp_replace(query, '\s+', ' ', 'g'), 90) "
            "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database "
            "WHERE datname = current_database()) ORDER BY calls DESC LIMIT 8"
        ).fetchall()
    except psycopg.Error:
        conn.rollback()
        return
    for calls, ms, query in rows:
        print(f"    {calls:>7} calls, {ms:8.1f} ms executing: {query}", flush=True)


def _fleet_up(fleet: Fleet, count: int, deadline: float) -> bool:
    _room(fleet.dsn, count, fleet.pool, fleet.listen)
    for _ in range(count):
        fleet.start()
    return fleet.wait_ready(deadline)


def steady(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    sizes = sorted(int(x) for x in args.replicas.split(","))
    pool, listen, why = connections_for(
        args.database_url, sizes[-1], args.pool_max_size, args.listen
    )
    spec = {"prefix": "tick", "count": args.steady_schedules}
    print(f"steady: {spec['count']} per-second exclusive crons; {why}", flush=True)
    names = [name for name, _ in _schedules(spec)]
    results = []
    for size in sizes:
        with scratch_database(args.database_url, "fleet_steady") as dsn:
            fleet = Fleet(dsn, work / f"steady{size}", pool, listen, spec)
            try:
                _fleet_up(fleet, size, time.time() + 60 + 5 * size)
                time.sleep(args.warmup)
                settled = _settled(dsn, args.settle)
                t0 = math.ceil(time.time()) + 1
                postmaster = _server(dsn)[0]
                pids = {r.proc.pid: r.index for r in fleet.replicas}
                meter = CpuMeter(postmaster, str(conninfo_to_dict(dsn)["dbname"]), pids)
                xacts: list[int] = []
                if args.own_server:
                    _reset_statements(dsn)
                for step in range(2 * args.seconds + 1):
                    _sleep_until(t0 - 0.5 + step / 2)
                    meter.scan()
                    if step in (0, 2 * args.seconds):
                        xacts.append(_xacts(args.database_url, meter.dbname))
                with psycopg.connect(dsn) as conn:
                    row = conn.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    ).fetchone()
                    _top_statements(conn, args.seconds)
                    _by_backend_kind(conn, meter, args.seconds)
                backends = int(row[0]) - 1 if row else 0
                print(
                    f"    backends: {settled[0]} at the window's start ({settled[1]:.0f} s "
                    f"after the warm-up, {'settled' if settled[2] else 'still growing'}), "
                    f"{backends} at its end",
                    flush=True,
                )
                load = os.getloadavg()[0]
            finally:
                fleet.stop()
            counts = tally(fleet, names, range(t0, t0 + args.seconds))
        cpu = meter.seconds()
        ticks = counts["ticks"]
        per, unit = (ticks, "tick") if ticks else (args.seconds, "s")  # 0 schedules: per second
        result = {
            "replicas": size, "per": unit, "backends": backends, "load_1m": load,
            "pg_db_ms": cpu["db"] * 1000 / per, "pg_background_ms": cpu["background"] * 1000 / per,
            "fleet_ms": cpu["fleet"] * 1000 / per, "pg_xacts": (xacts[1] - xacts[0]) / per,
            **counts,
        }  # fmt: skip
        results.append(result)
        late = counts["lateness_ms"]
        print(
            f"  R={size:<3} PG (scratch db backends: {backends}) {result['pg_db_ms']:.3f} ms/{unit}"
            f" ({result['pg_xacts']:.1f} transactions), PG background "
            f"{result['pg_background_ms']:.3f} ms/{unit}, fleet {result['fleet_ms']:.2f} ms/{unit}"
            f"; {verdict(counts)}; start p50 {late['p50']:.0f} ms, p99 {late['p99']:.0f} ms; "
            f"load {load:.1f}",
            flush=True,
        )
    if len(results) >= 2:
        lo, hi = results[0], results[-1]
        for field_, target, what in (
            ("pg_db_ms", 1.5, "PostgreSQL CPU (scratch db backends)"),
            ("pg_background_ms", None, "PostgreSQL background CPU"),
            ("fleet_ms", 2.0, "fleet CPU"),
        ):
            if not lo[field_]:
                print(f"  {what}: none measured at R={lo['replicas']}")
                continue
            ratio = hi[field_] / lo[field_]
            met = "met" if ratio <= (target or 0) else "MISSED"
            goal = f"; target <= {target}x: {met}" if target and unit == "tick" else ""
            print(f"  {hi['replicas']}/{lo['replicas']}: {what} per {unit} {ratio:.2f}x{goal}")
    return results


def burst(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    count, results = args.burst_schedules, []
    for size in sorted(int(x) for x in args.burst_replicas.split(",")):
        pool, listen, why = connections_for(
            args.database_url, size, args.pool_max_size, args.listen
        )
        _room(args.database_url, size, pool, listen)
        lead = args.burst_lead or 15 + size * count / 2000
        at = float(int(time.time() + lead) + 1)
        spec = {"at": at, "count": count}
        print(
            f"burst: {count} exclusive ticks at one instant ({lead:.0f} s ahead); {why}", flush=True
        )
        with scratch_database(args.database_url, "fleet_burst") as dsn:
            fleet = Fleet(dsn, work / f"burst{size}", pool, listen, spec, gc_freeze=args.gc_freeze)
            try:
                in_time = _fleet_up(fleet, size, at - 1)
                if not in_time:
                    fleet.wait_ready(at + 120)
                margin = at - max(float(r.ready.read_text()) for r in fleet.replicas)
                _sleep_until(at - _BURST_CPU_BEFORE_S)
                before = {r.index: _stat(r.proc.pid) for r in fleet.replicas}
                _sleep_until(at + _BURST_CPU_AFTER_S)
                after = {r.index: _stat(r.proc.pid) for r in fleet.replicas}
                order = _epoch_owners(dsn, fleet, int(at))
                while (
                    time.time() < at + 120
                    and sum(1 for runs in fleet.runs().values() for x in runs if x.ended) < count
                ):
                    time.sleep(1)
                time.sleep(2)
            finally:
                fleet.stop()
            names = [name for name, _ in _schedules(spec)]
            counts = tally(fleet, names, range(int(at), int(at) + 1))
        runs = [x for xs in fleet.runs().values() for x in xs]
        starts = sorted(x.start - at for x in runs)
        # The CPU the replicas other than the one that started most ticks (the instant's first
        # owner) took from the instant's first half second (two vCPUs shared with the server):
        # the later owners' and the rest's.
        owner = Counter(x.replica for x in runs).most_common(1)[0][0] if runs else -1
        spent = {
            i: (a[1] - b[1]) / 1e6
            for i, b in before.items()
            if b is not None and (a := after.get(i)) is not None
        }
        others = sorted((ms for i, ms in spent.items() if i != owner), reverse=True)
        later = [spent.get(i, math.nan) for i in order[1:OWNERS]]
        rest = sorted((ms for i, ms in spent.items() if i not in order[:OWNERS]), reverse=True)
        result = {
            "replicas": size, "schedules": count, "ready_before_s": margin, "in_time": in_time,
            **counts, "first_ms": starts[0] * 1000 if starts else math.nan,
            "p50_ms": statistics.median(starts) * 1000 if starts else math.nan,
            "last_ms": starts[-1] * 1000 if starts else math.nan,
            "owner_cpu_ms": spent.get(owner, math.nan), "others_cpu_ms": sum(others),
            "others_cpu_max_ms": others[0] if others else 0.0,
            "later_owners_cpu_ms": later, "rest_cpu_ms": sum(rest),
            "rest_cpu_max_ms": rest[0] if rest else 0.0,
        }  # fmt: skip
        results.append(result)
        met = "met" if result["last_ms"] <= 1000 else "MISSED"
        print(
            f"  R={size:<3} handler start after the instant: first {result['first_ms']:.0f} ms, "
            f"p50 {result['p50_ms']:.0f} ms, last {result['last_ms']:.0f} ms (target <= 1000 "
            f"ms: {met}); {verdict(counts)}; last replica ready {margin:.1f} s before the instant"
            f"{'' if in_time else ' (LATE: not all replicas were up in time)'}",
            flush=True,
        )
        print(
            f"        CPU from {_BURST_CPU_BEFORE_S * 1000:.0f} ms before the instant to "
            f"{_BURST_CPU_AFTER_S * 1000:.0f} ms after: the first owner "
            f"{result['owner_cpu_ms']:.0f} ms; the {len(others)} others "
            f"{result['others_cpu_ms']:.0f} ms together, at most "
            f"{result['others_cpu_max_ms']:.0f} ms each (the later owners "
            f"{', '.join(f'{ms:.0f}' for ms in later) or '-'} ms; the {len(rest)} others "
            f"{result['rest_cpu_ms']:.0f} ms, at most {result['rest_cpu_max_ms']:.0f} ms)"
            f"{'' if order[:1] == [owner] else ' (the first owner by the rows was another)'}",
            flush=True,
        )
    return results


def kill(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    spec = {"prefix": "k", "count": args.kill_schedules}
    names = [name for name, _ in _schedules(spec)]
    size = args.kill_replicas
    pool, listen, why = connections_for(args.database_url, size, args.pool_max_size, args.listen)
    print(
        f"kill: {size} replicas, {len(names)} per-second crons, handlers {args.work_ms} ms; {why}"
    )
    results = []
    for victims in (1, 2):
        with scratch_database(args.database_url, "fleet_kill") as dsn:
            fleet = Fleet(dsn, work / f"kill{victims}", pool, listen, spec, args.work_ms)
            try:
                _fleet_up(fleet, size, time.time() + 60 + 5 * size)
                time.sleep(args.warmup + 4)
                killed_at = math.floor(time.time()) + 1.5
                # Four instants before the kill and the observed ones after it in one epoch.
                epoch_s = int(EPOCH_S)
                if (int(killed_at) - 4) // epoch_s != (int(killed_at) + 10) // epoch_s:
                    killed_at = (int(killed_at) + 10) // epoch_s * epoch_s + 5.5
                first = int(killed_at) + 1  # the first instant after the kill
                _sleep_until(killed_at - 0.3)
                ranked = _epoch_owners(dsn, fleet, first)
                chosen = [fleet.replicas[i] for i in ranked[:victims]]
                _sleep_until(killed_at)
                for r in chosen:
                    fleet.kill(r)
                time.sleep(args.kill_observe)
            finally:
                fleet.stop()
            counts = tally(fleet, names, range(first - 4, first + args.kill_observe - 2))
        runs, gone = fleet.runs(), {r.index for r in chosen}
        labels = ", ".join(f"r{r.index}" for r in chosen)
        print(f"  kill -9 {labels} at {killed_at:.1f} (instant +0.5 s); schedules they ran:")
        delays = []
        for name in names:
            before = range(first - 4, first)
            if not any(x.replica in gone for t in before for x in runs.get((name, t), [])):
                continue
            seq = " ".join(
                ("| " if t == first else "")
                + ("+".join(f"r{x.replica}" for x in runs.get((name, t), [])) or "--")
                for t in range(first - 4, first + 5)
            )
            after = [t for t in range(first, first + args.kill_observe) if runs.get((name, t))]
            if not after:
                print(f"    {name}: no tick started after the kill; ran by: {seq}")
                continue
            x = runs[(name, after[0])][0]
            delays.append((x.start - first) * 1000)
            print(
                f"    {name}: next tick started by r{x.replica} {delays[-1]:.0f} ms after the "
                f"first instant past the kill ({after[0] - first} skipped); ran by: {seq}"
            )
        late = counts["lateness_ms"]
        print(
            f"  {victims} killed: worst next-tick delay {max(delays, default=math.nan):.0f} ms "
            f"(all ticks: start p50 {late['p50']:.0f} ms, max {late['max']:.0f} ms); "
            f"{verdict(counts)}",
            flush=True,
        )
        results.append({"victims": victims, "delays_ms": delays, **counts})
    return results


def churn(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    spec = {"prefix": "c", "count": 5}
    names = [name for name, _ in _schedules(spec)]
    pool, listen, why = connections_for(args.database_url, 15, args.pool_max_size, args.listen)
    print(f"churn: 10 replicas, 5 per-second crons, a start or a kill -9 every 2 s; {why}")
    rng = random.Random(args.seed)
    actions: Counter[str] = Counter()
    with scratch_database(args.database_url, "fleet_churn") as dsn:
        fleet = Fleet(dsn, work / "churn", pool, listen, spec, args.work_ms)
        try:
            _room(dsn, 15, pool, listen)
            _fleet_up(fleet, 10, time.time() + 120)
            time.sleep(args.warmup)
            begin = math.ceil(time.time())
            for step in range(args.churn_seconds // 2):
                _sleep_until(begin + 2 * step + rng.random())  # any phase of the second
                live = [r for r in fleet.live() if r.is_ready()]
                if len(fleet.live()) <= 5 or (len(fleet.live()) < 15 and rng.random() < 0.5):
                    fleet.start()
                    actions["started"] += 1
                elif live:
                    fleet.kill(rng.choice(live))
                    actions["killed"] += 1
            end = begin + 2 * (args.churn_seconds // 2)
            _sleep_until(end + 3)
            alive = len(fleet.live())
        finally:
            fleet.stop()
        counts = tally(fleet, names, range(begin, end))
    late = counts["lateness_ms"]
    print(
        f"  {actions['started']} started, {actions['killed']} killed ({alive} live at the end); "
        f"{verdict(counts)}; start p50 "
        f"{late['p50']:.0f} ms, p99 {late['p99']:.0f} ms, max {late['max']:.0f} ms",
        flush=True,
    )
    return [{"actions": dict(actions), **counts}]


def main(argv: list[str] | None = None) -> int:
    parser = base_parser((__doc__ or "").split("\n\n")[0])
    parser.add_argument("--only", choices=("steady", "burst", "kill", "churn"), action="append")
    parser.add_argument("--replicas", default="3,24", help="steady: fleet sizes (default 3,24)")
    parser.add_argument("--seconds", type=int, default=30, help="steady: window (default 30)")
    parser.add_argument("--steady-schedules", type=int, default=20, help="0: an idle fleet")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds once all are up")
    parser.add_argument(
        "--settle",
        type=float,
        default=180.0,
        help="steady: then wait up to this long for the backends to stop growing (0: not)",
    )
    parser.add_argument("--burst-replicas", default="3,24")
    parser.add_argument("--burst-schedules", type=int, default=10_000)
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="burst: each replica calls gc.collect() and gc.freeze() once started",
    )
    parser.add_argument("--burst-lead", type=float, default=0.0, help="0: 15 s + R*N/2000 s")
    parser.add_argument("--kill-replicas", type=int, default=5)
    parser.add_argument("--kill-schedules", type=int, default=8)
    parser.add_argument("--kill-observe", type=int, default=20, help="seconds after a kill")
    parser.add_argument("--churn-seconds", type=int, default=60)
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--work-ms", type=int, default=100, help="kill/churn handler duration")
    parser.add_argument("--pool-max-size", type=int, default=0, help="0: auto (see above)")
    parser.add_argument("--listen", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--json", help="also write the raw results to this file")
    parser.add_argument("--keep", action="store_true", help="keep the ledgers and replica logs")
    parser.add_argument(
        "--own-server",
        action="store_true",
        help="start a PostgreSQL of its own (max_connections 400): every fleet runs the "
        "Runtime's defaults (pool 10, LISTEN on)",
    )
    parser.add_argument("--replica", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.replica:
        asyncio.run(_replica(json.loads(args.replica)))
        return 0
    with contextlib.ExitStack() as stack:
        if args.own_server:
            from tests._servers import own_postgres

            server = stack.enter_context(own_postgres(OWN_SERVER))
            args.database_url = server.dsn
            print(f"own server on port {server.port}: {OWN_SERVER}", flush=True)
        with psycopg.connect(args.database_url) as conn:
            print(machine(conn), flush=True)
        modes = {"steady": steady, "burst": burst, "kill": kill, "churn": churn}
        results: dict[str, Any] = {}
        tmp = tempfile.mkdtemp(prefix="sdcore-fleet-")
        for name, run in modes.items():
            if args.only is None or name in args.only:
                results[name] = run(args, Path(tmp))
    if args.keep:
        print(f"ledgers and replica logs kept in {tmp}")
    else:
        shutil.rmtree(tmp)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
