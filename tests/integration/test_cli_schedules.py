"""``sdcore schedules list|runs|missed`` against an application module."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from sdcore.cli import main
from sdcore.job_scheduler import AttemptBudget, JobAcquireOptions, JobSchedulerService

APP = "tests.integration._sched_app:scheduler"


def test_list_shows_next_fire_times_in_utc_and_local(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedules", "list", "--app", APP]) == 0
    out = capsys.readouterr().out
    assert "mark-overdue-tasks" in out
    assert "0 01 * * *" in out
    assert "Europe/Paris" in out
    line = next(line for line in out.splitlines() if line.startswith("mark-overdue-tasks"))
    assert "T01:00:00+0" in line  # local time 01:00 in Paris
    assert "T00:00:00Z" in line or "T23:00:00Z" in line  # the same instant in UTC, with Z
    assert "refresh-stats" in out


def test_factory_is_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedules", "list", "--app", "tests.integration._sched_app:make_scheduler"]) == 0
    assert "refresh-stats" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("app", "message"),
    [
        ("tests.integration._sched_app", "module:attribute"),
        ("tests.integration._nope:scheduler", "cannot import"),
        ("tests.integration._sched_app:missing", "no attribute"),
        ("tests.integration._sched_app:not_a_scheduler", "not a sdcore Scheduler"),
    ],
)
def test_bad_app_specs(app: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedules", "list", "--app", app]) == 1
    assert message in capsys.readouterr().err


def _seed(dsn: str) -> None:
    async def seed() -> None:
        async with JobSchedulerService.connect(dsn) as jobs:
            await jobs.ensure_schema()
            for run_key, finish in (
                ("2026-07-20T23:00:00Z", "complete"),
                ("2026-07-21T23:00:00Z", "fail"),
            ):
                got = await jobs.acquire({"code": "mark-overdue-tasks", "run_key": run_key})
                assert got.acquired
                await getattr(jobs, finish)(got.lease)

    asyncio.run(seed())


def test_runs_and_missed(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    _seed(pg_dsn)
    assert (
        main(["--database-url", pg_dsn, "schedules", "runs", "mark-overdue-tasks", "--app", APP])
        == 0
    )
    out = capsys.readouterr().out
    assert "2026-07-20T23:00:00Z" in out
    assert "SUCCESS" in out
    assert "FAIL" in out
    code = main(
        [
            "--database-url",
            pg_dsn,
            "schedules",
            "missed",
            "mark-overdue-tasks",
            "--app",
            APP,
            "--since",
            "2026-07-20T00:00:00Z",
            "--until",
            "2026-07-24T00:00:00Z",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    # 01:00 in Paris (summer) is 23:00 UTC the day before.
    assert "2026-07-20T23:00:00Z" not in out
    assert "2026-07-21T23:00:00Z  FAIL" in out
    assert "2026-07-22T23:00:00Z  never started" in out
    assert "3 missed tick(s)" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--since", "yesterday"], "invalid instant"),
        (["--since", "2026-07-20T00:00:00"], "needs a zone"),
        (["--since", "2026-07-21T00:00:00Z", "--until", "2026-07-20T00:00:00Z"], "before"),
    ],
)
def test_missed_bad_ranges(
    pg_dsn: str, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["--database-url", pg_dsn, "schedules", "missed", "refresh-stats", "--app", APP, *args]
    )
    assert code in (1, 2)
    assert message in capsys.readouterr().err


def test_missed_unknown_schedule(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    _seed(pg_dsn)
    assert (
        main(
            ["--database-url", pg_dsn, "schedules", "missed", "nope", "--app", APP, "--since", "1h"]
        )
        == 1
    )
    assert "no schedule named" in capsys.readouterr().err


def test_list_json_has_stable_keys_and_z_times(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedules", "list", "--app", APP, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {row["name"] for row in rows} == {"mark-overdue-tasks", "refresh-stats"}
    for row in rows:
        assert list(row) == [
            "name",
            "kind",
            "schedule",
            "time_zone",
            "exclusive",
            "active",
            "running",
            "next_fire_at",
            "next_fire_local",
        ]
        assert row["next_fire_at"].endswith("Z")
    nightly = next(row for row in rows if row["name"] == "mark-overdue-tasks")
    assert nightly["kind"] == "cron"
    assert "T01:00:00+0" in nightly["next_fire_local"]


def test_runs_and_missed_json(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    _seed(pg_dsn)
    base = ["--database-url", pg_dsn, "schedules"]
    assert main([*base, "runs", "mark-overdue-tasks", "--app", APP, "--json"]) == 0
    runs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [run["run_key"] for run in runs] == ["2026-07-21T23:00:00Z", "2026-07-20T23:00:00Z"]
    assert all(run["modified_at"].endswith("Z") for run in runs)
    window = ["--since", "2026-07-20T00:00:00Z", "--until", "2026-07-23T00:00:00Z"]
    assert main([*base, "missed", "mark-overdue-tasks", "--app", APP, *window, "--json"]) == 0
    missed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert missed == [
        {
            "run_key": "2026-07-21T23:00:00Z",
            "scheduled_at": "2026-07-21T23:00:00Z",
            "status": "FAIL",
            "attempts": 1,
            "skipped": None,
            "given_back": None,
            "reason": None,
        },
        {
            "run_key": "2026-07-22T23:00:00Z",
            "scheduled_at": "2026-07-22T23:00:00Z",
            "status": None,
            "attempts": None,
            "skipped": None,
            "given_back": None,
            "reason": None,
        },
    ]


def test_missed_tells_a_tick_given_back_unstarted_from_a_failure(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A tick won and given back without running (its acquire answered too late) is no failed
    # run: it is shown as given back, with the reason, and not as "FAIL, 1 attempt".
    _seed(pg_dsn)

    async def give_back() -> None:
        budget = AttemptBudget(max_attempts=1, backoff_ms=1_000)
        options = JobAcquireOptions(code="mark-overdue-tasks", run_key="2026-07-22T23:00:00Z")
        async with JobSchedulerService.connect(pg_dsn) as jobs:
            got, attempt = await jobs.acquire_attempt(options, budget)
            assert (got.acquired, attempt) == (True, 1)
            assert got.acquired
            assert await jobs.give_back(got.lease, "acquire answered too late")

    asyncio.run(give_back())
    base = ["--database-url", pg_dsn, "schedules", "missed", "mark-overdue-tasks", "--app", APP]
    window = ["--since", "2026-07-21T00:00:00Z", "--until", "2026-07-23T00:00:00Z"]
    assert main([*base, *window]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any("2026-07-21T23:00:00Z" in line and line.rstrip().endswith("FAIL") for line in lines)
    returned = next(line for line in lines if "2026-07-22T23:00:00Z" in line)
    assert "given back, never ran (acquire answered too late)" in returned
    assert main([*base, *window, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(row["status"], row["given_back"]) for row in rows] == [
        ("FAIL", None),
        ("FAIL", "acquire answered too late"),
    ]


def test_missed_refuses_a_schedule_that_left_no_rows(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _seed(pg_dsn)  # rows for mark-overdue-tasks only
    code = main(
        [
            "--database-url",
            pg_dsn,
            "schedules",
            "missed",
            "refresh-stats",
            "--app",
            APP,
            "--since",
            "1h",
        ]
    )
    captured = capsys.readouterr()
    assert code == 1
    assert captured.out == ""  # not 60 "never started" lines
    assert "no run of 'refresh-stats' is recorded" in captured.err
    assert "not exclusive" in captured.err


def test_missing_scheduling_extra_is_not_called_a_bug(tmp_path: object) -> None:
    # Simulate an install without cronsim: a module named cronsim that fails to import.
    code = (
        "import sys; sys.modules['cronsim'] = None\n"
        "from sdcore.cli import main\n"
        f"raise SystemExit(main(['schedules', 'list', '--app', {APP!r}]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1
    assert "pip install 'sdcore[scheduling]'" in done.stderr
    assert "bug" not in done.stderr


def test_every_listing_json_pipes_into_jq(pg_dsn: str) -> None:
    """Each listing's --json, through a real pipe into jq; every *_at value is UTC with Z."""
    import shutil

    from sdcore.outbox import Outbox

    jq = shutil.which("jq")
    if jq is None:
        pytest.fail("jq is needed for this test (apt-get install jq)", pytrace=False)
    _seed(pg_dsn)
    assert main(["--database-url", pg_dsn, "db", "upgrade", "--outbox"]) == 0

    async def enqueue() -> None:
        import psycopg

        async with (
            await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn,
            conn.transaction(),
        ):
            await Outbox().enqueue_once(
                conn, idempotency_key="k1", queue="mail", name="send", payload={}
            )

    asyncio.run(enqueue())
    window = "--since 2026-07-20T00:00:00Z --until 2026-07-23T00:00:00Z"
    commands = {
        "jobs list": "jobs list --json",
        "outbox list": "outbox list --json",
        "schedules list": f"schedules list --app {APP} --json",
        "schedules runs": f"schedules runs mark-overdue-tasks --app {APP} --json",
        "schedules missed": f"schedules missed mark-overdue-tasks --app {APP} {window} --json",
    }
    check = (
        '[to_entries[] | select(.key | endswith("_at")) | .value | select(. != null)]'
        ' | all(endswith("Z"))'
    )
    env = {**os.environ, "DATABASE_URL": pg_dsn}
    for label, command in commands.items():
        pipeline = f"set -o pipefail; {sys.executable} -m sdcore.cli {command} | {jq} -e '{check}'"
        done = subprocess.run(
            ["bash", "-c", pipeline],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            check=False,
        )
        assert done.returncode == 0, (label, done.stdout, done.stderr)
        verdicts = done.stdout.split()
        assert verdicts, label  # at least one row listed
        assert set(verdicts) == {"true"}, (label, done.stdout)


def test_missed_check_exits_3_when_ticks_are_missed(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _seed(pg_dsn)  # 2026-07-20T23:00Z SUCCESS, 2026-07-21T23:00Z FAIL
    base = ["--database-url", pg_dsn, "schedules", "missed", "mark-overdue-tasks", "--app", APP]
    clean = ["--since", "2026-07-20T12:00:00Z", "--until", "2026-07-21T00:00:00Z"]
    assert main([*base, *clean, "--check"]) == 0
    assert "0 missed tick(s)" in capsys.readouterr().out
    missed = ["--since", "2026-07-20T12:00:00Z", "--until", "2026-07-22T00:00:00Z"]
    assert main([*base, *missed]) == 0  # without --check: a report, not a verdict
    capsys.readouterr()
    assert main([*base, *missed, "--check"]) == 3
    captured = capsys.readouterr()
    assert "2026-07-21T23:00:00Z  FAIL" in captured.out
    assert "1 missed tick(s) of 'mark-overdue-tasks'" in captured.err
