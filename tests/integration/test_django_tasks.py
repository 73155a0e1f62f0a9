"""``sdcore.django.tasks.SdcoreBackend`` (Django 6) against real PostgreSQL, Redis and real
``manage.py sdcore run`` workers (``tests/django_project/taskapp``): enqueue in a committed, a
rolled-back and no transaction, a schedule's ``enqueue_on_tick``, two workers running each task
once, ``get_result``, priority order and ``run_after``, and the refusals without Redis.

Django 6 needs Python 3.12: tests/integration/test_django6.py runs this module in a second venv
(``.venv-django6``); in the main venv (Django 5.2) only the import refusal runs here.
"""

from __future__ import annotations

import importlib
import json
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import django
import psycopg
import pytest
import redis

from tests.conftest import REDIS_URL
from tests.django_project.harness import environment, manage, start

DJANGO_6 = django.VERSION >= (6, 0)
needs_django_6 = pytest.mark.skipif(
    not DJANGO_6,
    reason="django.tasks needs Django 6: tests/integration/test_django6.py runs it (Python 3.12)",
)
WAIT_S = 30

ENQUEUE = r"""
import asyncio
import json
from django.db import transaction
from django.tasks import task
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from taskapp.tasks import fail, record, record_async, record_context

out = {}


@task
def in_the_shell(label):  # its module path does not import: no worker could find it
    return label


try:
    in_the_shell.enqueue("in-the-shell")
except InvalidTask as exc:
    out["unimportable"] = str(exc)
with transaction.atomic():
    out["committed"] = record.enqueue("committed").id
try:
    with transaction.atomic():
        out["rolled_back"] = record.enqueue("rolled-back").id
        raise RuntimeError("the view failed")
except RuntimeError:
    pass
out["autocommit"] = record.enqueue("autocommit").id
out["context"] = record_context.enqueue("context").id
out["async"] = record_async.enqueue("async").id
out["aenqueued"] = asyncio.run(record.aenqueue("aenqueued")).id
out["failing"] = fail.enqueue("failing").id
with transaction.atomic():
    try:
        record.enqueue(object())
    except TypeError:
        out["refused"] = True
    out["after_refused"] = record.enqueue("after-refused").id  # the block is still usable
out["status"] = str(record.get_result(out["committed"]).status)
try:
    record.get_result(out["rolled_back"])
    out["rolled_back_found"] = True
except TaskResultDoesNotExist:
    out["rolled_back_found"] = False
print(json.dumps(out))
"""

RESULTS = r"""
import json
from django.tasks import default_task_backend
ids = json.loads(%r)
out = {}
for name, result_id in ids.items():
    r = default_task_backend.get_result(result_id)
    out[name] = {
        "status": str(r.status),
        "value": r.return_value if r.status == "SUCCESSFUL" else None,
        "errors": [e.exception_class_path for e in r.errors],
        "attempts": r.attempts,
        "finished": r.finished_at is not None,
    }
print(json.dumps(out))
"""


@pytest.fixture
def queue_prefix() -> Iterator[str]:
    """The BullMQ queue prefix of one test; its queues are deleted afterwards."""
    prefix = f"sdcore-test-tasks-{uuid.uuid4().hex[:10]}."
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"bull:{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def _env(dsn: str, prefix: str, **extra: str) -> dict[str, str]:
    return environment(
        dsn,
        SDCORE_DJANGO_TASKS=prefix,
        SDCORE_DJANGO_EXTRA=json.dumps({"REDIS_URL": REDIS_URL}),
        **extra,
    )


def _shell(dsn: str, env: dict[str, str], script: str) -> Any:
    done = manage(dsn, "shell", "-c", script, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _runs(dsn: str) -> list[tuple[str, int]]:
    with psycopg.connect(dsn) as conn:
        return [
            (str(label), int(attempt))
            for label, attempt in conn.execute(
                "SELECT label, attempt FROM taskapp_taskrun ORDER BY id"
            ).fetchall()
        ]


def _wait_for(
    dsn: str, done: Callable[[list[str]], bool], workers: list[subprocess.Popen[Any]]
) -> None:
    """Wait until ``done(labels of the runs so far)`` (at most ``WAIT_S``), the workers alive."""
    deadline = time.monotonic() + WAIT_S
    while not done([label for label, _ in _runs(dsn)]) and time.monotonic() < deadline:
        assert [w.poll() for w in workers] == [None] * len(workers), [
            w.communicate() for w in workers
        ]
        time.sleep(0.2)


def _ticks(labels: list[str]) -> list[str]:
    return [label for label in labels if label.startswith("tick-")]


def _stop(workers: list[subprocess.Popen[Any]]) -> list[tuple[str, str]]:
    for worker in workers:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
    outputs = [worker.communicate(timeout=15) for worker in workers]
    assert [w.returncode for w in workers] == [0] * len(workers), outputs
    return outputs


@needs_django_6
@pytest.mark.postgres
@pytest.mark.slow
def test_tasks_and_a_schedules_tasks_run_once_each_with_two_workers(
    empty_dsn: str, queue_prefix: str
) -> None:
    """Enqueued in committed, rolled-back and no transactions, and by a per-second schedule
    (``enqueue_on_tick``): two workers run each committed task once, the others never."""
    env = _env(empty_dsn, queue_prefix, SDCORE_DJANGO_TASK_TICKS="1")
    migrated = manage(empty_dsn, "migrate", env=env)
    assert migrated.returncode == 0, migrated.stderr
    ids = _shell(empty_dsn, env, ENQUEUE)
    assert ids["status"] == "READY"
    assert ids["rolled_back_found"] is False
    with psycopg.connect(empty_dsn) as conn:
        rows: dict[str, dict[str, Any]] = dict(
            conn.execute(
                "SELECT payload->>'id', options FROM outbox WHERE idempotency_key LIKE"
                " 'django-task:%'"
            ).fetchall()
        )
    assert ids["refused"] is True
    assert "in_the_shell' does not import by that path" in ids["unimportable"]
    enqueued = (
        "committed",
        "autocommit",
        "context",
        "async",
        "aenqueued",
        "failing",
        "after_refused",
    )
    assert set(rows) == {ids[k] for k in enqueued}
    assert rows[ids["context"]]["priority"] == 51  # Django's 50, BullMQ's lower-first
    assert rows[ids["committed"]]["priority"] == 101

    workers = [start(empty_dsn, "sdcore", "run", env=env) for _ in "ab"]
    try:
        _wait_for(
            empty_dsn,
            lambda labels: len(labels) - len(_ticks(labels)) >= 6 and len(_ticks(labels)) >= 3,
            workers,
        )
        time.sleep(1)  # a second run of any task would show by now
        results = _shell(
            empty_dsn,
            env,
            RESULTS
            % json.dumps({k: ids[k] for k in ("committed", "autocommit", "context", "failing")}),
        )
    finally:
        _stop(workers)
    runs = _runs(empty_dsn)
    ticks = _ticks([label for label, _ in runs])
    assert len(ticks) >= 3
    assert len(set(ticks)) == len(ticks), f"a tick's task ran twice: {ticks}"
    assert sorted(label for label, _ in runs if not label.startswith("tick-")) == [
        "aenqueued",
        "after-refused",
        "async",
        "autocommit",
        "committed",
        "context",
    ]
    assert ("context", 1) in runs
    assert results["committed"] == {
        "status": "SUCCESSFUL",
        "value": "committed",
        "errors": [],
        "attempts": 1,
        "finished": True,
    }
    assert results["context"]["value"] == {"id": ids["context"], "attempt": 1}
    assert results["failing"]["status"] == "FAILED"
    assert results["failing"]["errors"] == ["builtins.ValueError"]


ORDERED = r"""
import json
from datetime import timedelta
from django.utils import timezone
from taskapp.tasks import record

later = timezone.now() + timedelta(seconds=2)
out = {"later": record.using(run_after=later).enqueue("later").id, "run_after": later.isoformat()}
for priority in (-10, 0, 90, 10):
    record.using(priority=priority).enqueue(f"priority {priority}")
print(json.dumps(out))
"""

STARTED = r"""
from django.tasks import default_task_backend
print(default_task_backend.get_result(%r).started_at.isoformat())
"""


@needs_django_6
@pytest.mark.postgres
@pytest.mark.slow
def test_priority_orders_a_queue_and_run_after_defers(empty_dsn: str, queue_prefix: str) -> None:
    env = _env(empty_dsn, queue_prefix, SDCORE_DJANGO_TASKS_CONCURRENCY="1")
    migrated = manage(empty_dsn, "migrate", env=env)
    assert migrated.returncode == 0, migrated.stderr
    enqueued = _shell(empty_dsn, env, ORDERED)
    workers = [start(empty_dsn, "sdcore", "run", env=env)]
    try:
        _wait_for(empty_dsn, lambda labels: len(labels) >= 5, workers)
    finally:
        _stop(workers)
    labels = [label for label, _ in _runs(empty_dsn)]
    assert labels == ["priority 90", "priority 10", "priority 0", "priority -10", "later"]
    started = manage(empty_dsn, "shell", "-c", STARTED % enqueued["later"], env=env)
    assert started.returncode == 0, started.stderr
    assert started.stdout.strip().splitlines()[-1] >= enqueued["run_after"]


STALLED = r"""
import json
from django.tasks import default_task_backend
from sdcore.django.tasks import _from_job
from taskapp.tasks import record

result = default_task_backend.enqueue(record, ["stalled"], {})
# A job whose first worker died mid-task and that a second worker then finished.
job = {"ats": "2", "atm": "1", "processedOn": "1700000000000", "finishedOn": "1700000001000",
       "returnvalue": '"stalled"'}
done = _from_job(result, job)
running = _from_job(result, {"ats": "1", "atm": "0", "processedOn": "1700000000000"})
print(json.dumps([str(done.status), done.attempts, str(running.status), running.attempts]))
"""


@needs_django_6
@pytest.mark.postgres
def test_a_task_run_again_after_a_stall_counts_both_attempts(
    empty_dsn: str, queue_prefix: str
) -> None:
    env = _env(empty_dsn, queue_prefix)
    migrated = manage(empty_dsn, "migrate", env=env)
    assert migrated.returncode == 0, migrated.stderr
    assert _shell(empty_dsn, env, STALLED) == ["SUCCESSFUL", 2, "RUNNING", 1]


@needs_django_6
@pytest.mark.postgres
def test_without_redis_the_worker_refuses_and_check_warns(
    empty_dsn: str, queue_prefix: str
) -> None:
    env = environment(empty_dsn, SDCORE_DJANGO_TASKS=queue_prefix)
    checked = manage(empty_dsn, "check", env=env)
    assert checked.returncode == 0, checked.stderr
    assert "sdcore.W001" in checked.stderr
    run = manage(empty_dsn, "sdcore", "run", env=env)
    assert run.returncode != 0
    assert "set SDCORE['REDIS_URL']" in run.stderr


@pytest.mark.skipif(DJANGO_6, reason="the refusal is for Django before 6")
def test_importing_the_backend_on_django_5_names_django_6() -> None:
    with pytest.raises(ImportError, match=r"Django 6\.0 added: this is Django 5\."):
        importlib.import_module("sdcore.django.tasks")
