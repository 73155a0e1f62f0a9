"""Acceptance tests with real OS processes (RELIABILITY.md §5.1 LC-01..04, LC-12, §5.2 DB-13,
§5.3 TM-01/TM-02, and the kill -9 takeover).

Every contender is a separate ``python -m tests.acceptance._worker`` process with its own
``JobSchedulerService`` (pool min_size=1, max_size=1). Contenders line up on a barrier made of
stdin: each prepares its statement, says ``ready`` and blocks until the test writes ``go`` to all
of them. A module-wide fleet of up to 64 processes is spawned once and pointed at each test's
fresh database.

Timing is never asserted as speed: the no-premature-takeover checks compare timestamps written
by the database clock (the new ``modified_at`` minus the previous owner's last ``modified_at``
must be at least the lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from sdcore.job_scheduler import (
    JobLease,
    JobSchedulerService,
    idempotency_key,
    lock_key,
)
from tests.conftest import ADMIN_DSN

# The 64-process storms hold most of max_connections: no other test opens one meanwhile.
# Its 64-process storms take most of the server's connections: nothing runs beside them.
pytestmark = [pytest.mark.slow, pytest.mark.alone]

Json = dict[str, Any]

REPO_ROOT = Path(__file__).resolve().parents[2]
FLEET_MAX = 64
CONNECTION_MARGIN = 20  # the test's own connections, the fixtures', psql sessions of a human


def _report(line: str) -> None:
    """The RELIABILITY.md metric line (shown with ``pytest -s``)."""
    print(line)  # noqa: T201


class WorkerError(AssertionError):
    """A worker process did not answer as the protocol says."""


class Proc:
    """One worker process speaking JSON lines."""

    def __init__(
        self,
        name: str,
        *,
        prefix: Sequence[str] = (),
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT), str(REPO_ROOT / "src"), env.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep)
        env.update(extra_env or {})
        self.stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [*prefix, sys.executable, "-m", "tests.acceptance._worker"],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            bufsize=1,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.thread = threading.Thread(target=self._pump, name=f"pump-{name}", daemon=True)
        self.thread.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _pump(self) -> None:
        stdout = self.popen.stdout
        assert stdout is not None
        for line in stdout:
            self.lines.put(line)
        self.lines.put(None)

    def stderr_tail(self, size: int = 3000) -> str:
        try:
            self.stderr.seek(0)
            return self.stderr.read().decode("utf-8", "replace")[-size:]
        except (OSError, ValueError):
            return "<stderr unavailable>"

    def send(self, obj: Json) -> None:
        stdin = self.popen.stdin
        assert stdin is not None
        try:
            stdin.write(json.dumps(obj) + "\n")
            stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerError(
                f"{self.name} is gone (rc={self.popen.poll()}): {exc}\n{self.stderr_tail()}"
            ) from exc

    def recv(self, timeout: float = 60) -> Json:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise WorkerError(
                f"{self.name}: no answer within {timeout} s\n{self.stderr_tail()}"
            ) from None
        if line is None:
            self.lines.put(None)
            raise WorkerError(f"{self.name} exited (rc={self.popen.poll()})\n{self.stderr_tail()}")
        reply: Json = json.loads(line)
        return reply

    def call(self, obj: Json, timeout: float = 60) -> Json:
        self.send(obj)
        return self.recv(timeout)

    def kill9(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)

    def stop(self) -> None:
        """Ask the process to exit; kill it if it does not; reap it and close every pipe."""
        if self.popen.poll() is None:
            with contextlib.suppress(WorkerError):
                self.send({"op": "exit"})
        if self.popen.stdin is not None:
            with contextlib.suppress(OSError):
                self.popen.stdin.close()
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=10)
        self.thread.join(timeout=10)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        self.stderr.close()


def _ok(reply: Json, who: str) -> Json:
    if "error" in reply:
        raise WorkerError(f"{who}: {reply['error']}: {reply.get('message')}")
    return reply


class Fleet:
    """Up to 64 long-lived workers."""

    def __init__(self, size: int) -> None:
        self.procs: list[Proc] = []
        self.broken = False
        try:
            for i in range(size):
                self.procs.append(Proc(f"w{i}"))
        except BaseException:
            self.stop()
            raise

    def __len__(self) -> int:
        return len(self.procs)

    def each(self, cmd: Json, procs: Sequence[Proc] | None = None, timeout: float = 60) -> None:
        """Send ``cmd`` to every worker and require a non-error answer from each."""
        targets = self.procs if procs is None else procs
        try:
            for p in targets:
                p.send(cmd)
            for p in targets:
                _ok(p.recv(timeout), p.name)
        except BaseException:
            self.broken = True
            raise

    def race(self, cmd: Json | Sequence[Json], procs: Sequence[Proc] | None = None) -> list[Json]:
        """Send a barrier command to every worker, release them together, collect answers.

        ``cmd`` is one command for all, or a sequence of one command per worker.
        """
        targets = list(self.procs if procs is None else procs)
        cmds = [cmd] * len(targets) if isinstance(cmd, dict) else list(cmd)
        replies: list[Json | None] = [None] * len(targets)
        ready: list[int] = []
        try:
            for p, one in zip(targets, cmds, strict=True):
                p.send(one)
            try:
                for i, p in enumerate(targets):
                    first = p.recv(60)
                    if first.get("ready"):
                        ready.append(i)
                    else:
                        replies[i] = first  # failed before the barrier
            finally:
                for i in ready:  # the barrier: every prepared contender is released at once
                    targets[i].send({"op": "go"})
            for i in ready:
                replies[i] = targets[i].recv(60)
        except BaseException:
            self.broken = True
            raise
        return [r if r is not None else {"error": "NoReply"} for r in replies]

    def stop(self) -> None:
        for p in self.procs:  # ask all first, then reap: they exit in parallel
            if p.popen.poll() is None:
                with contextlib.suppress(WorkerError):
                    p.send({"op": "exit"})
        for p in self.procs:
            p.stop()


class FleetHolder:
    """Spawns the fleet lazily (once per module) and again if a test broke it."""

    def __init__(self, size: int | None = None) -> None:
        self.fleet: Fleet | None = None
        self.size = size

    def get(self) -> Fleet:
        if self.fleet is not None and self.fleet.broken:
            self.fleet.stop()
            self.fleet = None
        if self.fleet is None:
            self.fleet = Fleet(min(self.size or FLEET_MAX, _fleet_size()))
        return self.fleet

    def stop(self) -> None:
        if self.fleet is not None:
            self.fleet.stop()
            self.fleet = None


def _fleet_size() -> int:
    """64, or fewer if the server cannot take 64 more connections (`SHOW max_connections`)."""
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        row = conn.execute(
            "SELECT current_setting('max_connections')::int,"
            " (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')"
        ).fetchone()
    assert row is not None
    max_connections, used = int(row[0]), int(row[1])
    size = min(FLEET_MAX, max_connections - used - CONNECTION_MARGIN)
    if size < 16:
        pytest.fail(
            f"max_connections={max_connections} with {used} in use leaves room for only {size} "
            "contender processes (need at least 16)"
        )
    if size < FLEET_MAX:
        _report(f"fleet reduced to {size} processes (max_connections={max_connections})")
    return size


@pytest.fixture(scope="module")
def fleet_holder() -> Iterator[FleetHolder]:
    holder = FleetHolder()
    try:
        yield holder
    finally:
        holder.stop()


@pytest.fixture
def fleet(fleet_holder: FleetHolder, pg_dsn: str) -> Iterator[Fleet]:
    """The fleet, disconnected from the test database afterwards (before it is dropped)."""
    f = fleet_holder.get()
    try:
        yield f
    finally:
        if not f.broken:
            try:
                f.each({"op": "close"}, timeout=30)
            except WorkerError:
                f.broken = True


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Extra single workers of one test; always reaped."""
    started: list[Proc] = []
    try:
        yield started
    finally:
        for p in started:
            p.stop()


# --------------------------------------------------------------------------- helpers


def _dbname(dsn: str) -> str:
    return str(conninfo_to_dict(dsn)["dbname"])


def _sql(dsn: str, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(query.encode(), params)
        return cur.fetchall() if cur.description else []


async def _ensure_schema_async(dsn: str) -> None:
    async with JobSchedulerService.connect(dsn) as svc:
        await svc.ensure_schema()


def _ensure_schema(dsn: str) -> None:
    asyncio.run(_ensure_schema_async(dsn))


def _row(dsn: str, code: str, run_key: str) -> dict[str, Any]:
    rows = _sql(
        dsn,
        "SELECT id::text, owner_token::text, fencing_token, status, modified_at, created_at,"
        " idempotency_key, data, clock_timestamp() FROM job_scheduler"
        " WHERE code = %s AND run_key = %s",
        (code, run_key),
    )
    assert len(rows) == 1, f"expected one row for {code}/{run_key}, found {len(rows)}"
    r = rows[0]
    keys = (
        "id",
        "owner_token",
        "fencing_token",
        "status",
        "modified_at",
        "created_at",
        "idempotency_key",
        "data",
        "now",
    )
    return dict(zip(keys, r, strict=True))


async def _seed_async(dsn: str, code: str, run_keys: Sequence[str], state: str) -> dict[str, Json]:
    """Create one row per run key in ``state``: FAIL, STALE (old RUNNING) or ANCIENT_SUCCESS."""
    seeded: dict[str, Json] = {}
    async with JobSchedulerService.connect(dsn) as svc:
        for run_key in run_keys:
            got = await svc.acquire({"code": code, "run_key": run_key, "lease_ms": 60_000})
            assert got.acquired
            if state == "FAIL":
                assert await svc.fail(got.lease, {"seeded": True})
            elif state == "ANCIENT_SUCCESS":
                assert await svc.complete(got.lease, {"seeded": True})
            seeded[run_key] = {
                "id": got.id,
                "owner_token": got.owner_token,
                "idempotency_key": got.idempotency_key,
                "fencing_token": got.fencing_token,
            }
    if state == "STALE":
        _sql(
            dsn,
            "UPDATE job_scheduler SET modified_at = clock_timestamp() - interval '1 hour'"
            " WHERE code = %s",
            (code,),
        )
    elif state == "ANCIENT_SUCCESS":
        _sql(
            dsn,
            "UPDATE job_scheduler SET modified_at = '2000-01-01T00:00:00Z',"
            " created_at = '2000-01-01T00:00:00Z' WHERE code = %s",
            (code,),
        )
    return seeded


def _seed(dsn: str, code: str, run_keys: Sequence[str], state: str) -> dict[str, Json]:
    return asyncio.run(_seed_async(dsn, code, run_keys, state))


async def _old_lease_refused_async(dsn: str, lease: JobLease) -> list[bool]:
    async with JobSchedulerService.connect(dsn) as svc:
        return [
            await svc.heartbeat(lease),
            await svc.complete(lease, {"zombie": True}),
            await svc.fail(lease, {"zombie": True}),
            await svc.release(lease),
        ]


def _old_lease_refused(dsn: str, lease: JobLease) -> list[bool]:
    """heartbeat, complete, fail, release with a fenced-out token (all must be False)."""
    return asyncio.run(_old_lease_refused_async(dsn, lease))


def _p99(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


class StormStats:
    """Winners per round, exceptions, latencies: the metric line."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.rounds = 0
        self.runs = 0
        self.winners: Counter[int] = Counter()
        self.exceptions: Counter[str] = Counter()
        self.latencies: list[float] = []

    def add(self, replies: list[Json]) -> list[Json]:
        self.rounds += 1
        self.runs += len(replies)
        won = [r for r in replies if r.get("acquired") is True]
        self.winners[len(won)] += 1
        for r in replies:
            if "error" in r:
                self.exceptions[str(r["error"])] += 1
            if "ms" in r:
                self.latencies.append(float(r["ms"]))
        return won

    def report(self) -> None:
        double = sum(count for winners, count in self.winners.items() if winners > 1)
        _report(
            f"{self.name}: runs={self.runs} rounds={self.rounds} "
            f"winners/round={dict(sorted(self.winners.items()))} double_exec={double} "
            f"exceptions={dict(self.exceptions)} p99_acquire_ms={_p99(self.latencies):.1f}"
        )


def _storm(
    fleet: Fleet, stats: StormStats, code: str, run_key: str, lease_ms: int
) -> tuple[list[Json], list[Json]]:
    """One round: every worker races for the same key. Returns (all replies, winners)."""
    replies = fleet.race(
        {
            "op": "acquire",
            "barrier": True,
            "options": {"code": code, "run_key": run_key, "lease_ms": lease_ms},
        }
    )
    return replies, stats.add(replies)


def _assert_round(replies: list[Json], winners: list[Json], expected: int, what: str) -> None:
    errors = [r for r in replies if "error" in r]
    assert not errors, f"{what}: contenders raised instead of returning False: {errors[:3]}"
    assert len(winners) == expected, f"{what}: {len(winners)} winners, expected {expected}"
    losers = [r for r in replies if r.get("acquired") is False]
    assert len(losers) == len(replies) - expected, f"{what}: malformed replies {replies[:3]}"


# --------------------------------------------------------------------------- LC-01, LC-04


def _fresh_key_storm(fleet: Fleet, dsn: str, name: str, rounds: int) -> StormStats:
    stats = StormStats(name)
    fleet.each({"op": "open", "dsn": dsn, "app": "lease-acq"})
    per_round: dict[str, Json] = {}
    try:
        for r in range(rounds):
            run_key = f"{name}-round-{r}"
            replies, winners = _storm(fleet, stats, "storm", run_key, 60_000)
            _assert_round(replies, winners, 1, f"{name} round {r}")
            per_round[run_key] = winners[0]
    finally:
        stats.report()
    rows = _sql(
        dsn,
        "SELECT run_key, count(*), min(owner_token::text), min(fencing_token), min(status)"
        " FROM job_scheduler WHERE code = 'storm' GROUP BY run_key",
    )
    assert len(rows) == rounds, f"{len(rows)} rows for {rounds} keys"
    # Fencing tokens come from one sequence per table: every key's first token is its own.
    assert len({row[3] for row in rows}) == rounds, "two keys were given one fencing token"
    for run_key, count, owner, fencing, status in rows:
        assert count == 1
        assert status == "RUNNING"
        assert fencing >= 1
        assert owner == per_round[run_key]["owner_token"], "the winner's token is not in the row"
    return stats


def test_lc01_storm_on_fresh_keys_one_winner_per_round(fleet: Fleet, pg_dsn: str) -> None:
    """LC-01: N processes race for one fresh key per round, 20 rounds."""
    _ensure_schema(pg_dsn)
    _fresh_key_storm(fleet, pg_dsn, "LC-01", rounds=20)


@pytest.mark.parametrize("isolation", ["serializable", "repeatable read"])
def test_lc04_storm_under_strict_isolation_default(
    fleet: Fleet, pg_dsn: str, isolation: str
) -> None:
    """LC-04: the database default is SERIALIZABLE / REPEATABLE READ; losers still get False."""
    _ensure_schema(pg_dsn)
    _sql(
        ADMIN_DSN,
        f"ALTER DATABASE \"{_dbname(pg_dsn)}\" SET default_transaction_isolation = '{isolation}'",
    )
    # The setting really applies to new sessions of this database.
    shown = _sql(pg_dsn, "SHOW default_transaction_isolation")[0][0]
    assert shown == isolation
    _fresh_key_storm(fleet, pg_dsn, f"LC-04-{isolation.replace(' ', '-')}", rounds=20)

    # Reclaims under the strict default (where serialization failures are likeliest).
    stats = StormStats(f"LC-04-{isolation.replace(' ', '-')}-reclaim")
    keys = [f"reclaim-{i}" for i in range(5)]
    seeded = _seed(pg_dsn, "storm-fail", keys, "FAIL")
    try:
        for run_key in keys:
            replies, winners = _storm(fleet, stats, "storm-fail", run_key, 60_000)
            _assert_round(replies, winners, 1, f"reclaim {run_key}")
            assert winners[0]["fencing_token"] > seeded[run_key]["fencing_token"]
            assert winners[0]["owner_token"] != seeded[run_key]["owner_token"]
    finally:
        stats.report()


# --------------------------------------------------------------------------- LC-02, LC-03


@pytest.mark.parametrize("state", ["FAIL", "STALE"])
def test_lc02_storm_on_reclaimable_row_one_reclaimer(fleet: Fleet, pg_dsn: str, state: str) -> None:
    """LC-02: a FAIL row / a RUNNING row silent for an hour: exactly one reclaimer per round."""
    _ensure_schema(pg_dsn)
    keys = [f"{state.lower()}-{i}" for i in range(5)]
    seeded = _seed(pg_dsn, "lc02", keys, state)
    fleet.each({"op": "open", "dsn": pg_dsn, "app": "lease-acq"})
    stats = StormStats(f"LC-02-{state}")
    try:
        for run_key in keys:
            replies, winners = _storm(fleet, stats, "lc02", run_key, 60_000)
            _assert_round(replies, winners, 1, f"LC-02 {state} {run_key}")
            win = winners[0]
            old = seeded[run_key]
            assert win["fencing_token"] > old["fencing_token"]
            assert win["owner_token"] != old["owner_token"], "the owner token was not rotated"
            assert win["id"] == old["id"]
            assert win["idempotency_key"] == old["idempotency_key"]
            row = _row(pg_dsn, "lc02", run_key)
            assert row["status"] == "RUNNING"
            assert row["owner_token"] == win["owner_token"]
            assert row["fencing_token"] == win["fencing_token"]
            assert row["data"] is None, "taking over must clear data"
    finally:
        stats.report()
    # G1: the seeded owners are fenced out after the takeover.
    for run_key in keys[:2]:
        old = seeded[run_key]
        lease = JobLease(id=old["id"], owner_token=old["owner_token"])
        assert _old_lease_refused(pg_dsn, lease) == [False, False, False, False]
        assert _row(pg_dsn, "lc02", run_key)["status"] == "RUNNING"


def test_lc03_storm_on_success_row_zero_winners(fleet: Fleet, pg_dsn: str) -> None:
    """LC-03: a SUCCESS row with an ancient modified_at and the shortest lease: never taken."""
    _ensure_schema(pg_dsn)
    keys = [f"done-{i}" for i in range(3)]
    seeded = _seed(pg_dsn, "lc03", keys, "ANCIENT_SUCCESS")
    fleet.each({"op": "open", "dsn": pg_dsn, "app": "lease-acq"})
    stats = StormStats("LC-03")
    try:
        for run_key in keys:
            replies, winners = _storm(fleet, stats, "lc03", run_key, 3)
            _assert_round(replies, winners, 0, f"LC-03 {run_key}")
            row = _row(pg_dsn, "lc03", run_key)
            assert row["status"] == "SUCCESS"
            assert row["owner_token"] == seeded[run_key]["owner_token"]
            assert row["fencing_token"] == seeded[run_key]["fencing_token"]
    finally:
        stats.report()


# --------------------------------------------------------------------------- DB-13


def test_db13_concurrent_ensure_schema_on_empty_database(fleet: Fleet, pg_dsn: str) -> None:
    """DB-13: 16 processes call ensure_schema() at once; all succeed, one table per schema."""
    procs = fleet.procs[:16]
    schemas: list[str | None] = [None, "bootstrap_a", "bootstrap_b", "bootstrap_c", "bootstrap_d"]
    failures: Counter[str] = Counter()
    for schema in schemas:
        replies = fleet.race(
            {
                "op": "ensure_schema",
                "dsn": pg_dsn,
                "app": "lease-ddl",
                "schema": schema,
                "barrier": True,
            },
            procs,
        )
        for r in replies:
            if "error" in r:
                failures[f"{r['error']}: {str(r.get('message'))[:120]}"] += 1
    _report(
        f"DB-13: runs={len(schemas) * len(procs)} startup_failures={sum(failures.values())} "
        f"exceptions={dict(failures)}"
    )
    assert not failures, f"concurrent ensure_schema failed: {dict(failures)}"
    tables = _sql(
        pg_dsn,
        "SELECT n.nspname, count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE c.relname = 'job_scheduler' AND c.relkind = 'r' GROUP BY n.nspname",
    )
    assert dict(tables) == {s or "public": 1 for s in schemas}
    # The bootstrapped table works for every process.
    fleet.each({"op": "open", "dsn": pg_dsn, "app": "lease-acq"}, procs)
    stats = StormStats("DB-13-after")
    replies = fleet.race(
        {
            "op": "acquire",
            "barrier": True,
            "options": {"code": "after-bootstrap", "run_key": "k", "lease_ms": 60_000},
        },
        procs,
    )
    _assert_round(replies, stats.add(replies), 1, "acquire after bootstrap")


# --------------------------------------------------------------------------- LC-12

KEY_CASES: list[list[str | None]] = [
    ["report", "2026-07-20T03:00:00Z", "SCHEDULE"],
    ["  report  ", "2026-07-20T03:00:00Z", "SCHEDULE"],
    ["a:b", "c", "SCHEDULE"],
    ["a", "b:c", "SCHEDULE"],
    ["bootstrap", None, "INITIAL"],
    ["nhắc-việc", "ngày 20/07 — 03:00 Asia/Ho_Chi_Minh", "SCHEDULE"],
    ["emoji-🚀", "𝄞" * 100, "SCHEDULE"],
    ["x" * 64, "y" * 1024, "SCHEDULE"],
]

KEY_ENVS = [
    {"PYTHONHASHSEED": "0", "TZ": "UTC"},
    {"PYTHONHASHSEED": "1", "TZ": "Asia/Tokyo"},
    {"PYTHONHASHSEED": "12345", "TZ": "America/New_York"},
    {"PYTHONHASHSEED": "4294967295", "TZ": "Pacific/Kiritimati"},
    {"PYTHONHASHSEED": "random", "TZ": "Etc/GMT+12"},
]


def test_lc12_keys_identical_across_hash_seeds_and_time_zones(procs: list[Proc]) -> None:
    """LC-12: lock and idempotency keys are the same bytes in every process."""
    for i, env in enumerate(KEY_ENVS):
        procs.append(Proc(f"keys-{i}", extra_env=env))
    answers = [_ok(p.call({"op": "keys", "cases": KEY_CASES}), p.name) for p in procs]

    # The environments really differ (otherwise the test would prove nothing).
    assert len({a["hash_probe"] for a in answers}) >= 4, "PYTHONHASHSEED had no effect"
    assert len({a["utcoffset"] for a in answers}) == len(KEY_ENVS), "TZ had no effect"

    local = [
        [lock_key(c, r, t), idempotency_key(c, r, t)]  # type: ignore[arg-type]
        for c, r, t in KEY_CASES
    ]
    for answer in answers:
        assert [k[:2] for k in answer["keys"]] == local
    distinct = {json.dumps(a["keys"]) for a in answers}
    _report(f"LC-12: processes={len(answers)} distinct_key_sets={len(distinct)}")
    assert len(distinct) == 1
    # Sanity of the cases themselves: concatenation look-alikes stay distinct; trimming merges.
    assert local[2][0] != local[3][0]
    assert local[0] == local[1]
    assert all(lk != ik for lk, ik in local)


# --------------------------------------------------------------------------- TM-01 / TM-02

FAKETIME = shutil.which("faketime")


def _require_faketime() -> str:
    if FAKETIME is None:
        message = "faketime is not installed (apt-get install -y faketime)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return FAKETIME


def _skew_seconds(skew: str | None) -> int:
    if skew is None:
        return 0
    sign = -1 if skew.startswith("-") else 1
    assert skew[-1] == "h"
    return sign * int(skew[1:-1]) * 3600


def _spawn_skewed(name: str, skew: str | None) -> Proc:
    if skew is None:
        return Proc(name)
    faketime = _require_faketime()
    return Proc(
        name,
        prefix=[faketime, "-f", skew],
        extra_env={"FAKETIME_DONT_FAKE_MONOTONIC": "1"},
    )


def _check_clock(proc: Proc, dsn: str, skew: str | None) -> float:
    """Ask the process for its wall clock next to the database clock; return the offset."""
    clock = _ok(proc.call({"op": "clock", "dsn": dsn}), proc.name)
    offset = float(clock["wall"]) - float(clock["db"])
    expected = _skew_seconds(skew)
    _report(
        f"{proc.name}: wall={clock['wall_iso']} offset_vs_db={offset:+.1f}s expected={expected:+d}s"
    )
    assert abs(offset - expected) < 600, (
        f"{proc.name}: wall clock offset {offset:.0f} s, expected {expected} s "
        "(faketime not effective?)"
    )
    return offset


@pytest.mark.parametrize(
    ("owner_skew", "contender_skew"),
    [(None, "+3h"), (None, "-3h"), ("+3h", "-3h")],
    ids=["contender+3h", "contender-3h", "owner+3h-contender-3h"],
)
def test_tm01_tm02_clock_skew_neither_early_nor_never(
    pg_dsn: str, procs: list[Proc], owner_skew: str | None, contender_skew: str
) -> None:
    """TM-01/TM-02: skew of hours between replicas; takeover happens after the lease by the
    database clock, never before, and does happen."""
    _require_faketime()
    _ensure_schema(pg_dsn)
    owner = _spawn_skewed("tm-owner", owner_skew)
    procs.append(owner)
    contender = _spawn_skewed("tm-contender", contender_skew)
    procs.append(contender)
    _check_clock(owner, pg_dsn, owner_skew)
    _check_clock(contender, pg_dsn, contender_skew)
    for p in (owner, contender):
        _ok(p.call({"op": "open", "dsn": pg_dsn, "app": "lease-acq"}), p.name)

    lease_ms = 2000
    options = {"code": "tm", "run_key": "tick-1", "lease_ms": lease_ms}
    first = _ok(owner.call({"op": "acquire", "options": options}), owner.name)
    assert first["acquired"] is True
    held = _row(pg_dsn, "tm", "tick-1")

    early = _ok(contender.call({"op": "acquire", "options": options}), contender.name)
    after_early = _row(pg_dsn, "tm", "tick-1")
    if early["acquired"]:
        premature = after_early["modified_at"] - held["modified_at"]
        assert premature >= timedelta(milliseconds=lease_ms), (
            f"the skewed contender reclaimed after {premature} (lease {lease_ms} ms)"
        )
    if after_early["now"] - held["modified_at"] < timedelta(milliseconds=lease_ms):
        # Still within the lease by the database clock after the attempt: it had to lose.
        assert early["acquired"] is False
        assert after_early["owner_token"] == first["owner_token"]

    won = early
    if not early["acquired"]:
        won = _ok(
            contender.call(
                {"op": "acquire_until", "options": options, "deadline_s": 20, "pause_s": 0.05},
                timeout=40,
            ),
            contender.name,
        )
    assert won["acquired"] is True, f"the skewed contender never reclaimed: {won}"
    assert won["fencing_token"] == 2
    assert won["owner_token"] != first["owner_token"]
    row = _row(pg_dsn, "tm", "tick-1")
    silence = row["modified_at"] - held["modified_at"]
    _report(
        f"TM owner={owner_skew} contender={contender_skew}: "
        f"failover_s={silence.total_seconds():.2f} premature=0 "
        f"early_attempts_refused={int(not early['acquired']) + int(won.get('falses', 0))}"
    )
    assert silence >= timedelta(milliseconds=lease_ms), f"reclaimed after only {silence}"
    lease = JobLease(id=first["id"], owner_token=first["owner_token"])
    assert _old_lease_refused(pg_dsn, lease) == [False, False, False, False]


# --------------------------------------------------------------------------- kill -9


def _wait_backend_gone(dsn: str, app: str, deadline_s: float = 15) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        rows = _sql(
            ADMIN_DSN,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND application_name = %s",
            (_dbname(dsn), app),
        )
        if rows[0][0] == 0:
            return
        time.sleep(0.02)
    pytest.fail(f"the backend of {app} is still there {deadline_s} s after the kill")


def test_kill9_owner_is_taken_over_after_the_lease_and_fenced_out(
    pg_dsn: str, procs: list[Proc]
) -> None:
    """SIGKILL the owner inside run_exclusive: no takeover before the lease (DB clock), a
    takeover after it, and the dead owner's token is refused afterwards (G1)."""
    _ensure_schema(pg_dsn)
    victim = Proc("victim")
    procs.append(victim)
    contender = Proc("kill-contender")
    procs.append(contender)
    _ok(victim.call({"op": "open", "dsn": pg_dsn, "app": "lease-victim"}), victim.name)
    _ok(contender.call({"op": "open", "dsn": pg_dsn, "app": "lease-acq"}), contender.name)

    lease_ms = 3000
    options = {"code": "kill9", "run_key": "k", "lease_ms": lease_ms}
    victim.send({"op": "run_exclusive", "options": options, "sleep_s": 300})
    started = _ok(victim.recv(30), victim.name)
    assert started.get("event") == "started", started

    # Let the victim's heartbeat (every lease/3 = 1 s) extend the lease at least once.
    deadline = time.monotonic() + 10
    while True:
        row = _row(pg_dsn, "kill9", "k")
        if row["modified_at"] - row["created_at"] > timedelta(milliseconds=500):
            break
        assert time.monotonic() < deadline, "the owner never heartbeated"
        time.sleep(0.05)

    victim.kill9()
    assert victim.popen.returncode == -signal.SIGKILL
    _wait_backend_gone(pg_dsn, "lease-victim")  # no heartbeat of the victim can still land
    held = _row(pg_dsn, "kill9", "k")
    assert held["status"] == "RUNNING"
    assert held["owner_token"] == started["owner_token"]

    early = _ok(contender.call({"op": "acquire", "options": options}), contender.name)
    after_early = _row(pg_dsn, "kill9", "k")
    still_within_lease = after_early["now"] - held["modified_at"] < timedelta(milliseconds=lease_ms)
    if early["acquired"]:
        gap = after_early["modified_at"] - held["modified_at"]
        assert gap >= timedelta(milliseconds=lease_ms), f"taken over after only {gap}"
    if still_within_lease:
        assert early["acquired"] is False

    won = early
    if not early["acquired"]:
        won = _ok(
            contender.call(
                {"op": "acquire_until", "options": options, "deadline_s": 20, "pause_s": 0.05},
                timeout=40,
            ),
            contender.name,
        )
    assert won["acquired"] is True, f"nobody took over the dead owner's run: {won}"
    assert won["fencing_token"] == 2
    assert won["owner_token"] != started["owner_token"]
    row = _row(pg_dsn, "kill9", "k")
    silence = row["modified_at"] - held["modified_at"]
    _report(
        f"kill-9: runs=1 failover_s={silence.total_seconds():.2f} double_exec=0 "
        f"early_attempts_refused={int(not early['acquired']) + int(won.get('falses', 0))}"
    )
    assert silence >= timedelta(milliseconds=lease_ms)

    dead = JobLease(id=started["id"], owner_token=started["owner_token"])
    assert _old_lease_refused(pg_dsn, dead) == [False, False, False, False]
    final = _row(pg_dsn, "kill9", "k")
    assert final["status"] == "RUNNING"
    assert final["owner_token"] == won["owner_token"]
    assert final["fencing_token"] == 2
