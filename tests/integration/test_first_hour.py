"""What a new user meets in the first hour: the dashboard's missed ticks, the CLI's messages."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from sdcore import Runtime
from sdcore.dashboard._data import DashboardData
from sdcore.queues import Job, Processor
from sdcore.scheduling import PostgresScheduleStore, ScheduleAdmin
from tests import conftest
from tests._servers import own_postgres
from tests.integration._redis_prefix import REDIS_URL, redis_prefix

RUNS = (
    "INSERT INTO sdcore_schedules_runs (schedule, run_key, source, scheduled_at, attempt,"
    " fencing_token, replica_id, host, pid, started_at, finished_at, status)"
    " VALUES (%s, %s, %s, %s, 1, 1, %s, 'replica-a', 4242, %s, %s, 'SUCCESS')"
)


async def _timeline_missed(dsn: str, name: str) -> int:
    async with AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False) as pool:
        data = DashboardData(pool, store=PostgresScheduleStore(pool))
        row = await data.schedule(name)
    assert row is not None
    return row.missed


@pytest.mark.parametrize(
    ("kind", "expression", "step_s", "stale_step_s"),
    [
        pytest.param("interval", "2000", 2, 1, id="interval"),
        pytest.param("cron", "*/2 * * * * *", 2, 1, id="cron"),
    ],
)
async def test_the_timeline_counts_ticks_paused_as_missed_beside_backfills_and_fresh_ticks(
    schema_dsn: str, kind: str, expression: str, step_s: int, stale_step_s: int
) -> None:
    """N ticks skipped by a pause are N missed ticks, whatever else ran in the same hours.

    Every other tick of the last 90 minutes succeeded, including those of the last minute (not
    yet judged), ticks backfilled from before the schedule existed, and ticks of an earlier
    expression that fired on every second: none of them is an expected tick, so none may cancel
    a miss.
    """
    name = f"every-{kind}"
    now = datetime.now(UTC).replace(microsecond=0)
    created = now - timedelta(minutes=90)
    created -= timedelta(seconds=created.second % step_s)
    paused_from = now - timedelta(minutes=45)
    paused_from -= timedelta(seconds=paused_from.second % step_s)
    paused = 22
    skipped = {paused_from + timedelta(seconds=step_s * i) for i in range(paused)}
    rows: list[tuple[object, ...]] = []

    def ran(at: datetime, source: str) -> None:
        key = at.strftime("%Y-%m-%dT%H:%M:%SZ")
        rows.append((name, key, source, at, uuid.uuid4(), at, at + timedelta(milliseconds=5)))

    at = created
    while at < now:
        if at not in skipped:
            ran(at, "tick")
        at += timedelta(seconds=step_s)
    for i in range(1, 120):  # backfilled ticks from before the schedule existed
        ran(created - timedelta(seconds=step_s * i), "backfill")
    at = created + timedelta(seconds=stale_step_s)
    while at < now:  # the odd seconds of an earlier, every-second definition
        if (at - created).total_seconds() % step_s:
            ran(at, "tick")
        at += timedelta(seconds=stale_step_s)
    async with await psycopg.AsyncConnection.connect(schema_dsn, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO sdcore_schedules (name, kind, expression, fingerprint, created_at)"
            " VALUES (%s, %s, %s, 'f', %s)",
            (name, kind, expression, created),
        )
        async with conn.cursor() as cur:
            await cur.executemany(RUNS, rows)
    assert await _timeline_missed(schema_dsn, name) == paused


async def _skip_rows(dsn: str, name: str, where: str = "data ? 'skipped'") -> int:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            f"SELECT count(*) FROM job_scheduler WHERE code = %s AND {where}",
            (name,),
        )
        row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def test_a_paused_tick_is_counted_once_across_the_replicas(schema_dsn: str) -> None:
    """Two replicas fire every paused tick; the summed ``skipped_pause`` counter counts it once.

    The monitoring how-to sums per-replica counters, so each skipped tick must be counted by
    one replica only: the one whose skip row was written.
    """
    name = "every-second-paused"
    replicas = [
        Runtime(database_url=schema_dsn, grace_period_ms=200, relay=None, metrics=True)
        for _ in range(2)
    ]
    for runtime in replicas:
        runtime.scheduler.add_interval(name, 1_000, lambda tick: None)
    async with replicas[0], replicas[1]:
        admin = ScheduleAdmin(PostgresScheduleStore(replicas[0].pool))
        await _eventually(lambda: _declared_by(admin, name, 2))
        await admin.pause(name, actor="ops", reason="first-hour test")

        async def enough() -> bool:
            return await _skip_rows(schema_dsn, name) >= 4

        await _eventually(enough)
    skipped = await _skip_rows(schema_dsn, name)
    counted = []
    for runtime in replicas:
        assert runtime.metrics is not None
        sample = runtime.metrics.registry.get_sample_value(
            "sdcore_schedule_runs_total", {"schedule": name, "outcome": "skipped_pause"}
        )
        counted.append(int(sample or 0))
    assert sum(counted) == skipped, f"per replica {counted}, skip rows {skipped}"


async def _declared_by(admin: ScheduleAdmin, name: str, replicas: int) -> bool:
    found = {s.name: s for s in await admin.list_schedules()}.get(name)
    return found is not None and len(found.replicas) >= replicas


async def _eventually(predicate: Callable[[], Awaitable[bool]], timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.1)


NIGHTLY = """
import asyncio
import os
import pathlib

from sdcore import Runtime

runtime = Runtime(database_url=os.environ["FIRST_HOUR_DSN"], relay=None)


@runtime.scheduler.interval(1_000, name="nightly-report")
async def nightly(tick):
    return None


async def main():
    pathlib.Path("started").write_text("the program ran")
    async with runtime:
        await asyncio.sleep(3600)
"""


def _cli(cwd: Path, dsn: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FIRST_HOUR_DSN": dsn, "DATABASE_URL": dsn}
    try:
        return subprocess.run(
            [sys.executable, "-m", "sdcore.cli", *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"`sdcore {' '.join(args)}` still ran after {timeout} s: {exc.stdout!r}")


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(("schedules", "list", "--app", "nightly:runtime"), id="schedules-list"),
        pytest.param(("run", "nightly:runtime"), id="run"),
    ],
)
def test_app_refuses_a_module_that_starts_its_program_when_imported(
    schema_dsn: str, tmp_path: Path, command: tuple[str, ...]
) -> None:
    """A script with a top-level ``asyncio.run(main())`` is refused before anything starts."""
    (tmp_path / "nightly.py").write_text(NIGHTLY + "\nasyncio.run(main())\n")
    done = _cli(tmp_path, schema_dsn, *command, timeout=30)
    assert done.returncode == 1, done
    assert "importing nightly starts its program (asyncio.run() at nightly.py:" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr
    assert not (tmp_path / "started").exists(), "the program ran inside the CLI"
    assert "never awaited" not in done.stderr


def test_app_takes_a_runtime_and_a_guarded_script(schema_dsn: str, tmp_path: Path) -> None:
    (tmp_path / "nightly.py").write_text(
        NIGHTLY + '\nif __name__ == "__main__":\n    asyncio.run(main())\n'
    )
    done = _cli(tmp_path, schema_dsn, "schedules", "list", "--app", "nightly:runtime", "--json")
    assert done.returncode == 0, done
    assert [json.loads(line)["name"] for line in done.stdout.splitlines()] == ["nightly-report"]
    assert not (tmp_path / "started").exists()


async def test_missed_works_from_the_database_and_says_why(schema_dsn: str, tmp_path: Path) -> None:
    """``missed NAME`` reads the stored definition (no --app, no --since) and names the pause."""
    name = "every-second-missed"
    runtime = Runtime(database_url=schema_dsn, grace_period_ms=200, relay=None)
    runtime.scheduler.add_interval(name, 1_000, lambda tick: None)
    async with runtime:
        admin = ScheduleAdmin(PostgresScheduleStore(runtime.pool))
        await _eventually(lambda: _declared_by(admin, name, 1))

        async def ran() -> bool:  # the default window starts at the first recorded run
            return await _skip_rows(schema_dsn, name, "status = 'SUCCESS'") >= 1

        await _eventually(ran)
        await admin.pause(name, actor="ops", reason="first-hour test")

        async def enough() -> bool:
            return await _skip_rows(schema_dsn, name) >= 3

        await _eventually(enough)
    skipped = await _skip_rows(schema_dsn, name)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return _cli(tmp_path, schema_dsn, "schedules", "missed", *args)

    done = await asyncio.to_thread(cli, name, "--json")
    assert done.returncode == 0, done
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    paused = [row for row in rows if row["skipped"] is not None]
    assert len(paused) == skipped, rows
    for row in paused:
        assert row["skipped"] == "paused"
        assert row["reason"] == "skipped (paused)"
        assert row["attempts"] == 0
    done = await asyncio.to_thread(cli, name)
    assert done.returncode == 0, done
    assert done.stdout.count("skipped (paused)") == skipped, done.stdout
    assert f"({skipped} skipped on purpose)" in done.stdout
    done = await asyncio.to_thread(cli, "every-second-mised")
    assert done.returncode == 1
    assert "did you mean 'every-second-missed'?" in done.stderr


def test_run_names_a_factory_that_returned_none(schema_dsn: str, tmp_path: Path) -> None:
    (tmp_path / "factory.py").write_text("def main():\n    return None\n")
    done = _cli(tmp_path, schema_dsn, "run", "factory:main")
    assert done.returncode == 1, done
    assert "factory:main() returned None: name a sdcore Runtime" in done.stderr


def test_a_full_server_is_not_reported_as_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server with every connection slot taken is up: the suite's message says so."""
    with own_postgres({"max_connections": "3", "superuser_reserved_connections": "0"}) as server:
        held = [psycopg.connect(server.dsn, autocommit=True) for _ in range(3)]
        try:
            monkeypatch.setattr(conftest, "ADMIN_DSN", server.dsn)
            with pytest.raises(pytest.fail.Exception) as failed:
                conftest._admin()
        finally:
            for conn in held:
                conn.close()
    message = str(failed.value)
    assert "up but out of connection slots (SQLSTATE 53300" in message
    assert "not reachable" not in message
    assert "dedicated server" in message


WITHOUT_CRONSIM = (
    "import sys; sys.modules['cronsim'] = None\n"
    "from sdcore.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_schedules_without_the_scheduling_extra_names_the_extra(schema_dsn: str) -> None:
    """A base install (no cronsim) gets the extra named, not an 'unexpected … bug' report."""
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_CRONSIM, "--database-url", schema_dsn, "schedules", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done
    assert "`sdcore schedules` needs its extra" in done.stderr
    assert "this is a bug" not in done.stderr


def test_the_control_plane_says_why_it_is_empty_and_suggests_names(
    schema_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from sdcore.cli import main

    assert main(["--database-url", schema_dsn, "schedules", "list"]) == 0
    out = capsys.readouterr().out
    assert "no replica has joined the control plane; a bare Scheduler does not" in out
    assert main(["--database-url", schema_dsn, "schedules", "pause", "nightly"]) == 1
    assert "a bare Scheduler does not" in capsys.readouterr().err

    async def declare() -> None:
        runtime = Runtime(database_url=schema_dsn, grace_period_ms=200, relay=None)
        runtime.scheduler.add_interval("mark-overdue-tasks", 60_000, lambda tick: None)
        async with runtime:
            admin = ScheduleAdmin(PostgresScheduleStore(runtime.pool))
            await _eventually(lambda: _declared_by(admin, "mark-overdue-tasks", 1))
            code = await asyncio.to_thread(
                main, ["--database-url", schema_dsn, "schedules", "pause", "mark-overdue-task"]
            )
            assert code == 1

    asyncio.run(declare())
    err = capsys.readouterr().err
    assert "no such schedule" in err
    assert "(did you mean 'mark-overdue-tasks'?)" in err


class _Echo(Processor):
    queue = "first-hour"

    async def process(self, job: Job) -> Any:
        return None


async def test_a_weak_redis_is_reported_once_per_process(
    schema_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The shared test Redis runs without AOF: one process says so once, not per component."""
    caplog.set_level(logging.WARNING, logger="sdcore")
    async with redis_prefix() as prefix:
        runtime = Runtime(
            database_url=schema_dsn,
            redis_url=REDIS_URL,
            queue_prefix=prefix,
            processors=[_Echo()],
            relay=None,
            scheduling=None,
        )
        async with runtime:
            assert runtime.workers is not None
            await asyncio.wait_for(runtime.workers.wait_ready(), 60)  # past the workers' check
    weak = [r for r in caplog.records if getattr(r, "action", None) == "redis_persistence"]
    assert len(weak) == 1, [r.getMessage() for r in weak]


async def test_the_dashboard_answers_head_and_the_browsers_icon_request(schema_dsn: str) -> None:
    from sdcore.dashboard import dashboard_app

    runtime = Runtime(database_url=schema_dsn, relay=None, scheduling=None)
    async with runtime:
        transport = httpx.ASGITransport(app=dashboard_app(runtime))
        async with httpx.AsyncClient(transport=transport, base_url="http://dash") as client:
            head = await client.head("/")
            icon = await client.get("/favicon.ico")
            page = await client.get("/")
    assert head.status_code == 200, head.text
    assert head.content == b""
    assert icon.status_code == 204
    assert page.status_code == 200
    assert "a bare Scheduler does not" in page.text  # no schedule yet: the page says why


def test_the_ready_line_says_where_the_probes_listen() -> None:
    from sdcore.cli._run import RunOptions, describe

    plain = describe(object(), RunOptions(spec="app:scheduler"))
    assert plain == "ready: app:scheduler (scheduler); SIGTERM stops"
    line = describe(object(), RunOptions(spec="app:scheduler", metrics_port=9464))
    assert "; /livez /readyz /metrics on http://127.0.0.1:9464; SIGTERM stops" in line
    v6 = describe(object(), RunOptions(spec="a:s", metrics_port=9464, metrics_host="::1"))
    assert "http://[::1]:9464" in v6


CREATED = """
import sys
from prometheus_client import CollectorRegistry, Counter, generate_latest
from sdcore.cli._metrics import prepare

if sys.argv[1] == "prepare":
    prepare(object(), 9464)
registry = CollectorRegistry()
Counter("sdcore_demo_total", "demo", ["outcome"], registry=registry).labels("ok").inc()
print(generate_latest(registry).decode())
"""


def test_sdcore_run_metrics_carry_no_created_series() -> None:
    def scrape(mode: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", CREATED, mode], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "sdcore_demo_created" in scrape("library")  # prometheus-client's default, untouched
    served = scrape("prepare")
    assert 'sdcore_demo_total{outcome="ok"} 1.0' in served
    assert "_created" not in served


def test_help_presents_the_control_plane_and_tells_runs_from_history(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from sdcore.cli import main

    assert main(["--help"]) == 0
    top = " ".join(capsys.readouterr().out.split())
    assert "schedules list, pause/resume, trigger, backfill and create schedules" in top
    assert main(["schedules", "--help"]) == 0
    group = " ".join(capsys.readouterr().out.split())
    assert "runs an application's lease rows of one schedule (--app; `history`" in group
    assert main(["db", "status", "--help"]) == 0
    assert "JSON Lines" in capsys.readouterr().out


def _documented_keys(command: str) -> list[str]:
    """The keys docs/cli.md lists for ``command`` in its JSON table."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text(encoding="utf-8")
    for line in text.splitlines():
        if line.startswith(f"| `{command}"):
            return re.findall(r"`([a-z_]+)`", line.split("|")[2])
    raise AssertionError(f"docs/cli.md documents no JSON keys for {command}")


async def test_the_cluster_listing_json_keys_are_the_documented_ones(schema_dsn: str) -> None:
    runtime = Runtime(database_url=schema_dsn, grace_period_ms=200, relay=None)
    runtime.scheduler.add_interval("documented", 60_000, lambda tick: None)
    async with runtime:
        admin = ScheduleAdmin(PostgresScheduleStore(runtime.pool))
        await _eventually(lambda: _declared_by(admin, "documented", 1))
        done = await asyncio.to_thread(_cli, Path.cwd(), schema_dsn, "schedules", "list", "--json")
    assert done.returncode == 0, done
    (row,) = [json.loads(line) for line in done.stdout.splitlines()]
    assert list(row) == _documented_keys("schedules list` (the cluster)")


@pytest.mark.parametrize(
    ("skipped", "given_back", "status", "state", "reason"),
    [
        pytest.param("paused", None, "FAIL", "skipped (paused)", "skipped (paused)", id="paused"),
        pytest.param(
            None,
            "acquire answered too late",
            "FAIL",
            "given back, never ran (acquire answered too late)",
            "given back, never ran (acquire answered too late)",
            id="given-back",
        ),
        pytest.param(None, None, "FAIL", "FAIL", None, id="failed"),
        pytest.param(None, None, None, "never started", None, id="never-started"),
    ],
)
def test_a_missed_tick_shows_why_it_did_not_run(
    skipped: str | None, given_back: str | None, status: str | None, state: str, reason: str | None
) -> None:
    """The reason the scheduling layer reports is shown as it is worded there."""
    from sdcore.cli._missed import reason_of, state_of
    from sdcore.job_scheduler import JobSchedulerStatus
    from sdcore.scheduling import MissedTick

    tick = SimpleNamespace(
        skipped=skipped,
        given_back=given_back,
        status=None if status is None else JobSchedulerStatus(status),
    )
    assert state_of(cast(MissedTick, tick)) == state
    assert reason_of(cast(MissedTick, tick)) == reason


def test_importing_an_app_refuses_loops_only_while_it_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name imported from asyncio during the import still works afterwards, unrefused."""
    from sdcore.cli._app_import import ProgramStartedError, import_app_module

    monkeypatch.chdir(tmp_path)
    (tmp_path / "kept_run.py").write_text(
        "from asyncio import run\n\n\nasync def answer():\n    return 42\n"
    )
    (tmp_path / "starts_at_import.py").write_text("import asyncio\nasyncio.run(asyncio.sleep(0))\n")
    original = asyncio.run
    module = import_app_module("kept_run")
    assert module.run(module.answer()) == 42
    with pytest.raises(ProgramStartedError) as refused:
        import_app_module("starts_at_import")
    assert refused.value.where == "starts_at_import.py:2"
    assert "starts_at_import" not in sys.modules
    assert asyncio.run is original
    monkeypatch.delitem(sys.modules, "kept_run")
