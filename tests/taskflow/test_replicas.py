"""Three real TaskFlow processes on one database, a per-second ``mark-overdue-tasks``.

Started through ``python -m taskflow.replicas`` (which runs ``python -m taskflow`` three times
under uvicorn on consecutive ports). For ~6 s every replica fires every tick; the assertions
read what happened from PostgreSQL: one ``SUCCESS`` lease row per tick, one ledger row per tick
(``overdue_runs`` has no unique key, so a second execution would show), no tick missing while
all three ran, and each seeded overdue task marked exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.ext.asyncio import create_async_engine
from taskflow.clock import business_day, utc_now
from taskflow.db import Project, Task, TaskStatus, User, create_schema, session_factory
from taskflow.overdue import SCHEDULE

from sdcore.scheduling import format_run_key
from tests.taskflow._support import EXAMPLE, SECRET

REPLICAS = 3
RUN_SECONDS = 6.0
READY = re.compile(r"replica-(\d+): (http://\S+) \(pid (\d+)\)")


def _free_ports(count: int) -> int:
    """A base port with ``count`` consecutive free ports after it."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        if base + count > 65535:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no consecutive free ports")


async def _seed(database_url: str) -> dict[str, uuid.UUID]:
    """Tables, one project, and tasks around *today in Paris* (the replicas' real clock)."""
    engine = create_async_engine(database_url.replace("postgresql://", "postgresql+psycopg://"))
    today = business_day(utc_now())
    specs = {
        "late-todo": (TaskStatus.TODO, today - timedelta(days=3), False),
        "late-in-progress": (TaskStatus.IN_PROGRESS, today - timedelta(days=1), False),
        "due-today": (TaskStatus.TODO, today, False),
        "late-done": (TaskStatus.DONE, today - timedelta(days=3), False),
        "late-archived": (TaskStatus.TODO, today - timedelta(days=3), True),
    }
    try:
        await create_schema(engine)
        sessions = session_factory(engine)
        async with sessions() as session, session.begin():
            owner = uuid.uuid4()
            session.add(User(id=owner, email="owner@example.com"))
            await session.flush()
            project = Project(id=uuid.uuid4(), name="P", owner_id=owner)
            session.add(project)
            await session.flush()
            ids = {name: uuid.uuid4() for name in specs}
            session.add_all(
                Task(
                    id=ids[name],
                    project_id=project.id,
                    title=name,
                    status=status,
                    due_date=due,
                    archived=archived,
                    version=0,
                )
                for name, (status, due, archived) in specs.items()
            )
    finally:
        await engine.dispose()
    return ids


def _reader(stream: object, lines: queue.Queue[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.put(line.rstrip("\n"))


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_three_replicas_run_each_tick_exactly_once(
    database_url: str, pg_dsn: str, tmp_path: Path
) -> None:
    ids = asyncio.run(_seed(database_url))
    base = _free_ports(REPLICAS)
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("REDIS_URL", "TASKFLOW_REPLICA_NAME")
    }
    env.update(
        {
            "DATABASE_URL": database_url,
            "TASKFLOW_JWT_SECRET": SECRET,
            "TASKFLOW_OVERDUE_CRON": "* * * * * *",
            # Catch-up on too: each replica, at start, runs the latest tick nobody ran.
            "TASKFLOW_OVERDUE_CATCH_UP_MS": "5000",
            "PYTHONPATH": os.pathsep.join([str(EXAMPLE), env.get("PYTHONPATH", "")]),
        }
    )
    log = tmp_path / "replicas.log"
    command = [sys.executable, "-m", "taskflow.replicas", "--replicas", str(REPLICAS)]
    command += ["--port", str(base), "--database-url", database_url]
    pids: list[int] = []
    with log.open("w") as stderr:
        runner = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
        lines: queue.Queue[str] = queue.Queue()
        assert runner.stdout is not None
        reader = threading.Thread(target=_reader, args=(runner.stdout, lines), daemon=True)
        reader.start()
        try:
            urls: dict[int, str] = {}
            deadline = time.monotonic() + 60
            while True:
                try:
                    line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    pytest.fail(f"the replicas did not start:\n{log.read_text()[-4000:]}")
                if match := READY.match(line):
                    urls[int(match[1])] = match[2]
                    pids.append(int(match[3]))
                if "replica(s) ready" in line:
                    break
            assert sorted(urls) == [1, 2, 3]
            assert len(set(urls.values())) == REPLICAS
            ready_at = datetime.now(UTC)
            time.sleep(RUN_SECONDS)
            stop_at = datetime.now(UTC)
            runner.send_signal(signal.SIGTERM)
            assert runner.wait(40) == 0
        finally:
            if runner.poll() is None:
                os.killpg(runner.pid, signal.SIGKILL)
                runner.wait(10)
            for pid in pids:
                _kill(pid)
            reader.join(10)  # EOF once the runner and its replicas are gone
            runner.stdout.close()
    output = log.read_text()
    for number in range(1, REPLICAS + 1):
        assert re.search(rf"\[replica-{number}\] sdcore\.fastapi: sdcore started", output), output

    with psycopg.connect(pg_dsn) as conn:
        leases = conn.execute(
            "SELECT run_key, status FROM job_scheduler WHERE code = %s", (SCHEDULE,)
        ).fetchall()
        ledger = conn.execute("SELECT run_key, replica, marked FROM overdue_runs").fetchall()
        rows = conn.execute("SELECT title, status || ':' || version FROM tasks").fetchall()
    tasks: dict[str, str] = dict(rows)

    # Exactly once: one lease row and one execution per tick, and they are the same ticks.
    ran = [run_key for run_key, _, _ in ledger]
    assert len(ran) == len(set(ran)), sorted(ran)
    assert {status for _, status in leases} == {"SUCCESS"}
    assert sorted(ran) == sorted(run_key for run_key, _ in leases)
    # Every tick while the three replicas ran was run (one second of margin at both ends).
    first = datetime.fromtimestamp(math.ceil(ready_at.timestamp()) + 1, UTC)
    expected = {
        format_run_key(first + timedelta(seconds=n))
        for n in range(int((stop_at - first).total_seconds()))
    }
    assert len(expected) >= RUN_SECONDS - 2
    assert expected <= set(ran), sorted(expected - set(ran))
    # The seeded overdue tasks were marked once in all (version 1), nothing else was touched.
    assert sum(marked for _, _, marked in ledger) == 2
    assert tasks == {
        "late-todo": "OVERDUE:1",
        "late-in-progress": "OVERDUE:1",
        "due-today": "TODO:0",
        "late-done": "DONE:0",
        "late-archived": "TODO:0",
    }
    assert set(ids) == set(tasks)
    replicas = {replica for _, replica, _ in ledger}
    assert replicas <= {f"replica-{n}" for n in range(1, REPLICAS + 1)}
