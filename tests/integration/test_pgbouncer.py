"""The lease through a real PgBouncer, in transaction and session mode.

A PgBouncer of our own (Debian's ``pgbouncer``, as the postgres OS user, on a free loopback port)
forwards to the test database. Eight contender processes call ``run_exclusive`` for the same 100
run keys while polluter connections on the same PgBouncer keep ``SET``-ting what would break a
lease that trusts its session: ``synchronous_commit = off``, a ``statement_timeout``, a
``lock_timeout``, ``SERIALIZABLE`` and a ``search_path`` without the lease table. An ``AFTER``
row trigger records, for every lease write, the settings it actually ran (and committed) with.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from sdcore.job_scheduler import JobSchedulerError, JobSchedulerService
from sdcore.postgres import PoolSettings, schema_sql
from tests._servers import PgBouncer, pgbouncer

REPO_ROOT = Path(__file__).resolve().parents[2]
PROCESSES = 8
RUNS = 100
DEADLINE_S = 120.0

AUDIT_DDL = """\
CREATE TABLE lease_audit (
    id          bigserial PRIMARY KEY,
    op          text NOT NULL,
    code        text NOT NULL,
    status      text NOT NULL,
    sync_commit text NOT NULL,
    stmt_timeout text NOT NULL,
    lock_timeout text NOT NULL,
    isolation   text NOT NULL,
    backend_pid int  NOT NULL
);
CREATE FUNCTION lease_audit_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.lease_audit (op, code, status, sync_commit, stmt_timeout, lock_timeout,
                                    isolation, backend_pid)
    VALUES (TG_OP, NEW.code, NEW.status, current_setting('synchronous_commit'),
            current_setting('statement_timeout'), current_setting('lock_timeout'),
            current_setting('transaction_isolation'), pg_backend_pid());
    RETURN NULL;
END $$;
CREATE TRIGGER lease_audit AFTER INSERT OR UPDATE ON job_scheduler
    FOR EACH ROW EXECUTE FUNCTION lease_audit_fn();
"""

POLLUTION = (
    "SET synchronous_commit TO off",
    "SET statement_timeout TO '987ms'",
    "SET lock_timeout TO '7ms'",
    "SET default_transaction_isolation TO 'serializable'",
    "SET search_path TO pg_catalog",
)


def _report(line: str) -> None:
    print(line)  # noqa: T201


def _upstream(dsn: str) -> tuple[str, int, str]:
    params = conninfo_to_dict(dsn)
    host, port = params.get("host", "127.0.0.1"), params.get("port", 5432)
    return str(host), int(str(port)), str(params["dbname"])


@pytest.fixture
def prepared_db(pg_dsn: str) -> str:
    """The test database with the lease table and the audit trigger."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(schema_sql().encode())
        conn.execute(AUDIT_DDL.encode())
    return pg_dsn


class Polluter:
    """Connections through the same PgBouncer that keep SET-ting session settings."""

    def __init__(
        self, dsn: str, connections: int = 3, statements: tuple[str, ...] = POLLUTION
    ) -> None:
        self._dsn = dsn
        self._statements = statements
        self._count = connections
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.statements = 0
        self.errors: list[str] = []

    def _run(self) -> None:
        try:
            with psycopg.connect(self._dsn, autocommit=True, prepare_threshold=None) as conn:
                while not self._stop.is_set():
                    for statement in self._statements:
                        conn.execute(statement.encode())
                        self.statements += 1
                    time.sleep(0.001)
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> Polluter:
        for index in range(self._count):
            thread = threading.Thread(target=self._run, name=f"polluter-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)


def _contenders(dsn: str, code: str, *, transaction_pooling: bool) -> list[dict[str, Any]]:
    """Start the contender processes, release them together, collect their reports."""
    cmd = [
        sys.executable,
        "-m",
        "tests.integration._pgbouncer_worker",
        "--dsn",
        dsn,
        "--code",
        code,
        "--runs",
        str(RUNS),
    ]
    if transaction_pooling:
        cmd.append("--transaction-pooling")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    procs = [
        subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            env=env,
        )
        for _ in range(PROCESSES)
    ]
    try:
        deadline = time.monotonic() + DEADLINE_S
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if json.loads(line or "{}").get("event") != "ready":
                _, err = proc.communicate(timeout=10)
                raise AssertionError(f"contender did not start: {line!r} {err[-2000:]}")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        reports = []
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.returncode == 0, err[-2000:]
            reports.append(json.loads(out.strip().splitlines()[-1]))
        return reports
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture(params=["transaction", "session"])
def bouncer(request: pytest.FixtureRequest, prepared_db: str) -> Iterator[PgBouncer]:
    """A PgBouncer in front of the test database; few server connections in transaction mode."""
    host, port, _ = _upstream(prepared_db)
    mode = str(request.param)
    pool_size = 3 if mode == "transaction" else PROCESSES * 2 + 4
    with pgbouncer(upstream_host=host, upstream_port=port, mode=mode, pool_size=pool_size) as pgb:
        yield pgb


@pytest.mark.slow
def test_8_processes_x_100_runs_exactly_once_with_durable_lease_writes(
    bouncer: PgBouncer, prepared_db: str
) -> None:
    _, _, dbname = _upstream(prepared_db)
    dsn = bouncer.dsn(dbname)
    transaction_pooling = bouncer.mode == "transaction"
    code = f"pgb-{bouncer.mode}"
    started = time.monotonic()
    with Polluter(dsn) as polluter:
        reports = _contenders(dsn, code, transaction_pooling=transaction_pooling)
    elapsed = time.monotonic() - started
    assert not polluter.errors, polluter.errors
    assert polluter.statements > 0

    errors = [e for report in reports for e in report["errors"]]
    ran = Counter(key for report in reports for key in report["ran"])
    with psycopg.connect(prepared_db, autocommit=True) as conn:
        statuses: dict[str, int] = dict(
            conn.execute(
                "SELECT status, count(*) FROM job_scheduler WHERE code = %s GROUP BY status",
                (code,),
            ).fetchall()
        )
        audit = conn.execute(
            "SELECT op, sync_commit, stmt_timeout, lock_timeout, isolation, count(*),"
            " count(DISTINCT backend_pid) FROM lease_audit WHERE code = %s"
            " GROUP BY 1, 2, 3, 4, 5 ORDER BY 1, 2, 3, 4, 5",
            (code,),
        ).fetchall()
    _report(
        f"PgBouncer {bouncer.mode} mode, transaction_pooling={transaction_pooling}: "
        f"{PROCESSES} processes x {RUNS} runs in {elapsed:.1f} s, polluter statements "
        f"{polluter.statements}; ran {sum(ran.values())}, errors {len(errors)}, "
        f"statuses {statuses}; audit {audit}"
    )
    assert errors == []
    assert sorted(ran) == [f"run-{i:04d}" for i in range(RUNS)]
    assert set(ran.values()) == {1}, [key for key, n in ran.items() if n != 1]
    assert statuses == {"SUCCESS": RUNS}
    writes = sum(row[5] for row in audit)
    assert writes >= 2 * RUNS  # one acquire and one complete per run
    for op, sync_commit, stmt_timeout, lock_timeout, isolation, _, _ in audit:
        assert (sync_commit, stmt_timeout, isolation) == ("on", "30s", "read committed"), op
        if transaction_pooling:
            assert lock_timeout == "0"


def test_nothing_left_on_the_server_session(prepared_db: str) -> None:
    """One server connection: after sdcore's statements it shows no setting and no statement."""
    host, port, dbname = _upstream(prepared_db)
    with pgbouncer(upstream_host=host, upstream_port=port, mode="transaction", pool_size=1) as pgb:
        dsn = pgb.dsn(dbname)

        async def traffic() -> None:
            async with JobSchedulerService.connect(
                dsn,
                pool=PoolSettings(max_size=4, transaction_pooling=True),
                statement_timeout_ms=4321,
            ) as jobs:
                await jobs.ensure_schema()
                for index in range(12):
                    outcome = await jobs.run_exclusive(
                        {"code": "left-behind", "run_key": f"r{index}"}, lambda lease: None
                    )
                    assert outcome.acquired
                assert len(await jobs.statuses(["nope", "nada"])) == 0

        asyncio.run(traffic())
        with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as probe:
            row = probe.execute(
                "SELECT (SELECT count(*) FROM pg_prepared_statements),"
                " current_setting('statement_timeout'), current_setting('synchronous_commit'),"
                " current_setting('lock_timeout'), current_setting('transaction_isolation'),"
                " current_setting('search_path') = (SELECT reset_val FROM pg_settings"
                "   WHERE name = 'search_path')"
            ).fetchone()
    assert row == (0, "0", "on", "0", "read committed", True)


def test_prepared_statements_through_transaction_pooling_name_the_switch(
    prepared_db: str,
) -> None:
    """Without the switch, the pooler's protocol errors say what is wrong and what to pass."""
    host, port, dbname = _upstream(prepared_db)
    with pgbouncer(upstream_host=host, upstream_port=port, mode="transaction", pool_size=1) as pgb:
        dsn = pgb.dsn(dbname)

        async def two_clients() -> list[str]:
            seen: list[str] = []
            async with (
                JobSchedulerService.connect(dsn, pool=PoolSettings(max_size=1)) as one,
                JobSchedulerService.connect(dsn, pool=PoolSettings(max_size=1)) as two,
            ):
                for index in range(8):  # psycopg prepares from the 6th execution on
                    for jobs in (one, two):
                        try:
                            await jobs.acquire({"code": "prep", "run_key": f"r{index}-{id(jobs)}"})
                        except JobSchedulerError as exc:
                            seen.append(str(exc))
            return seen

        seen = asyncio.run(two_clients())
    _report(f"without transaction_pooling=True: {len(seen)} errors, first: {seen[:1]}")
    assert seen, "expected PgBouncer transaction pooling to break server-side prepares"
    assert all("transaction_pooling=True" in text for text in seen), seen


def test_runtime_switch_through_transaction_pooling(prepared_db: str) -> None:
    """``Sdcore(transaction_pooling=True)``: migrations, lease writes and the pool through it."""
    from sdcore.fastapi import Sdcore

    host, port, dbname = _upstream(prepared_db)
    with pgbouncer(upstream_host=host, upstream_port=port, mode="transaction", pool_size=2) as pgb:
        dsn = pgb.dsn(dbname)

        async def run() -> None:
            runtime = Sdcore(
                database_url=dsn,
                pool=PoolSettings(transaction_pooling=True, max_size=4),
                scheduling=None,
            )
            assert runtime.pool.kwargs["prepare_threshold"] is None  # type: ignore[index]
            async with runtime:
                for index in range(8):
                    outcome = await runtime.jobs.run_exclusive(
                        {"code": "runtime-pgb", "run_key": f"r{index}"}, lambda lease: None
                    )
                    assert outcome.acquired

        # Not search_path: the outbox's migrations use the pool as it is (name a schema there).
        with Polluter(dsn, connections=2, statements=POLLUTION[:-1]):
            asyncio.run(run())
    with psycopg.connect(prepared_db, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT sync_commit, stmt_timeout, count(*) FROM lease_audit WHERE code = %s"
            " GROUP BY 1, 2",
            ("runtime-pgb",),
        ).fetchall()
    assert rows == [("on", "30s", 16)]
