"""``sdcore.django`` against real PostgreSQL: migrate, ``manage.py sdcore …``, the worker."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from sdcore.postgres import migrations
from tests.conftest import REDIS_URL
from tests.django_project.harness import environment, manage, start
from tests.integration.test_migrations import _legacy, _rows

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
STEPS = sum(len(migrations(c)) for c in ("lease", "outbox", "schedules"))
MODEL_MIGRATIONS = 1  # 0018_admin_models: the admin's unmanaged models, no SQL


def _bookkeeping(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return list(
            conn.execute(
                "SELECT component, version, applied_at FROM sdcore_migrations ORDER BY 1, 2"
            ).fetchall()
        )


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (result.stdout, result.stderr)
    return result.stdout


def _sdcore_upgrade(dsn: str) -> str:
    command = [sys.executable, "-m", "sdcore.cli", "--database-url", dsn, "db", "upgrade"]
    result = subprocess.run(
        [*command, "--outbox", "--schedules"], capture_output=True, text=True, check=False
    )
    return _ok(result)


def test_migrate_on_an_empty_database_then_sdcore_db_upgrade_does_nothing(empty_dsn: str) -> None:
    out = _ok(manage(empty_dsn, "migrate"))
    assert out.count("Applying sdcore.") == STEPS + MODEL_MIGRATIONS
    recorded = _bookkeeping(empty_dsn)
    assert len(recorded) == STEPS
    assert _sdcore_upgrade(empty_dsn).count("is up to date; nothing to do") == 3
    assert _bookkeeping(empty_dsn) == recorded
    shown = _ok(manage(empty_dsn, "showmigrations", "sdcore"))
    assert shown.count("[X]") == STEPS + MODEL_MIGRATIONS
    assert "0001_lease_initial" in shown
    assert "0017_schedules_replica_digest" in shown
    status = _ok(manage(empty_dsn, "sdcore", "db", "status", "--outbox", "--schedules", "--json"))
    assert [json.loads(line)["up_to_date"] for line in status.splitlines()] == [True] * 3


def test_sdcore_db_upgrade_then_migrate_changes_nothing(empty_dsn: str) -> None:
    _sdcore_upgrade(empty_dsn)
    recorded = _bookkeeping(empty_dsn)
    applied = _ok(manage(empty_dsn, "migrate")).count("Applying sdcore.")
    assert applied == STEPS + MODEL_MIGRATIONS
    assert _bookkeeping(empty_dsn) == recorded  # same rows, same applied_at


def test_migrate_upgrades_a_0_1_0_database_and_keeps_its_rows(empty_dsn: str) -> None:
    _legacy(empty_dsn)
    before = _rows(empty_dsn)
    _ok(manage(empty_dsn, "migrate"))
    after = _rows(empty_dsn)
    assert [r[:4] for r in after["jobs"]] == [r[:4] for r in before["jobs"]]
    assert [r[:2] for r in after["outbox"]] == [r[:2] for r in before["outbox"]]
    assert len(_bookkeeping(empty_dsn)) == STEPS
    assert _sdcore_upgrade(empty_dsn).count("nothing to do") == 3


def test_migrates_at_once_apply_each_step_once(empty_dsn: str) -> None:
    # Four pods migrating sdcore at once: each step once (sdcore's own bookkeeping), and
    # Django's creation of django_migrations in turn (sdcore's lock from pre_migrate to
    # post_migrate; two creations at once fail on a duplicate pg_type).
    procs = [start(empty_dsn, "migrate", "sdcore") for _ in range(4)]
    outputs = [proc.communicate(timeout=90) for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * 4, outputs
    recorded = _bookkeeping(empty_dsn)
    assert len(recorded) == STEPS
    assert len({(c, v) for c, v, _ in recorded}) == STEPS


def test_sqlmigrate_prints_the_step_and_unapplying_is_refused(empty_dsn: str) -> None:
    sql = _ok(manage(empty_dsn, "sqlmigrate", "sdcore", "0002"))
    assert "sdcore lease migration 0002_owner" in sql
    assert 'INSERT INTO "sdcore_migrations"' in sql
    _ok(manage(empty_dsn, "migrate", "sdcore"))
    back = manage(empty_dsn, "migrate", "sdcore", "zero")
    assert back.returncode != 0
    assert "is not reversible" in back.stderr
    assert len(_bookkeeping(empty_dsn)) == STEPS


def test_sqlite_is_refused_at_start_up(empty_dsn: str) -> None:
    env = environment(empty_dsn, SDCORE_DJANGO_ENGINE="django.db.backends.sqlite3")
    result = manage(empty_dsn, "check", env=env)
    assert result.returncode != 0
    assert "sdcore.django needs PostgreSQL" in result.stderr
    assert "django.db.backends.sqlite3" in result.stderr


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"POOL_SIZE": 1}, "SDCORE['POOL_SIZE'] must be an int from 2"),
        ({"RELAY": "yes"}, "SDCORE['RELAY'] must be a bool"),
        ({"REDIS": "redis://x"}, "SDCORE has unknown key(s) 'REDIS'"),
        ({"SCHEMA": "s" * 64}, "SDCORE['SCHEMA']: invalid schema"),
        ({"DATABASE": "other"}, "SDCORE['DATABASE'] is 'other', which is not in DATABASES"),
    ],
    ids=["pool-size", "relay", "unknown-key", "schema", "alias"],
)
def test_bad_settings_name_their_key(empty_dsn: str, extra: dict[str, Any], named: str) -> None:
    env = environment(empty_dsn, SDCORE_DJANGO_EXTRA=json.dumps(extra))
    result = manage(empty_dsn, "check", env=env)
    assert result.returncode != 0
    assert named in result.stderr


def _wait_ready(proc: subprocess.Popen[Any], ready: Path, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.1)


def test_worker_schedules_list_pause_and_sigterm(empty_dsn: str, tmp_path: Path) -> None:
    _ok(manage(empty_dsn, "migrate"))
    ready = tmp_path / "ready"
    env = environment(empty_dsn, SDCORE_DJANGO_TICKS="broken")
    worker = start(empty_dsn, "sdcore", "run", "--ready-file", str(ready), env=env)
    try:
        _wait_ready(worker, ready)
        time.sleep(3)  # a few ticks of both schedules
        listed = _ok(manage(empty_dsn, "sdcore", "schedules", "list", env=env))
        assert "every-second" in listed
        assert "breaks-its-transaction" in listed
        paused = _ok(
            manage(empty_dsn, "sdcore", "schedules", "pause", "every-second", "--reason", "INC-12")
        )
        assert "pause of every-second recorded" in paused
        time.sleep(3)  # the pause reaches the worker within ~2 s
        with psycopg.connect(empty_dsn) as conn:
            before = conn.execute("SELECT count(*) FROM tickapp_tickrow").fetchone()
            time.sleep(2)
            after = conn.execute("SELECT count(*) FROM tickapp_tickrow").fetchone()
            failed = conn.execute(
                "SELECT count(*) FROM job_scheduler WHERE code = 'breaks-its-transaction'"
                " AND status = 'FAIL'"
            ).fetchone()
        assert before == after  # paused
        assert before is not None
        assert before[0] >= 2
        assert failed is not None
        assert failed[0] >= 2
    finally:
        worker.send_signal(signal.SIGTERM)
        out, err = worker.communicate(timeout=10)  # grace period 3 s (project settings)
    assert worker.returncode == 0, err
    assert out.rstrip().endswith("stopped")
    assert not ready.exists()


def test_sigterm_during_start_up_stops_the_worker(empty_dsn: str) -> None:
    _ok(manage(empty_dsn, "migrate"))
    worker = start(empty_dsn, "sdcore", "run", env=environment(empty_dsn, SDCORE_DJANGO_TICKS="1"))
    time.sleep(1.0)  # Django set up, the Runtime starting
    worker.send_signal(signal.SIGTERM)
    worker.communicate(timeout=15)  # gone in time, whatever step it was at
    # Before the worker's handlers are installed SIGTERM ends the process as Python's default
    # does (nothing is held yet); after, the worker stops in order and exits 0.
    assert worker.returncode in (0, -signal.SIGTERM)


RECYCLE = """
from django.db import connection, transaction
from sdcore.django._scheduler import with_connections
from tickapp.models import TickRow

def breaks(tick):
    transaction.set_autocommit(False)
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1/0")
    except Exception:
        pass
    raise RuntimeError("broke it")

def counts(tick):
    return TickRow.objects.count()

wrap = {wrap}
try:
    wrap(breaks)(None)
except RuntimeError:
    pass
print("count", wrap(counts)(None))
"""


@pytest.mark.parametrize("wrapped", [True, False], ids=["recycled", "unwrapped"])
def test_a_handler_that_broke_its_transaction_leaves_a_usable_connection(
    empty_dsn: str, wrapped: bool
) -> None:
    _ok(manage(empty_dsn, "migrate"))
    code = RECYCLE.format(wrap="with_connections" if wrapped else "lambda f: f")
    result = manage(empty_dsn, "shell", "-c", code)
    if wrapped:  # the same thread, the next handler: a fresh connection
        assert "count 0" in _ok(result)
    else:  # what the wrapper prevents: the thread's connection is stuck in a failed transaction
        assert result.returncode != 0
        assert "current transaction is aborted" in result.stderr


def test_a_schema_of_its_own(empty_dsn: str) -> None:
    env = environment(empty_dsn, SDCORE_DJANGO_SCHEMA="sdcore_app")
    _ok(manage(empty_dsn, "migrate", env=env))
    with psycopg.connect(empty_dsn) as conn:
        tables = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'sdcore_app'"
            " ORDER BY 1"
        ).fetchall()
    assert ("job_scheduler",) in tables
    assert ("outbox",) in tables
    assert ("sdcore_schedules",) in tables
    status = _ok(manage(empty_dsn, "sdcore", "db", "status", "--outbox", "--schedules", env=env))
    assert status.count("up to date") == 3


ENQUEUE_RECORDED = """
from django.db import transaction
from sdcore.django import enqueue_once
with transaction.atomic():
    for label in ("a", "b"):
        enqueue_once(idempotency_key=f"rec-{label}", queue="recorded", name="record",
                     payload={"label": label})
with transaction.atomic():
    enqueue_once(idempotency_key="rec-c", queue="recorded", name="record", payload={"label": "c"})
    transaction.set_rollback(True)
"""


@pytest.mark.slow
def test_the_worker_runs_the_processors_the_settings_name(empty_dsn: str) -> None:
    """``SDCORE["PROCESSORS"]`` and ``SDCORE["QUEUE_PREFIX"]``: the worker imports the processor,
    and the committed messages reach it through BullMQ under the prefix (a rolled-back one
    never does)."""
    prefix = f"{{sdcore-test-{uuid.uuid4().hex[:8]}}}"
    extra = {
        "REDIS_URL": REDIS_URL,
        "QUEUE_PREFIX": prefix,
        "PROCESSORS": ["tickapp.processors.Recorder"],
    }
    env = environment(empty_dsn, SDCORE_DJANGO_EXTRA=json.dumps(extra))
    _ok(manage(empty_dsn, "migrate", env=env))
    _ok(manage(empty_dsn, "shell", "-c", ENQUEUE_RECORDED, env=env))
    worker = start(empty_dsn, "sdcore", "run", env=env)
    client = redis.Redis.from_url(REDIS_URL)
    try:
        deadline = time.monotonic() + 30
        while len(_recorded(empty_dsn)) < 2 and time.monotonic() < deadline:
            assert worker.poll() is None, worker.communicate()
            time.sleep(0.2)
        time.sleep(0.5)  # a third run (the rolled-back message, a repeat) would show by now
        assert sorted(_recorded(empty_dsn)) == ["job:a", "job:b"]
        assert client.exists(f"{prefix}:recorded:meta") == 1  # BullMQ's keys under the prefix
    finally:
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=30)
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()
    assert worker.returncode == 0, err


def _recorded(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT schedule FROM tickapp_tickrow WHERE schedule LIKE 'job:%'"
        ).fetchall()
    return [str(row[0]) for row in rows]


CALL_COMMAND = """
import io, json
from django.core.management import call_command
from django.core.management.base import CommandError
out, err = io.StringIO(), io.StringIO()
call_command("sdcore", "db", "status", stdout=out, stderr=err)
failed = io.StringIO()
try:
    call_command("sdcore", "schedules", "pause", "no-such-schedule", stdout=io.StringIO(),
                 stderr=failed)
except CommandError as exc:
    code = exc.returncode
print(json.dumps({"out": out.getvalue(), "failed": failed.getvalue(), "code": code}))
"""


def test_call_command_writes_to_the_streams_it_is_given(empty_dsn: str) -> None:
    _ok(manage(empty_dsn, "migrate"))
    done = _ok(manage(empty_dsn, "shell", "-c", CALL_COMMAND))
    found = json.loads(done.strip().splitlines()[-1])
    assert "0001_initial" in found["out"]  # the status, in the buffer given
    assert "applied" in found["out"]
    assert "no-such-schedule" in found["failed"]
    assert found["code"] != 0
