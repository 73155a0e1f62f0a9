"""``sdcore schedules list|runs|missed`` against an application module."""

from __future__ import annotations

import asyncio

import pytest

from sdcore.cli import main
from sdcore.job_scheduler import JobSchedulerService

APP = "tests.integration._sched_app:scheduler"


def test_list_shows_next_fire_times_in_utc_and_local(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedules", "list", "--app", APP]) == 0
    out = capsys.readouterr().out
    assert "mark-overdue-tasks" in out
    assert "0 01 * * *" in out
    assert "Europe/Paris" in out
    line = next(line for line in out.splitlines() if line.startswith("mark-overdue-tasks"))
    assert "T01:00:00+0" in line  # local time 01:00 in Paris
    assert "+00:00" in line  # and the same instant in UTC
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
