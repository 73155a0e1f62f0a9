"""TaskFlow in Django (``examples/taskflow_django``) against real PostgreSQL and Redis.

The README's walk-through runs as written (migrate, the worker, the web server, a task, a
``PATCH`` with curl, the overdue job triggered), with and without Redis; then the paths it does
not show: a rolled-back change leaves no task change, no outbox row and no event; the overdue
job through a triggered tick on two workers runs once. Every test has its own database and, with
Redis, its own queue name on the shared server (its keys deleted afterwards).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from tests.django_project.harness import manage, start

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "taskflow_django"
REDIS_URL = os.environ.get("SDCORE_TEST_REDIS_URL", "redis://127.0.0.1:6379")
WAIT_S = 20.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Site:
    """One test's TaskFlow: its database, its environment (with or without Redis)."""

    dsn: str
    env: dict[str, str]
    queue: str | None

    def manage(self, *args: str) -> str:
        result = manage(self.dsn, *args, env=self.env, project=EXAMPLE)
        assert result.returncode == 0, (result.stdout, result.stderr)
        return result.stdout + result.stderr

    def start(self, *args: str) -> subprocess.Popen[Any]:
        return start(self.dsn, *args, env=self.env, project=EXAMPLE)

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn) as conn:
            return list(conn.execute(sql).fetchall())


def _environment(dsn: str, queue: str | None) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE", "TASKFLOW_OVERDUE_CRON"):
        env.pop(name, None)
    env["PYTHONPATH"] = str(ROOT / "src")
    env["DATABASE_URL"] = dsn
    if queue is not None:
        env["REDIS_URL"] = REDIS_URL
        env["TASKFLOW_NOTIFY_QUEUE"] = queue
    return env


@pytest.fixture(params=["redis", "no-redis"])
def site(request: pytest.FixtureRequest, empty_dsn: str) -> Iterator[Site]:
    """TaskFlow on a fresh database, with Redis (a queue of its own) or without."""
    if request.param == "no-redis":
        yield Site(dsn=empty_dsn, env=_environment(empty_dsn, None), queue=None)
        return
    queue = f"taskflow-django-{uuid.uuid4().hex[:12]}"
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as exc:
        client.close()
        pytest.fail(f"Redis is not reachable at {REDIS_URL} ({exc})", pytrace=False)
    try:
        yield Site(dsn=empty_dsn, env=_environment(empty_dsn, queue), queue=queue)
    finally:
        keys = list(client.scan_iter(match=f"bull:{queue}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def _eventually(check: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"after {WAIT_S} s: {what}")
        time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass(frozen=True, slots=True, kw_only=True)
class Line:
    """One ``$`` line of the README's walk-through and the output printed under it."""

    command: str
    expected: list[str]


def walkthrough() -> list[Line]:
    """The README's first ```console block, as commands and their shown output."""
    text = (EXAMPLE / "README.md").read_text(encoding="utf-8")
    block = re.search(r"^```console\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)
    assert block is not None, "the README has no ```console block"
    lines: list[Line] = []
    for raw in block[1].splitlines():
        if raw.startswith("$ "):
            lines.append(Line(command=raw[2:], expected=[]))
        else:
            lines[-1].expected.append(raw)
    return lines


def test_the_walkthrough_parses_as_the_test_runs_it() -> None:
    commands = [line.command.split()[0] for line in walkthrough()]
    assert commands == ["export", "export", *["python"] * 4, "curl", "python"]


def test_readme_walkthrough_runs_as_written(site: Site, tmp_path: Path) -> None:
    """Each line in a shell's way: ``export`` sets the environment (the test's database and
    Redis stand in for the README's), ``&`` starts it in the background, the shown output must
    match; ``python`` is this interpreter and the port a free one."""
    env = dict(site.env)
    port = str(_free_port())
    background: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for index, line in enumerate(walkthrough()):
            words = shlex.split(line.command, comments=True)
            if words[0] == "export":
                name = words[1].partition("=")[0]
                if name not in site.env:
                    assert name == "REDIS_URL", line.command
                continue
            words = [sys.executable if w == "python" else w.replace("8000", port) for w in words]
            if words[-1] == "&":
                log = tmp_path / f"background-{index}.log"
                with log.open("wb") as out:
                    proc = subprocess.Popen(
                        words[:-1],
                        cwd=EXAMPLE,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                background.append((proc, log))
                if "runserver" in words:
                    _eventually(lambda: _listening(int(port)), f"runserver on port {port}")
                else:
                    _eventually(lambda: "ready:" in background[-1][1].read_text(), "worker ready")
                continue
            result = subprocess.run(
                words, cwd=EXAMPLE, env=env, capture_output=True, text=True, timeout=60, check=False
            )
            assert result.returncode == 0, (line.command, result.stdout, result.stderr)
            if line.expected:
                assert result.stdout.strip().splitlines() == line.expected, line.command
        _eventually(
            lambda: site.query("SELECT status FROM tasks_task WHERE id = 1") == [("OVERDUE",)],
            "the triggered tick marks task 1 OVERDUE",
        )
        worker_log, server_log = background[0][1], background[1][1]
        _eventually(
            lambda: "1 task(s) marked OVERDUE" in worker_log.read_text(), "the worker's log line"
        )
        if site.queue is None:
            assert "[simulated email] task 1: TODO -> IN_PROGRESS" in server_log.read_text()
            assert site.query("SELECT count(*) FROM outbox") == [(0,)]
        else:
            sent = _eventually(
                lambda: site.query("SELECT recipient, status, attempt FROM tasks_sentemail"),
                "the processor records the e-mail",
            )
            assert sent == [("ada@example.com", "IN_PROGRESS", 1)]
            published = site.query("SELECT idempotency_key, queue, status FROM outbox")
            assert published == [("task-status-changed:1:v1", site.queue, "PUBLISHED")]
            assert "Email to ada@example.com: task 1 is now IN_PROGRESS" in worker_log.read_text()
            assert "[simulated email]" not in server_log.read_text()
    finally:
        for proc, _ in reversed(background):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert background[0][0].returncode == 0, background[0][1].read_text()  # SIGTERM: clean stop


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


# Run in ``manage.py shell``: the view through Django's test client, and a change rolled back by
# an outer transaction (as ``ATOMIC_REQUESTS`` or a caller's ``atomic()`` would).
CHANGES = r"""
import json
from django.db import transaction
from django.test import Client
from tasks.models import Task
from tasks.service import change_status

out = {}
client = Client()
task = Task.objects.create(title="t", owner_email="ada@example.com")
try:
    with transaction.atomic():
        change_status(task.pk, "DONE")
        raise RuntimeError("the caller failed after the change")
except RuntimeError:
    pass
task.refresh_from_db()
out["after_rollback"] = [task.status, task.version]

def patch(task_id, body):
    response = client.patch(f"/tasks/{task_id}/status", body, content_type="application/json")
    return [response.status_code, json.loads(response.content)]

out["done"] = patch(task.pk, json.dumps({"status": "DONE"}))
out["same"] = patch(task.pk, json.dumps({"status": "DONE"}))
out["overdue"] = patch(task.pk, json.dumps({"status": "OVERDUE"}))
out["not_json"] = patch(task.pk, b"\xff")
out["no_status"] = patch(task.pk, json.dumps({"state": "DONE"}))
out["unknown"] = patch(task.pk + 1000, json.dumps({"status": "DONE"}))
out["get"] = client.get(f"/tasks/{task.pk}/status").status_code

# The processor's step, as BullMQ would call it: a repeated delivery, a deleted task.
from tasks.processors import record_email
email = {"recipient": "ada@example.com", "status": "DONE", "attempt": 1}
out["deliveries"] = [
    record_email(job_id="j1", task_id=task.pk, **email),
    record_email(job_id="j1", task_id=task.pk, **{**email, "attempt": 2}),
    record_email(job_id="j2", task_id=task.pk + 1000, **email),
]
print("RESULT", json.dumps(out))
"""


def test_a_rolled_back_change_leaves_nothing_and_the_view_answers(site: Site) -> None:
    site.manage("migrate", "-v", "0")
    printed = site.manage("shell", "-c", CHANGES)
    line = next(line for line in printed.splitlines() if line.startswith("RESULT "))
    out = json.loads(line.removeprefix("RESULT "))
    assert out["after_rollback"] == ["TODO", 0]
    assert out["done"] == [200, {"id": 1, "status": "DONE", "version": 1}]
    assert out["same"] == [200, {"id": 1, "status": "DONE", "version": 1}]
    assert out["overdue"][0] == 422
    assert "got 'OVERDUE'" in out["overdue"][1]["detail"]
    assert out["not_json"] == [422, {"status": 422, "detail": "the body must be JSON"}]
    assert out["no_status"][0] == 422
    assert out["unknown"] == [404, {"status": 404, "detail": "task 1001 not found"}]
    assert out["get"] == 405
    assert out["deliveries"] == [True, False, False]
    assert site.query("SELECT job_id, attempt FROM tasks_sentemail") == [("j1", 1)]
    # One event, for the one committed change: none for the rollback, none for "same".
    emails = [line for line in printed.splitlines() if "[simulated email]" in line]
    keys = site.query("SELECT idempotency_key FROM outbox")
    if site.queue is None:
        assert emails == ["[simulated email] task 1: TODO -> DONE"]
        assert keys == []
    else:
        assert emails == []
        assert keys == [("task-status-changed:1:v1",)]


OVERDUE_SEED = [
    ("late", "TODO", "2020-01-01", "OVERDUE", 1),
    ("late, in progress", "IN_PROGRESS", "2020-01-01", "OVERDUE", 1),
    ("late but done", "DONE", "2020-01-01", "DONE", 0),
    ("due in 2100", "TODO", "2100-01-01", "TODO", 0),
    ("no due date", "TODO", None, "TODO", 0),
]


def test_the_overdue_job_through_a_triggered_tick_runs_once_on_two_workers(
    empty_dsn: str, tmp_path: Path
) -> None:
    site = Site(dsn=empty_dsn, env=_environment(empty_dsn, None), queue=None)
    site.manage("migrate", "-v", "0")
    with psycopg.connect(empty_dsn) as conn:
        for title, status, due, _, _ in OVERDUE_SEED:
            conn.execute(
                "INSERT INTO tasks_task (title, owner_email, status, due_date, version)"
                " VALUES (%s, 'ada@example.com', %s, %s, 0)",
                (title, status, due),
            )
    ready = [tmp_path / "ready-a", tmp_path / "ready-b"]
    workers = [site.start("sdcore", "run", "--ready-file", str(path)) for path in ready]
    try:
        _eventually(lambda: all(path.exists() for path in ready), "both workers ready")
        triggered = site.manage(
            "sdcore", "schedules", "trigger", "mark-overdue-tasks", "--reason", "test"
        )
        assert "mark-overdue-tasks" in triggered
        _eventually(
            lambda: (
                site.query(
                    "SELECT count(*) FROM job_scheduler"
                    " WHERE code = 'mark-overdue-tasks' AND status = 'SUCCESS'"
                )
                == [(1,)]
            ),
            "one successful run of mark-overdue-tasks",
        )
        time.sleep(1)  # a second run, if the other worker also ran the tick, would show now
    finally:
        outputs = []
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
            outputs.append(worker.communicate(timeout=15)[1])
    runs = site.query("SELECT status FROM job_scheduler WHERE code = 'mark-overdue-tasks'")
    assert runs == [("SUCCESS",)]
    found = site.query("SELECT title, status, version FROM tasks_task ORDER BY id")
    assert found == [(title, after, version) for title, _, _, after, version in OVERDUE_SEED]
    marked = [out.count("2 task(s) marked OVERDUE") for out in outputs]
    assert sorted(marked) == [0, 1], outputs
