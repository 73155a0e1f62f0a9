"""``sdcore db sql|upgrade --outbox``, ``sdcore outbox list|retry`` and ``sdcore relay``."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import psycopg
import pytest

from sdcore.cli import main
from sdcore.outbox import Outbox
from sdcore.postgres import outbox_schema_sql

REDIS_URL = os.environ.get("SDCORE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _enqueue(dsn: str, *keys: str, name: str = "send") -> None:
    async def run() -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.transaction():
            for key in keys:
                await Outbox().enqueue_once(
                    conn, idempotency_key=key, queue="mail", name=name, payload={"k": key}
                )

    asyncio.run(run())


def test_db_sql_and_upgrade_with_the_outbox(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["db", "sql", "--outbox"]) == 0
    out = capsys.readouterr().out
    assert 'CREATE TABLE IF NOT EXISTS "job_scheduler"' in out
    assert outbox_schema_sql().strip() in out
    assert (
        main(
            ["--database-url", pg_dsn, "db", "upgrade", "--outbox", "--outbox-table", "events_out"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert 'created table "job_scheduler"' in out
    assert 'created table "events_out" with 5 indexes' in out


def test_outbox_list_and_retry(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--database-url", pg_dsn, "db", "upgrade", "--outbox"]) == 0
    _enqueue(pg_dsn, "a\nforged", "b")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox SET status = 'DEAD', attempts = 10, last_error = 'ValueError: too big'"
            " WHERE idempotency_key = 'b'"
        )
        dead_id = conn.execute("SELECT id FROM outbox WHERE idempotency_key = 'b'").fetchone()
    assert dead_id is not None
    capsys.readouterr()
    assert main(["--database-url", pg_dsn, "outbox", "list"]) == 0
    out = capsys.readouterr().out
    assert "DEAD" in out
    assert "PENDING" in out
    assert "ValueError: too big" in out
    assert "a\\nforged" in out  # escaped, not a forged line
    assert main(["--database-url", pg_dsn, "outbox", "list", "--status", "dead", "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    assert '"status":"DEAD"' in lines[0]
    assert main(["--database-url", pg_dsn, "outbox", "retry", str(dead_id[0])]) == 0
    assert "PENDING again" in capsys.readouterr().out
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            "SELECT status, attempts FROM outbox WHERE idempotency_key = 'b'"
        ).fetchone()
    assert row == ("PENDING", 0)
    assert main(["--database-url", pg_dsn, "outbox", "retry", "999999"]) == 1
    assert "no DEAD or PENDING outbox row" in capsys.readouterr().err


def test_relay_needs_redis(
    pg_dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert main(["--database-url", pg_dsn, "relay"]) == 2
    assert "REDIS_URL" in capsys.readouterr().err
    # On a cluster the default prefix "bull" cannot work: refused by name, before connecting.
    cluster = ["--redis-url", "redis+cluster://127.0.0.1:1"]
    assert main(["--database-url", pg_dsn, "relay", *cluster]) == 2
    err = capsys.readouterr().err
    assert "--prefix: on Redis Cluster the BullMQ key prefix must hold a hash tag" in err
    assert "bug" not in err


@pytest.mark.slow
def test_relay_command_publishes_and_stops_on_sigterm(pg_dsn: str) -> None:
    pytest.importorskip("bullmq", reason="the bullmq extra is part of the dev install")
    import uuid

    prefix = f"sdcore-test-{uuid.uuid4().hex[:8]}"
    assert main(["--database-url", pg_dsn, "db", "upgrade", "--outbox"]) == 0
    _enqueue(pg_dsn, "r1", "r2")
    env = {**os.environ, "DATABASE_URL": pg_dsn, "REDIS_URL": REDIS_URL}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sdcore.cli", "relay", "--prefix", prefix],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        published = 0
        while time.monotonic() < deadline:
            with psycopg.connect(pg_dsn) as conn:
                row = conn.execute(
                    "SELECT count(*) FROM outbox WHERE status = 'PUBLISHED'"
                ).fetchone()
            published = row[0] if row else 0
            if published == 2:
                break
            time.sleep(0.2)
        assert published == 2
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)
        client.close()
    assert proc.returncode == 0, err
    assert "stopped; published 2 message(s)" in out


def test_missing_outbox_table_hint_is_the_outbox_upgrade(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--database-url", pg_dsn, "outbox", "list"]) == 1
    err = capsys.readouterr().err
    assert 'table "outbox" does not exist; run `sdcore db upgrade --outbox`' in err
    assert (
        main(
            [
                "--database-url",
                pg_dsn,
                "--schema",
                "ops",
                "outbox",
                "retry",
                "7",
                "--outbox-table",
                "events_out",
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "run `sdcore --schema ops db upgrade --outbox --outbox-table events_out`" in err
    # The hint works as written, and outbox list then works.
    assert main(["--database-url", pg_dsn, "db", "upgrade", "--outbox"]) == 0
    capsys.readouterr()
    assert main(["--database-url", pg_dsn, "outbox", "list"]) == 0
    assert "no outbox rows found" in capsys.readouterr().out


def test_a_lease_table_named_outbox_is_named_as_such(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A lease table named "outbox" (what `sdcore --table outbox db upgrade` creates).
    assert main(["--database-url", pg_dsn, "--table", "outbox", "db", "upgrade"]) == 0
    capsys.readouterr()
    assert main(["--database-url", pg_dsn, "outbox", "list"]) == 1
    err = capsys.readouterr().err
    assert 'table "outbox" is not an sdcore outbox table' in err
    assert "--outbox-table" in err


def test_relay_fails_fast_on_a_missing_table_and_a_missing_database(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("bullmq", reason="the bullmq extra is part of the dev install")
    code = main(["--database-url", pg_dsn, "relay", "--redis-url", REDIS_URL])
    assert code == 1
    assert 'table "outbox" does not exist; run `sdcore db upgrade --outbox`' in (
        capsys.readouterr().err
    )
    missing_db = psycopg.conninfo.make_conninfo(pg_dsn, dbname="sdcore_no_such_db")
    code = main(["--database-url", missing_db, "relay", "--redis-url", REDIS_URL])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1, err  # one line, not the pool's repeated warnings
    # The cause, from one direct connection, not "pool initialization incomplete after 30 sec".
    assert 'database "sdcore_no_such_db" does not exist' in err
    assert "pool" not in err
