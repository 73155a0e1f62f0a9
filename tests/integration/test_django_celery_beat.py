"""``manage.py sdcore import-celery-beat`` on django-celery-beat's real tables (PostgreSQL).

The test project with ``project.settings_celery_beat``: django-celery-beat's migrations, and
``beatapp``, whose ``schedules.py`` registers handlers named after two Celery tasks.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import psycopg
import pytest

from tests.django_project.harness import environment, manage, start

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

SETUP = "from beatapp.periodic_tasks import create; print('RESULT', create())"
SKIPPED = {
    "bad-json": "kwargs is not JSON",
    "both-days": "day_of_month='1' and day_of_week='monday' are both restricted",
    "expired": "expired at ",
    "later": "starts at ",
    "launch": "a clocked schedule (once, at ",
    "one-off": "one_off (runs once, then disables itself)",
    "routed": "Celery routing or message options (queue='reports', priority=5)",
    "sub-ms": "every 1500 microseconds is not a whole number of ms",
    "sunrise": "a solar schedule (Sunrise",
}


def _env(dsn: str) -> dict[str, str]:
    return environment(dsn, DJANGO_SETTINGS_MODULE="project.settings_celery_beat")


def _run(dsn: str, *args: str) -> tuple[int, list[str]]:
    result = manage(dsn, *args, env=_env(dsn))
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, result.stdout.splitlines()


def _stored(dsn: str) -> list[tuple[str, str, str]]:
    with psycopg.connect(dsn) as conn:
        return [
            (r[0], r[1], r[2])
            for r in conn.execute(
                "SELECT name, handler, expression FROM sdcore_schedules"
                " WHERE origin = 'stored' AND removed_at IS NULL ORDER BY name"
            ).fetchall()
        ]


def _skips(lines: list[str]) -> dict[str, str]:
    return dict(
        line.removeprefix("skip ").split(": ", 1) for line in lines if line.startswith("skip ")
    )


@pytest.fixture
def beat_dsn(empty_dsn: str) -> str:
    """A migrated database holding the periodic tasks of ``django_celery_beat_tasks.py``."""
    code, _ = _run(empty_dsn, "migrate")
    assert code == 0
    code, lines = _run(empty_dsn, "shell", "-c", SETUP)
    assert code == 0
    assert "RESULT 13" in lines
    return empty_dsn


def test_the_dry_run_prints_the_schedules_and_the_skipped_tasks(beat_dsn: str) -> None:
    code, lines = _run(beat_dsn, "sdcore", "import-celery-beat")
    assert code == 0
    text = "\n".join(lines)
    assert (
        "manage.py sdcore schedules create daily-report --handler reports.tasks.send_report"
        " --cron '0 8 * * mon-fri' --time-zone Europe/Paris"
        """ --args '{"args": [], "kwargs": {"full": true}}'"""
    ) in text
    assert "create heartbeat:\n  manage.py sdcore schedules create heartbeat --handler" in text
    assert """--every-ms 1000 --args '{"args": [1, "x"], "kwargs": {}}'""" in text
    assert "manage.py sdcore schedules pause disabled-digest" in text
    skips = _skips(lines)
    assert set(skips) == set(SKIPPED)
    for name, reason in SKIPPED.items():
        assert skips[name].startswith(reason), (name, skips[name])
    assert lines[-1] == "4 to create, 9 skipped (dry run: nothing written; --apply creates them)"
    assert _stored(beat_dsn) == []
    code, lines = _run(
        beat_dsn, "sdcore", "import-celery-beat", "--ignore-routing", "--name", "routed"
    )
    assert code == 0
    assert lines[0] == "create routed:"
    assert "--every-ms 7200000" in lines[1]
    code, lines = _run(beat_dsn, "sdcore", "import-celery-beat", "--name", "nope")
    assert (code, lines) == (
        0,
        [
            "skip nope: no django-celery-beat periodic task has this name",
            "0 to create, 1 skipped (dry run: nothing written; --apply creates them)",
        ],
    )


def test_apply_creates_them_through_the_admin_and_they_run(beat_dsn: str, tmp_path: Path) -> None:
    # No worker registers the handlers yet: every create is refused, nothing is written.
    code, lines = _run(beat_dsn, "sdcore", "import-celery-beat", "--apply", "--name", "heartbeat")
    assert code == 1
    assert lines == [
        "failed heartbeat: schedule 'heartbeat': no running replica registers a handler named"
        " 'beat.heartbeat'; nothing changed",
        "0 created, 1 failed, 0 skipped",
    ]
    ready = tmp_path / "ready"
    worker = start(beat_dsn, "sdcore", "run", "--ready-file", str(ready), env=_env(beat_dsn))
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert worker.poll() is None, worker.communicate()
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.1)
        code, lines = _run(beat_dsn, "sdcore", "import-celery-beat", "--apply", "--actor", "ops")
        assert code == 1  # "unregistered" has no handler
        assert [line for line in lines if not line.startswith("skip ")] == [
            "created daily-report",
            "created disabled-digest (paused)",
            "created heartbeat",
            "failed unregistered: schedule 'unregistered': no running replica registers a"
            " handler named 'nobody.registers'; nothing changed",
            "3 created, 1 failed, 9 skipped",
        ]
        assert _stored(beat_dsn) == [
            ("daily-report", "reports.tasks.send_report", "0 8 * * mon-fri"),
            ("disabled-digest", "reports.tasks.send_report", "30 6 * * *"),
            ("heartbeat", "beat.heartbeat", "1000"),
        ]
        code, listed = _run(beat_dsn, "sdcore", "schedules", "list", "--json")
        assert code == 0
        states = {s["name"]: s for s in map(json.loads, listed)}
        assert states["disabled-digest"]["paused"] is True
        assert states["daily-report"]["paused"] is False
        time.sleep(3)  # a few ticks of the every-second schedule
        with psycopg.connect(beat_dsn) as conn:
            runs = conn.execute("SELECT handler, schedule, args FROM beatapp_beatrun").fetchall()
        assert len(runs) >= 2
        assert {(h, s) for h, s, _ in runs} == {("beat.heartbeat", "heartbeat")}
        assert runs[0][2] == {"args": [1, "x"], "kwargs": {}}
        # Again: the names are taken, nothing changes.
        code, lines = _run(
            beat_dsn, "sdcore", "import-celery-beat", "--apply", "--name", "heartbeat"
        )
        assert code == 1
        assert "a stored schedule with this name exists; nothing changed" in lines[0]
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=15)


def test_without_django_celery_beat_installed(empty_dsn: str) -> None:
    result = manage(empty_dsn, "sdcore", "import-celery-beat")
    assert result.returncode == 2
    assert "django_celery_beat is not in INSTALLED_APPS" in result.stdout
