"""The Django admin's pause and resume in a real browser (Debian's chromium driven by Playwright).

The test project served by ``manage.py runserver`` (its own process, a free port), a
``manage.py sdcore run`` worker declaring ``every-second``, and two users made through the ORM:
``operator`` (every sdcore permission) logs in, ticks the schedule, chooses "Pause", types a
reason in the action's form and submits it; the list then shows the pause with its actor and
reason, and the control plane recorded both. ``viewer`` (view permissions only) is offered no
action.
"""

from __future__ import annotations

import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.django_project.harness import environment, manage, start, stop
from tests.integration._dashboard import chromium, free_port

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.timeout(180)]

SCHEDULE = "every-second"
PASSWORD = "correct-horse-battery-staple"
USERS = f"""
from django.contrib.auth.models import Permission, User
sdcore = Permission.objects.filter(content_type__app_label="sdcore")
for name, perms in (("operator", sdcore), ("viewer", sdcore.filter(codename__startswith="view_"))):
    user = User.objects.create_user(name, password="{PASSWORD}", is_staff=True)
    user.user_permissions.set(perms)
"""


def _until(check: Any, what: str, proc: subprocess.Popen[Any], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):  # noqa: S310 - a loopback URL
            return True
    except OSError:
        return False


@pytest.fixture
def served(empty_dsn: str, tmp_path: Path) -> Iterator[str]:
    """The admin's base URL, with the worker running and the users made."""
    for args in (("migrate",), ("shell", "-c", USERS)):
        done = manage(empty_dsn, *args)
        assert done.returncode == 0, done.stderr
    ready = tmp_path / "ready"
    env = environment(empty_dsn, SDCORE_DJANGO_TICKS="1")
    worker = start(empty_dsn, "sdcore", "run", "--ready-file", str(ready), env=env)
    port = free_port()
    server = start(empty_dsn, "runserver", f"127.0.0.1:{port}", "--noreload", env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        _until(ready.exists, "the worker", worker)
        _until(lambda: _answers(f"{base}/admin/login/"), "runserver", server)
        yield base
    finally:
        stop(server)
        stop(worker)


def _log_in(page: Any, base: str, username: str) -> None:
    page.goto(f"{base}/admin/login/?next=/admin/sdcore/schedule/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(f"{base}/admin/sdcore/schedule/")


def test_an_operator_pauses_and_resumes_a_schedule_in_a_browser(
    served: str, empty_dsn: str
) -> None:
    from playwright.sync_api import sync_playwright

    path = chromium()
    with sync_playwright() as driver:
        engine = driver.chromium.launch(
            executable_path=path, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = engine.new_context().new_page()
            page.set_default_timeout(15_000)
            _log_in(page, served, "viewer")
            assert page.locator(f"text={SCHEDULE}").count() >= 1
            assert page.locator("select[name=action]").count() == 0  # no action offered
            page.context.clear_cookies()

            _log_in(page, served, "operator")
            page.check(f"input[name=_selected_action][value={SCHEDULE}]")
            page.select_option("select[name=action]", "pause")
            page.click("button[name=index]")
            page.fill("textarea[name=reason]", "INC-7: <b>db failover</b>")
            page.click("input[name=apply]")
            page.wait_for_url(f"{served}/admin/sdcore/schedule/")
            said = page.inner_text("ul.messagelist").lower()  # the admin capitalises messages
            assert "pause of every-second recorded as action" in said
            row = page.inner_text("#result_list tbody")
            assert "paused by operator: INC-7: <b>db failover</b>" in row  # escaped, as typed

            page.check(f"input[name=_selected_action][value={SCHEDULE}]")
            page.select_option("select[name=action]", "resume")
            page.click("button[name=index]")
            page.click("input[name=apply]")
            page.wait_for_url(f"{served}/admin/sdcore/schedule/")
            assert "resume of every-second recorded" in page.inner_text("ul.messagelist").lower()
        finally:
            engine.close()
    with psycopg.connect(empty_dsn) as conn:
        recorded = conn.execute(
            "SELECT action, actor, reason FROM sdcore_schedules_actions ORDER BY id"
        ).fetchall()
    assert recorded == [
        ("pause", "operator", "INC-7: <b>db failover</b>"),
        ("resume", "operator", None),
    ]
