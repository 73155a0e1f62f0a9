"""Lease cycles per second: sdcore next to a bare psycopg loop and pgbench, same SQL, one run.

A *lease cycle* is one ``acquire`` of a fresh run (an ``INSERT … ON CONFLICT … RETURNING``)
followed by its ``complete`` (an ``UPDATE``), each in its own autocommit transaction with a durable
commit. Four workloads run that cycle at every client count N:

``bare``
    N asyncio tasks, each holding one psycopg ``AsyncConnection`` (autocommit) and running the
    library's own rendered statements with cheaply made parameters: the floor a Python client pays
    for the driver and the server. Its lock keys are random and shaped like the library's
    (``"v2:"`` + 64 hex digits) so that the server does the same work for both; ``--bare-keys
    short`` sends sequential ``bench-{client}-{i}`` instead (less index and WAL work).
``sdcore``
    N asyncio tasks over one ``JobSchedulerService`` (``max_connections=N``) through the public API:
    ``acquire(JobAcquireOptions(...))`` then ``complete(result.lease)``. Building and validating
    the options, the result and the lease is part of the measured cost.
``minimal``
    The minimal hand-written lease a service would write for itself, through the same bare
    psycopg loop on the same connections: a table with only its primary key and the unique lock
    key, ``INSERT … ON CONFLICT (lock_key) DO UPDATE … WHERE <reclaim> RETURNING id, owner_token``
    and ``UPDATE … WHERE id AND owner_token``. ``sdcore/minimal`` has a target of its own (≥ 0.90×):
    it charges sdcore for its schema and statements as well as its Python layer.
``pgbench``
    ``pgbench -n -M prepared -c N -j N -T S`` with a script made of the same two statements (the
    ``%s`` placeholders become pgbench variables; ``\\gset`` carries ``id`` from the insert's
    ``RETURNING`` to the update): what the server does with no Python client at all.

How noise is kept out of the ratio that matters (on a small, shared machine single runs of the
same workload differ by 2× and more): ``bare`` and ``sdcore`` run in one worker process, over the
*same* N server connections (one pool of exactly N: the service is built over it, and the bare
loop checks the same connections out and holds them), alternating in short slices (``--slice``,
default 0.5 s; order bare, sdcore, sdcore, bare, …) until each has run ``--seconds``. A burst of
load from elsewhere then hits both alike, and so does whichever CPU the server processes landed on.
pgbench runs next to that pair for ``--seconds``, in an order that rotates each round. Before each
measurement the table is truncated and a checkpoint taken (when the role may), so table growth and
checkpoint timing favour no one. Every slice starts warm (connections configured, statements
prepared) and is timed from its first cycle; pgbench reports its rate without connection time.

The script exits 0 whatever the figures (it is a benchmark, not a test) and prints whether the
target, sdcore ≥ 0.85× the bare loop at every client count, was met.

Usage::

    python benchmarks/lease.py [--database-url URL] [--seconds S] [--rounds R] [--clients 1,4]
                               [--slice SECONDS] [--bare-keys v2|short]

The URL defaults to ``$SDCORE_BENCH_DATABASE_URL`` or ``postgresql://postgres@127.0.0.1:5432/postgres``;
a scratch database is created on that server and dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from _harness import run_pgbench as harness_pgbench
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool

from sdcore._internal.identifiers import random_uuid
from sdcore.job_scheduler import JobAcquireOptions, JobSchedulerService
from sdcore.job_scheduler._sql import LeaseStatements
from sdcore.postgres import PoolSettings

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
TABLE = "job_scheduler"
TARGET = 0.85
TARGET_MINIMAL = 0.90  # sdcore's cycle against the minimal SQL that does the same job
MINIMAL_TABLE = "minimal_lease"
# The minimal lease a hand-written service would use: only the primary key and the unique lock
# key, one upsert that also takes over FAIL and expired RUNNING rows, one fenced update.
MINIMAL_DDL = f"""
CREATE TABLE IF NOT EXISTS {MINIMAL_TABLE} (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    lock_key    text        NOT NULL UNIQUE,
    status      text        NOT NULL,
    owner_token uuid        NOT NULL,
    modified_at timestamptz NOT NULL
)"""
MINIMAL_ACQUIRE = f"""
INSERT INTO {MINIMAL_TABLE} AS j (lock_key, status, owner_token, modified_at)
VALUES (%s, 'RUNNING', %s::uuid, clock_timestamp())
ON CONFLICT (lock_key) DO UPDATE
SET status = 'RUNNING', owner_token = EXCLUDED.owner_token, modified_at = clock_timestamp()
WHERE j.status = 'FAIL'
   OR (j.status = 'RUNNING' AND j.modified_at < clock_timestamp() - %s * interval '1 ms')
RETURNING id, owner_token""".encode()
MINIMAL_COMPLETE = f"""
UPDATE {MINIMAL_TABLE} SET status = 'SUCCESS', modified_at = clock_timestamp()
WHERE id = %s AND owner_token = %s""".encode()
LEASE_MS = 60_000
WARMUP_CYCLES = 10  # per client, before the first slice: passes psycopg's prepare threshold (5)
_WORKER_DSN_ENV = "SDCORE_BENCH_WORKER_DSN"  # keeps a password out of the process list


# --------------------------------------------------------------------------- Python workloads

Cycle = Callable[[int], Awaitable[None]]


@dataclass
class Totals:
    """What one Python workload did over all its timed slices."""

    cycles: int = 0
    elapsed: float = 0.0  # wall seconds
    cpu: float = 0.0  # seconds of the worker process's CPU (user + system)
    slice_rates: list[float] = field(default_factory=list)  # cycles/s of each slice

    @property
    def rate(self) -> float:
        return self.cycles / self.elapsed if self.elapsed else float("nan")


async def _timed_slice(cycles: Sequence[Cycle], counters: list[int], seconds: float) -> Totals:
    """Run every client until ``seconds`` have passed; each finishes its cycle in flight."""
    deadline = 0.0

    async def client(index: int) -> int:
        cycle = cycles[index]
        i = counters[index]
        start_i = i
        clock = time.perf_counter
        while clock() < deadline:
            await cycle(i)
            i += 1
        counters[index] = i
        return i - start_i

    cpu = time.process_time()
    start = time.perf_counter()
    deadline = start + seconds
    done = await asyncio.gather(*(client(index) for index in range(len(cycles))))
    elapsed = time.perf_counter() - start
    return Totals(sum(done), elapsed, time.process_time() - cpu, [sum(done) / elapsed])


async def _untimed(cycles: Sequence[Cycle], counters: list[int], rounds: int) -> None:
    """Run ``rounds`` cycles on every client at once (warm-up, not measured)."""

    async def client(index: int) -> None:
        for _ in range(rounds):
            await cycles[index](counters[index])
            counters[index] += 1

    await asyncio.gather(*(client(index) for index in range(len(cycles))))


def _v2_shaped_key() -> str:
    # The library's keys are "v2:" + 64 hex digits of SHA-256: long, and at a random place in the
    # unique index. Random bits give the server the same work for well under a microsecond.
    return f"v2:{random.getrandbits(256):064x}"


def _bare_cycles(
    conns: Sequence[psycopg.AsyncConnection[Any]], statements: LeaseStatements, keys: str
) -> list[Cycle]:
    acquire, finalize = statements.acquire, statements.finalize

    def make(client: int, conn: psycopg.AsyncConnection[Any]) -> Cycle:
        async def cycle(i: int) -> None:
            key = _v2_shaped_key() if keys == "v2" else f"bench-{client}-{i}"
            token = random_uuid()  # as the library makes its owner token
            cur = await conn.execute(
                acquire, (key, key, "bench", None, "SCHEDULE", f"{client}-{i}", token, LEASE_MS)
            )
            row = await cur.fetchone()
            if row is None:
                raise RuntimeError(f"bare: {key} was not acquired")
            cur = await conn.execute(finalize, ("SUCCESS", None, row[0], token))
            if cur.rowcount != 1:
                raise RuntimeError(f"bare: {key} was not completed")

        return cycle

    return [make(client, conn) for client, conn in enumerate(conns)]


def _minimal_cycles(conns: Sequence[psycopg.AsyncConnection[Any]], keys: str) -> list[Cycle]:
    def make(client: int, conn: psycopg.AsyncConnection[Any]) -> Cycle:
        async def cycle(i: int) -> None:
            key = _v2_shaped_key() if keys == "v2" else f"bench-{client}-{i}"
            cur = await conn.execute(MINIMAL_ACQUIRE, (key, random_uuid(), LEASE_MS))
            row = await cur.fetchone()
            if row is None:
                raise RuntimeError(f"minimal: {key} was not acquired")
            cur = await conn.execute(MINIMAL_COMPLETE, (row[0], row[1]))
            if cur.rowcount != 1:
                raise RuntimeError(f"minimal: {key} was not completed")

        return cycle

    return [make(client, conn) for client, conn in enumerate(conns)]


def _sdcore_cycles(jobs: JobSchedulerService, clients: int) -> list[Cycle]:
    def make(client: int) -> Cycle:
        async def cycle(i: int) -> None:
            result = await jobs.acquire(
                JobAcquireOptions(code="bench", run_key=f"{client}-{i}", lease_ms=LEASE_MS)
            )
            if not result.acquired:
                raise RuntimeError(f"sdcore: {client}-{i} was not acquired")
            if not await jobs.complete(result.lease):
                raise RuntimeError(f"sdcore: {client}-{i} was not completed")

        return cycle

    return [make(client) for client in range(clients)]


async def run_pair(
    dsn: str, clients: int, seconds: float, slice_seconds: float, keys: str
) -> dict[str, Totals]:
    """Alternate bare and sdcore slices over one pool of exactly ``clients`` connections."""
    statements = LeaseStatements.render(sql.Identifier(TABLE))
    # One spare connection: the service never holds the last connection of its pool, so a pool of
    # exactly N would give it N - 1. Both workloads still run on N connections.
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn, min_size=clients + 1, max_size=clients + 1, kwargs={"autocommit": True}, open=False
    )
    await pool.open(wait=True, timeout=30)
    totals = {"bare": Totals(), "sdcore": Totals(), "minimal": Totals()}
    counters = {"bare": [0] * clients, "sdcore": [0] * clients, "minimal": [0] * clients}

    async def bare_slice(warmup: int) -> Totals:
        conns = [await pool.getconn() for _ in range(clients)]
        try:
            cycles = _bare_cycles(conns, statements, keys)
            await _untimed(cycles, counters["bare"], warmup)
            return await _timed_slice(cycles, counters["bare"], slice_seconds)
        finally:
            for conn in conns:
                await pool.putconn(conn)

    async def minimal_slice(warmup: int) -> Totals:
        conns = [await pool.getconn() for _ in range(clients)]
        try:
            cycles = _minimal_cycles(conns, keys)
            await _untimed(cycles, counters["minimal"], warmup)
            return await _timed_slice(cycles, counters["minimal"], slice_seconds)
        finally:
            for conn in conns:
                await pool.putconn(conn)

    async def sdcore_slice(warmup: int) -> Totals:
        # The service takes its connections lazily: N concurrent warm-up cycles make it hold all
        # N (and configure their sessions) before the slice is timed. Closing it returns them.
        jobs = JobSchedulerService(pool, max_connections=clients)
        try:
            cycles = _sdcore_cycles(jobs, clients)
            await _untimed(cycles, counters["sdcore"], warmup)
            return await _timed_slice(cycles, counters["sdcore"], slice_seconds)
        finally:
            await jobs.close()

    slices: dict[str, Callable[[int], Awaitable[Totals]]] = {
        "bare": bare_slice,
        "sdcore": sdcore_slice,
        "minimal": minimal_slice,
    }
    try:
        order = ["bare", "sdcore", "minimal"]
        for workload in order:
            await slices[workload](WARMUP_CYCLES)
        while min(t.elapsed for t in totals.values()) < seconds:
            for workload in order:
                part = await slices[workload](1)
                total = totals[workload]
                total.cycles += part.cycles
                total.elapsed += part.elapsed
                total.cpu += part.cpu
                total.slice_rates.extend(part.slice_rates)
            order.reverse()  # ABCCBA: a linear drift cancels out
    finally:
        await pool.close()
    return totals


def worker_main(clients: int, seconds: float, slice_seconds: float, keys: str) -> None:
    """Subprocess entry point: run the bare/sdcore pair and print the totals as JSON."""
    dsn = os.environ[_WORKER_DSN_ENV]
    totals = asyncio.run(run_pair(dsn, clients, seconds, slice_seconds, keys))
    print(json.dumps({name: asdict(total) for name, total in totals.items()}))


# --------------------------------------------------------------------------- pgbench

_PGBENCH_OWNER = "8c1f9a52-3d4e-4b6a-9f0e-2a7b5c9d1e30"  # owner_token is not unique: one will do


def _substitute(statement: bytes, names: Sequence[str]) -> str:
    """Replace the ``%s`` placeholders of a rendered statement, in order, with ``names``."""
    parts = statement.decode("utf-8").split("%s")
    if len(parts) != len(names) + 1:
        raise RuntimeError(f"expected {len(names)} placeholders, found {len(parts) - 1}")
    out = [parts[0]]
    for name, part in zip(names, parts[1:], strict=True):
        out.extend((name, part))
    return "".join(out)


def pgbench_script() -> str:
    """The library's two statements as a pgbench script.

    Parameters become pgbench variables (bound as parameters under ``-M prepared``); the two
    ``NULL`` ones (``name`` and ``data``) become literal ``NULL``, since pgbench has no null
    variable it could bind. ``p_n`` counts each client's cycles (``-D p_n=0``); the lock key is a
    19-digit number, ``10**18 + permute(client_id * 10**12 + p_n, 10**18)``: fresh every cycle
    and, like the library's hashed keys, at a random place in the unique index (but 19
    characters long, not 67: pgbench cannot build longer strings without changing the SQL).
    ``\\gset`` stores the insert's ``RETURNING`` columns (``id``, ``fencing_token``, …) in
    variables for the update; hence the ``p_`` prefix of our own variables, which ``\\gset``
    would otherwise overwrite.
    """
    statements = LeaseStatements.render(sql.Identifier(TABLE))
    acquire = _substitute(
        statements.acquire,
        [":p_key", ":p_key", ":p_code", "NULL", ":p_type", ":p_n", ":p_token", ":p_lease_ms"],
    )
    finalize = _substitute(statements.finalize, [":p_status", "NULL", ":id", ":p_token"])

    def one_line(text: str) -> str:
        # A \gset must end the statement's (single) line: drop the SQL file's comment lines
        # (they would comment out the rest of the joined line) and join the others.
        kept = [line for line in text.splitlines() if not line.lstrip().startswith("--")]
        return " ".join(" ".join(kept).split())

    return (
        "\\set p_n :p_n + 1\n"
        "\\set p_key 1000000000000000000"
        " + permute(:client_id * 1000000000000 + :p_n, 1000000000000000000)\n"
        f"{one_line(acquire)} \\gset\n"
        f"{one_line(finalize)};\n"
    )


def run_pgbench(dsn: str, script: Path, clients: int, seconds: int) -> float:
    """Run pgbench with the lease script; return its transactions (= cycles) per second."""
    defines = {
        "p_n": "0",
        "p_code": "bench",
        "p_type": "SCHEDULE",
        "p_token": _PGBENCH_OWNER,
        "p_lease_ms": str(LEASE_MS),
        "p_status": "SUCCESS",
    }
    return harness_pgbench(dsn, script, clients, seconds, defines)


# --------------------------------------------------------------------------- orchestration


@dataclass(frozen=True)
class Round:
    """The three workloads at one client count in one round."""

    clients: int
    bare: Totals
    sdcore: Totals
    minimal: Totals
    pgbench: float  # cycles per second
    load: float  # 1-minute load average of the machine when the round ended

    @property
    def ratio(self) -> float:
        return self.sdcore.rate / self.bare.rate

    @property
    def ratio_minimal(self) -> float:
        return self.sdcore.rate / self.minimal.rate


def _run_pair(
    dsn: str, clients: int, seconds: int, slice_seconds: float, keys: str
) -> tuple[Totals, Totals, Totals]:
    """Run the bare/sdcore/minimal slices in a fresh interpreter."""
    env = dict(os.environ)
    env[_WORKER_DSN_ENV] = dsn
    command = [
        sys.executable, __file__, "--worker", "--clients", str(clients),
        "--seconds", str(seconds), "--slice", str(slice_seconds), "--bare-keys", keys,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"worker failed ({done.returncode}):\n{done.stderr}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return Totals(**result["bare"]), Totals(**result["sdcore"]), Totals(**result["minimal"])


def _dsn_for(url: str, dbname: str) -> str:
    params = {k: str(v) for k, v in conninfo_to_dict(url).items()}
    params["dbname"] = dbname
    return make_conninfo(**params)


class _Reset:
    """Empty the table (and checkpoint, when the role may) before each measurement."""

    def __init__(self, dsn: str) -> None:
        self._conn = psycopg.connect(dsn, autocommit=True)
        self._checkpoint = True

    def __call__(self) -> None:
        self._conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(TABLE)))
        self._conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(MINIMAL_TABLE)))
        if self._checkpoint:
            try:
                self._conn.execute("CHECKPOINT")
            except psycopg.errors.InsufficientPrivilege:
                print("note: no privilege to CHECKPOINT; measuring without it")
                self._checkpoint = False

    def close(self) -> None:
        self._conn.close()


async def _ensure_schema(dsn: str) -> None:
    async with JobSchedulerService.connect(dsn, pool=PoolSettings(max_size=1)) as jobs:
        await jobs.ensure_schema()
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(MINIMAL_DDL.encode())


def _cpu_us(total: Totals) -> float:
    return 1e6 * total.cpu / total.cycles if total.cycles else float("nan")


def report(rounds: Sequence[Round], clients: Sequence[int]) -> bool:
    """Print the summary table; return whether sdcore met the target at every client count."""
    met = True
    met_minimal: list[bool] = []
    minimal_lines: list[str] = []
    print()
    print(
        f"{'clients':>7} | {'bare/s':>7} {'sdcore/s':>8} {'pgbench/s':>9} | {'sdcore/bare':>11}"
        f" {'rounds':>9} | {'bare/pgbench':>12} | {'µs/cycle b':>10} {'s':>4} {'pgb':>4}"
        f" | {'CPU µs b':>8} {'s':>4} {'+s':>4}"
    )
    for n in clients:
        mine = [r for r in rounds if r.clients == n]
        bare = statistics.median(r.bare.rate for r in mine)
        ours = statistics.median(r.sdcore.rate for r in mine)
        pgb = statistics.median(r.pgbench for r in mine)
        ratios = sorted(r.ratio for r in mine)
        ratio = statistics.median(ratios)
        cpu_bare = statistics.median(_cpu_us(r.bare) for r in mine)
        cpu_ours = statistics.median(_cpu_us(r.sdcore) for r in mine)
        minimal = statistics.median(r.minimal.rate for r in mine)
        minimal_ratios = sorted(r.ratio_minimal for r in mine)
        ratio_min = statistics.median(minimal_ratios)
        met_minimal.append(ratio_min >= TARGET_MINIMAL)
        minimal_lines.append(
            f"{n:>7} | minimal SQL {minimal:>7,.0f}/s | sdcore/minimal {ratio_min:.2f}×"
            f" (rounds {minimal_ratios[0]:.2f}–{minimal_ratios[-1]:.2f})"
            f" | bare (sdcore's SQL)/minimal {bare / minimal:.2f}×"
        )
        met = met and ratio >= TARGET
        print(
            f"{n:>7} | {bare:>7,.0f} {ours:>8,.0f} {pgb:>9,.0f} | {ratio:>10.2f}×"
            f" {ratios[0]:>4.2f}–{ratios[-1]:.2f} | {bare / pgb:>11.2f}× |"
            f" {1e6 / bare:>10.0f} {1e6 / ours:>4.0f} {1e6 / pgb:>4.0f} |"
            f" {cpu_bare:>8.0f} {cpu_ours:>4.0f} {cpu_ours - cpu_bare:>+4.0f}"
        )
    print(
        "\nb = bare psycopg loop, s = sdcore, pgb = pgbench; medians across rounds. sdcore/bare is"
        "\nthe median of the per-round ratios ('rounds': their range); bare and sdcore alternate in"
        "\nslices on the same connections, so that ratio is the figure to trust. µs/cycle is wall"
        "\ntime per cycle (1e6 / rate, all clients together); CPU µs is the worker process's CPU"
        "\n(user + system) per cycle and +s is sdcore's extra CPU per cycle."
    )
    verdict = "MET" if met else "NOT MET"
    print(f"target: sdcore ≥ {TARGET}× the bare loop at every client count: {verdict}")
    print()
    for line in minimal_lines:
        print(line)
    verdict = "MET" if all(met_minimal) else "NOT MET"
    print(
        f"target: sdcore ≥ {TARGET_MINIMAL}× the minimal hand-written lease (primary key + unique"
        f" lock key, one upsert, one fenced update) at every client count: {verdict}"
    )
    return met


def _print_round(r: int, result: Round) -> None:
    pairs = zip(result.sdcore.slice_rates, result.bare.slice_rates, strict=True)
    slices = [s / b for s, b in pairs]
    print(
        f"round {r} clients {result.clients}: bare {result.bare.rate:>7,.0f}/s"
        f" sdcore {result.sdcore.rate:>7,.0f}/s (×{result.ratio:.2f}; slice pairs"
        f" {min(slices):.2f}–{max(slices):.2f}) pgbench {result.pgbench:>7,.0f}/s"
        f"  [CPU µs/cycle b {_cpu_us(result.bare):.0f} s {_cpu_us(result.sdcore):.0f};"
        f" load {result.load:.1f}]",
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with the hidden ``--worker``, the bare/sdcore pair)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--database-url",
        default=os.environ.get("SDCORE_BENCH_DATABASE_URL", DEFAULT_URL),
        help="server to benchmark on (a scratch database is created there and dropped)",
    )
    parser.add_argument("--seconds", type=int, default=5, help="per workload (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--clients", default="1,4", help="client counts (default 1,4)")
    parser.add_argument(
        "--slice", type=float, default=0.5, help="bare/sdcore alternation slice (default 0.5 s)"
    )
    parser.add_argument(
        "--bare-keys",
        choices=("v2", "short"),
        default="v2",
        help="lock keys of the bare loop: 'v2' (default) random 67-character keys shaped like the"
        " library's, or 'short' sequential 'bench-{client}-{i}'",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        worker_main(int(args.clients), args.seconds, args.slice, args.bare_keys)
        return 0

    try:
        clients = [int(part) for part in args.clients.split(",") if part.strip()]
    except ValueError:
        parser.error(f"--clients must be a comma-separated list of integers: {args.clients!r}")
    if not clients or min(clients) < 1 or args.seconds < 1 or args.rounds < 1:
        parser.error("--clients, --seconds and --rounds must be positive")
    if not 0.05 <= args.slice <= args.seconds:
        parser.error("--slice must be between 0.05 and --seconds")
    if shutil.which("pgbench") is None:
        parser.error("pgbench is not on PATH")

    dbname = f"sdcore_bench_{os.getpid()}"
    admin = psycopg.connect(args.database_url, autocommit=True)
    version = admin.execute("SHOW server_version").fetchone()
    settings = admin.execute(
        "SELECT string_agg(name || '=' || setting, ' ' ORDER BY name) FROM pg_settings"
        " WHERE name IN ('fsync', 'synchronous_commit', 'wal_sync_method', 'shared_buffers')"
    ).fetchone()
    admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    dsn = _dsn_for(args.database_url, dbname)
    print(
        f"lease cycles: {args.rounds} round(s) × clients {clients}, {args.seconds} s per workload,"
        f" {args.slice} s slices; bare keys: {args.bare_keys}"
    )
    print(f"PostgreSQL {version[0] if version else '?'} ({settings[0] if settings else ''})")
    print(
        f"Python {platform.python_version()}, psycopg {psycopg.__version__}"
        f" ({psycopg.pq.__impl__}), {os.cpu_count()} CPUs, {platform.platform()},"
        f" load average {os.getloadavg()[0]:.1f}"
    )
    rounds: list[Round] = []
    reset: _Reset | None = None
    try:
        asyncio.run(_ensure_schema(dsn))
        reset = _Reset(dsn)
        with tempfile.TemporaryDirectory(prefix="sdcore-bench-") as tmp:
            script = Path(tmp) / "lease.sql"
            script.write_text(pgbench_script())
            for r in range(args.rounds):
                for n in clients:
                    pgb = 0.0
                    pair: tuple[Totals, Totals, Totals] | None = None
                    # Rotate the order each round so that neither side always runs first.
                    for step in ("pair", "pgbench") if r % 2 == 0 else ("pgbench", "pair"):
                        reset()
                        if step == "pgbench":
                            pgb = run_pgbench(dsn, script, n, args.seconds)
                        else:
                            pair = _run_pair(dsn, n, args.seconds, args.slice, args.bare_keys)
                    assert pair is not None
                    result = Round(n, pair[0], pair[1], pair[2], pgb, os.getloadavg()[0])
                    rounds.append(result)
                    _print_round(r + 1, result)
    finally:
        if reset is not None:
            reset.close()
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
        )
        admin.close()
    report(rounds, clients)
    return 0


if __name__ == "__main__":
    sys.exit(main())
