"""sdcore's pages in the Django admin, through Django's test client, on real PostgreSQL.

One database for the module, migrated by ``manage.py migrate`` in this process (Django is set up
here on the test project, ``tests/django_project``), and one ``manage.py sdcore run`` worker
that declares the ``every-second`` schedule (a live replica: pause and trigger need one). The
users: ``operator`` holds every sdcore permission, ``viewer`` only the view ones, and
``no-<action>`` every permission but that action's.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from tests.conftest import _admin, _create, _dropper, dsn_for, unique_name
from tests.django_project.harness import PROJECT, environment, manage, start, stop

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

SCHEDULE = "every-second"
ACTIONS = ("pause", "resume", "trigger", "backfill")
LIST = "/admin/sdcore/schedule/"
OUTBOX = "/admin/sdcore/outboxmessage/"
HOSTILE = "<img src=x onerror=alert(1)>"


def _setup_django(dsn: str, patch: pytest.MonkeyPatch) -> None:
    """Set Django up in this process on the test project (once: Django's settings are global;
    the environment and path are restored after the module)."""
    patch.setenv("SDCORE_DJANGO_DSN", dsn)
    patch.setenv("DJANGO_SETTINGS_MODULE", "project.settings")
    patch.syspath_prepend(str(PROJECT))
    import django
    from django.conf import settings
    from django.test.utils import setup_test_environment

    if settings.configured:
        pytest.fail("Django was set up before this module: it needs its own settings")
    django.setup()
    setup_test_environment()


def _users() -> None:
    from django.contrib.auth.models import Permission, User

    sdcore = Permission.objects.filter(content_type__app_label="sdcore")
    view = sdcore.filter(codename__startswith="view_")
    User.objects.create_user("operator", is_staff=True).user_permissions.set(sdcore)
    User.objects.create_user("viewer", is_staff=True).user_permissions.set(view)
    for action in ACTIONS:
        user = User.objects.create_user(f"no-{action}", is_staff=True)
        user.user_permissions.set(sdcore.exclude(codename=f"{action}_schedule"))
    User.objects.create_user("no-retry", is_staff=True).user_permissions.set(
        sdcore.exclude(codename="retry_outbox")
    )


def _wait(check: Any, what: str, seconds: float = 30) -> Any:
    deadline = time.monotonic() + seconds
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return found


def _one(dsn: str, query: str, *params: Any) -> Any:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(query, params).fetchone()
    return None if row is None else row[0] if len(row) == 1 else row


@pytest.fixture(scope="module")
def site(template_db: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The module's database, migrated, with its users and a running worker."""
    name = unique_name("admin")
    with _admin() as conn:
        _create(conn, name, template_db)
    dsn = dsn_for(name)
    with pytest.MonkeyPatch.context() as patch:
        _setup_django(dsn, patch)
        yield from _served(dsn, name, tmp_path_factory)


def _served(dsn: str, name: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from django.core.management import call_command
    from django.db import connections
    from django.test.utils import teardown_test_environment

    from sdcore.django._control import close_control

    call_command("migrate", verbosity=0)
    _users()
    ready = tmp_path_factory.mktemp("worker") / "ready"
    worker = start(
        dsn,
        "sdcore",
        "run",
        "--ready-file",
        str(ready),
        env=environment(dsn, SDCORE_DJANGO_TICKS="1"),
    )
    try:
        _wait(lambda: ready.exists() or worker.poll() is not None, "the worker")
        assert worker.poll() is None, worker.communicate()
        _wait(
            lambda: _one(
                dsn,
                "SELECT count(*) FROM sdcore_schedules_runs WHERE schedule = %s AND status ="
                " 'SUCCESS'",
                SCHEDULE,
            ),
            "a successful run",
        )
        yield dsn
    finally:
        close_control()
        connections.close_all()
        teardown_test_environment()
        stop(worker)
        _dropper.drop(name)


def _client(username: str, *, csrf: bool = False) -> Any:
    from django.contrib.auth.models import User
    from django.test import Client

    client = Client(enforce_csrf_checks=csrf)
    client.force_login(User.objects.get(username=username))
    return client


def _post_action(client: Any, action: str, ids: list[str], url: str = LIST, **form: Any) -> Any:
    data = {"action": action, "_selected_action": ids, **form}
    return client.post(url, data, follow=True)


def _messages(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]] if response.context else []


def _paused(dsn: str) -> bool:
    return bool(_one(dsn, "SELECT paused FROM sdcore_schedules WHERE name = %s", SCHEDULE))


def _actions(dsn: str, kind: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return list(
            conn.execute(
                "SELECT actor, reason, params, request_id FROM sdcore_schedules_actions"
                " WHERE schedule = %s AND action = %s ORDER BY id",
                (SCHEDULE, kind),
            ).fetchall()
        )


def _outbox_row(dsn: str, key: str, status: str) -> int:
    """A row as the outbox writes it, then put in ``status`` as the relay would leave it."""
    from sdcore.sync import Outbox

    with psycopg.connect(dsn) as conn:
        with conn.transaction():
            Outbox().enqueue_once(
                conn, idempotency_key=key, queue="mail", name="notify", payload={"k": key}
            )
        conn.execute(
            "UPDATE outbox SET status = %s, attempts = max_attempts, last_error = 'boom',"
            " published_at = CASE WHEN %s = 'PUBLISHED' THEN now() END"
            " WHERE idempotency_key = %s",
            (status, status, key),
        )
        row_id = conn.execute("SELECT id FROM outbox WHERE idempotency_key = %s", (key,)).fetchone()
    assert row_id is not None
    return int(row_id[0])


def test_the_lists_render_with_their_data(site: str) -> None:
    client = _client("viewer")
    page = client.get(LIST)
    assert page.status_code == 200
    text = page.content.decode()
    assert SCHEDULE in text
    assert "every 1000 ms" in text
    assert "missed ticks (24 h)" in text.lower()
    assert "SUCCESS at" in text  # the last run
    row = next(r for r in page.context["cl"].result_list if r.name == SCHEDULE)
    status = row.sdcore_status
    assert status.replicas == 1
    assert status.next_fire_at is not None
    assert status.next_fire_at > datetime.now(UTC) - timedelta(seconds=2)
    assert status.missed is not None
    for query in ({"q": "every"}, {"o": "4"}, {"o": "-4.1"}, {"paused__exact": "0"}):
        found = client.get(LIST, query)
        assert found.status_code == 200, query
        assert [r.name for r in found.context["cl"].result_list] == [SCHEDULE], query
    assert client.get(LIST, {"q": "nothing-like-it"}).context["cl"].result_count == 0
    runs = client.get("/admin/sdcore/schedulerun/", {"schedule": SCHEDULE})
    assert runs.status_code == 200
    listed = runs.context["cl"].result_list
    assert listed
    assert {r.schedule for r in listed} == {SCHEDULE}
    assert "SUCCESS" in runs.content.decode()
    detail = client.get(f"/admin/sdcore/schedule/{SCHEDULE}/change/")
    assert detail.status_code == 200
    assert "Save" not in detail.content.decode()  # read-only
    key = f"render-{time.monotonic_ns()}"
    row_id = _outbox_row(site, key, "DEAD")
    outbox = client.get(OUTBOX, {"status": "DEAD"})
    assert outbox.status_code == 200
    assert f">{row_id}<" in outbox.content.decode()
    assert client.get("/admin/sdcore/scheduleaction/").status_code == 200


def test_missed_ticks_count_the_expected_ticks_without_success(site: str) -> None:
    from sdcore.django._control import GRACE, MAX_TICKS, Definition, control

    created = datetime.now(UTC) - timedelta(minutes=10)

    def definition(name: str, kind: str, expression: str, **changes: Any) -> Definition:
        return Definition(
            **{
                "name": name,
                "origin": "stored",
                "kind": kind,
                "expression": expression,
                "time_zone": "UTC",
                "day_rule": "vixie",
                "paused": False,
                "created_at": created,
                **changes,
            }
        )

    found = control().statuses(
        [
            # The worker has run every-second for seconds only: 9 minutes of its ticks before
            # the grace are missed (as if it had existed for 10 minutes).
            definition(SCHEDULE, "interval", "1000"),
            definition("never-ran", "cron", "* * * * *"),
            definition("once", "initial", "0"),
            definition("fast", "interval", "1000", created_at=created - timedelta(hours=1)),
            definition("paused", "cron", "* * * * *", paused=True),
        ]
    )
    window = (datetime.now(UTC) - GRACE - created).total_seconds()
    missed = found[SCHEDULE].missed
    assert missed is not None
    assert abs(missed - window) <= 2
    assert found["never-ran"].missed in (8, 9, 10)
    assert found["never-ran"].next_fire_at is not None
    assert found["never-ran"].replicas == 0
    assert not found[SCHEDULE].capped
    assert found["once"].missed is None
    assert found["once"].next_fire_at is None
    assert (found["fast"].missed, found["fast"].capped) == (MAX_TICKS, True)
    assert found["paused"].next_fire_at is None
    assert found["paused"].missed in (8, 9, 10)  # a pause does not excuse its ticks


def test_a_user_without_view_permission_sees_no_page(site: str) -> None:
    from django.contrib.auth.models import User

    User.objects.get_or_create(username="staff-only", is_staff=True)
    client = _client("staff-only")
    assert client.get(LIST).status_code == 403
    assert client.get(OUTBOX).status_code == 403


def test_the_viewer_is_offered_no_action_and_a_forged_post_is_refused(site: str) -> None:
    client = _client("viewer")
    text = client.get(LIST).content.decode()
    for action in ACTIONS:
        assert f'value="{action}"' not in text
    for action in ACTIONS:
        forged = _post_action(client, action, [SCHEDULE], apply="1", reason="forged")
        assert forged.status_code == 403, action
    assert not _paused(site)
    assert _actions(site, "pause") == []


def test_no_action_chosen_and_a_vanished_schedule_are_messages_not_errors(site: str) -> None:
    client = _client("operator")
    none = _post_action(client, "", [SCHEDULE], index="0")
    assert none.status_code == 200
    assert "No action selected." in _messages(none)
    gone = _post_action(client, "pause", ["no-such-schedule"], apply="1", request_id="g-1")
    assert gone.status_code == 200
    assert any("none of the selected schedules exists" in m for m in _messages(gone))
    assert not _paused(site)


@pytest.mark.parametrize(
    ("action", "form", "named"),
    [
        ("pause", {"reason": "x" * 1_001}, "reason"),
        ("trigger", {"request_id": "r" * 201}, "request_id"),
        ("backfill", {"concurrency": "1000000"}, "concurrency"),
    ],
    ids=["long-reason", "forged-request-id", "huge-concurrency"],
)
def test_bad_input_is_the_control_planes_message(
    site: str, action: str, form: dict[str, str], named: str
) -> None:
    end = datetime.now(UTC) - timedelta(seconds=5)
    data = {
        "request_id": "bad-1",
        "start": (end - timedelta(seconds=2)).isoformat(),
        "end": end.isoformat(),
        "concurrency": "1",
        **form,
    }
    before = len(_actions(site, action))
    done = _post_action(_client("operator"), action, [SCHEDULE], apply="1", **data)
    texts = _messages(done)
    assert any(f"{action} of every-second refused" in m and named in m for m in texts), texts
    assert len(_actions(site, action)) == before
    assert not _paused(site)


@pytest.mark.parametrize("action", ACTIONS)
def test_each_action_needs_its_own_permission(site: str, action: str) -> None:
    client = _client(f"no-{action}")
    text = client.get(LIST).content.decode()
    offered = {a for a in ACTIONS if f'value="{a}"' in text}
    assert offered == set(ACTIONS) - {action}
    before = len(_actions(site, action))
    assert _post_action(client, action, [SCHEDULE]).status_code == 403  # the form
    refused = _post_action(client, action, [SCHEDULE], apply="1", request_id="x")
    assert refused.status_code == 403
    assert len(_actions(site, action)) == before


def test_pause_then_resume_record_the_django_user_and_reason(site: str) -> None:
    client = _client("operator")
    form = _post_action(client, "pause", [SCHEDULE])
    assert form.status_code == 200
    assert 'name="reason"' in form.content.decode()
    assert not _paused(site)  # the form alone changes nothing
    done = _post_action(client, "pause", [SCHEDULE], apply="1", reason="INC-12", request_id="r1")
    assert done.status_code == 200
    assert any("pause of every-second recorded as action" in m for m in _messages(done))
    assert _paused(site)
    assert _one(
        site, "SELECT paused_by, paused_reason FROM sdcore_schedules WHERE name = %s", SCHEDULE
    ) == ("operator", "INC-12")
    again = _post_action(client, "pause", [SCHEDULE], apply="1", reason="", request_id="r2")
    assert any("already paused; nothing changed" in m for m in _messages(again))
    listed = client.get(LIST).content.decode()
    assert "paused by operator: INC-12" in listed
    resumed = _post_action(client, "resume", [SCHEDULE], apply="1", reason="", request_id="r3")
    assert any("resume of every-second recorded" in m for m in _messages(resumed))
    assert not _paused(site)
    assert _actions(site, "pause")[-1][:2] == ("operator", "INC-12")
    assert _actions(site, "resume")[-1][:2] == ("operator", None)
    from django.contrib.admin.models import LogEntry

    assert LogEntry.objects.filter(user__username="operator", object_repr=SCHEDULE).count() >= 2


def test_trigger_runs_once_even_when_the_form_is_submitted_twice(site: str) -> None:
    client = _client("operator")
    for _ in range(2):
        done = _post_action(
            client, "trigger", [SCHEDULE], apply="1", reason="by hand", request_id="t-1"
        )
        assert done.status_code == 200
    texts = _messages(done)
    assert any("already recorded by an earlier submit" in m for m in texts), texts
    triggers = [a for a in _actions(site, "trigger") if a[3] == "t-1"]
    assert len(triggers) == 1
    assert triggers[0][:2] == ("operator", "by hand")
    _wait(
        lambda: _one(
            site,
            "SELECT count(*) FROM sdcore_schedules_runs WHERE schedule = %s AND source ="
            " 'trigger' AND status = 'SUCCESS'",
            SCHEDULE,
        ),
        "the triggered run",
    )


def test_backfill_takes_its_window_from_the_form(site: str) -> None:
    client = _client("operator")
    end = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=5)
    start_at = end - timedelta(seconds=3)
    bad = _post_action(
        client,
        "backfill",
        [SCHEDULE],
        apply="1",
        request_id="b-0",
        start=end.isoformat(),
        end=start_at.isoformat(),
        concurrency="1",
    )
    assert any("before it starts" in m for m in _messages(bad)), _messages(bad)
    missing = _post_action(client, "backfill", [SCHEDULE], apply="1", request_id="b-1")
    assert missing.status_code == 200
    assert "This field is required" in missing.content.decode()  # the form, shown again
    done = _post_action(
        client,
        "backfill",
        [SCHEDULE],
        apply="1",
        request_id="b-2",
        reason="replay",
        start=start_at.isoformat(),
        end=end.isoformat(),
        concurrency="1",
    )
    assert any("backfill of every-second recorded" in m for m in _messages(done))
    actor, reason, params, _ = _actions(site, "backfill")[-1]
    assert (actor, reason) == ("operator", "replay")
    assert params["ticks"] == 4
    assert params["from"] == start_at.isoformat()


def test_outbox_retry_needs_its_permission_and_goes_through_the_outbox_admin(site: str) -> None:
    dead = _outbox_row(site, f"dead-{time.monotonic_ns()}", "DEAD")
    published = _outbox_row(site, f"published-{time.monotonic_ns()}", "PUBLISHED")
    denied = _client("no-retry")
    assert 'value="retry"' not in denied.get(OUTBOX).content.decode()
    assert _post_action(denied, "retry", [str(dead)], url=OUTBOX).status_code == 403
    assert _one(site, "SELECT status FROM outbox WHERE id = %s", dead) == "DEAD"
    client = _client("operator")
    assert 'value="retry"' in client.get(OUTBOX).content.decode()
    done = _post_action(client, "retry", [str(dead), str(published)], url=OUTBOX, index="0")
    texts = _messages(done)
    assert any(f"retried #{dead}" in m for m in texts), texts
    assert any(f"not retried #{published}" in m for m in texts), texts
    assert _one(site, "SELECT status, attempts FROM outbox WHERE id = %s", dead) == (
        "PENDING",
        0,
    )
    assert _one(site, "SELECT status FROM outbox WHERE id = %s", published) == "PUBLISHED"


def test_actions_are_csrf_protected(site: str) -> None:
    client = _client("operator", csrf=True)
    refused = _post_action(client, "pause", [SCHEDULE], apply="1", request_id="c-1")
    assert refused.status_code == 403
    assert b"CSRF" in refused.content
    assert not _paused(site)
    form = _post_action(client, "pause", [SCHEDULE], csrfmiddlewaretoken="x")
    assert form.status_code == 403
    page = client.get(LIST)
    token = page.context["csrf_token"]
    shown = _post_action(client, "pause", [SCHEDULE], csrfmiddlewaretoken=str(token))
    assert shown.status_code == 200
    done = _post_action(
        client,
        "pause",
        [SCHEDULE],
        apply="1",
        request_id="c-2",
        reason="csrf",
        csrfmiddlewaretoken=str(token),
    )
    assert any("pause of every-second recorded" in m for m in _messages(done))
    assert _paused(site)
    _post_action(
        client, "resume", [SCHEDULE], apply="1", request_id="c-3", csrfmiddlewaretoken=str(token)
    )
    assert not _paused(site)


def test_the_admin_models_need_no_migration(site: str) -> None:
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    call_command("makemigrations", "sdcore", "--check", "--dry-run", stdout=out)
    assert "No changes detected" in out.getvalue()


@pytest.fixture(scope="module")
def mounted(site: str) -> Iterator[str]:
    """The test project's ASGI application with the dashboard at /sdcore, served by uvicorn."""
    import threading

    import uvicorn
    from django.core.asgi import get_asgi_application

    from sdcore.django import dashboard_asgi
    from tests.integration._dashboard import free_port

    port = free_port()
    config = uvicorn.Config(
        dashboard_asgi(get_asgi_application()),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="on",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    _wait(lambda: server.started or not thread.is_alive(), "uvicorn")
    assert thread.is_alive()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def _browser(base: str, username: str | None = None) -> Any:
    """An HTTP client holding ``username``'s Django session cookie (none: anonymous)."""
    import httpx
    from django.conf import settings

    client = httpx.Client(base_url=base, follow_redirects=False, timeout=10)
    if username is not None:
        session = _client(username).cookies[settings.SESSION_COOKIE_NAME].value
        client.cookies.set(settings.SESSION_COOKIE_NAME, session)
    return client


def _dashboard_csrf(client: Any) -> str:
    page = client.get("/sdcore/schedule", params={"name": SCHEDULE})
    assert page.status_code == 200, page.text
    found = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert found is not None
    return found.group(1)


def test_the_dashboard_mount_sends_visitors_to_the_login_page(mounted: str) -> None:
    from django.contrib.auth.models import User

    User.objects.get_or_create(username="customer", is_staff=False)
    for who in (None, "customer"):
        with _browser(mounted, who) as client:
            answer = client.get("/sdcore/outbox", params={"status": "DEAD"})
        assert answer.status_code == 302, who
        assert answer.headers["location"] == "/admin/login/?next=/sdcore/outbox%3Fstatus%3DDEAD"
    with _browser(mounted) as client:
        assert client.get("/admin/login/").status_code == 200  # Django's own pages
    with _browser(mounted, "operator") as client:
        spoofed = client.get("/sdcore/", headers={"host": "evil.example"})
    assert spoofed.status_code == 400


def test_the_dashboard_mount_is_read_only_for_staff_without_the_permissions(
    mounted: str, site: str
) -> None:
    with _browser(mounted, "viewer") as client:
        page = client.get("/sdcore/")
        assert page.status_code == 200
        assert SCHEDULE in page.text
        assert 'name="csrf"' not in client.get("/sdcore/schedule", params={"name": SCHEDULE}).text
        refused = client.post(
            "/sdcore/schedule/pause", data={"name": SCHEDULE, "csrf": "x", "reason": "no"}
        )
    assert refused.status_code == 401
    assert not _paused(site)


def test_the_dashboard_mount_acts_as_the_django_user(mounted: str, site: str) -> None:
    with _browser(mounted, "operator") as client:
        _act_on_the_dashboard(client, site)


def _act_on_the_dashboard(client: Any, site: str) -> None:
    done = client.post(
        "/sdcore/schedule/pause",
        data={"name": SCHEDULE, "csrf": _dashboard_csrf(client), "reason": "from the dashboard"},
    )
    assert done.status_code == 303, done.text
    assert _actions(site, "pause")[-1][:2] == ("operator (dashboard)", "from the dashboard")
    assert _paused(site)
    forged = client.post("/sdcore/schedule/resume", data={"name": SCHEDULE, "csrf": "x"})
    assert forged.status_code == 403
    assert _paused(site)
    resumed = client.post(
        "/sdcore/schedule/resume", data={"name": SCHEDULE, "csrf": _dashboard_csrf(client)}
    )
    assert resumed.status_code == 303, resumed.text
    assert not _paused(site)


SCHEMA_READS = """
from sdcore.django.models import OutboxMessage, Schedule, ScheduleAction, ScheduleRun
print("tables", [m._meta.db_table for m in (Schedule, ScheduleRun, ScheduleAction, OutboxMessage)])
print("counts", [m.objects.count() for m in (Schedule, ScheduleRun, ScheduleAction, OutboxMessage)])
"""


def test_the_models_follow_sdcore_schema(empty_dsn: str) -> None:
    env = environment(empty_dsn, SDCORE_DJANGO_SCHEMA="sdcore_app")
    migrated = manage(empty_dsn, "migrate", env=env)
    assert migrated.returncode == 0, migrated.stderr
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO sdcore_app.outbox (idempotency_key, queue, name, job_id, payload,"
            " max_attempts, message_digest) VALUES ('k', 'q', 'n', 'j', '{}', 3, '\\\\x00')"
        )
    read = manage(empty_dsn, "shell", "-c", SCHEMA_READS, env=env)
    assert read.returncode == 0, read.stderr
    assert '\'"sdcore_app"."sdcore_schedules_runs"\'' in read.stdout
    assert "counts [0, 0, 0, 1]" in read.stdout


NAIVE_LIST = """
from django.contrib.auth.models import User
from django.test import Client
from django.test.utils import setup_test_environment

setup_test_environment()
client = Client()
client.force_login(User.objects.create_superuser("root"))
page = client.get("/admin/sdcore/schedule/")
print("status", page.status_code)
text = page.content.decode()
print("hostile", "<img src=x" in text, "&lt;img src=x" in text)
row = page.context["cl"].result_list[1]
print("missed", row.sdcore_status.missed, "last", "never" in page.content.decode())
end = "2020-01-01 00:00:10"
done = client.post(
    "/admin/sdcore/schedule/",
    {"action": "backfill", "_selected_action": ["nightly"], "apply": "1", "request_id": "n-1",
     "start": "2020-01-01 00:00:00", "end": end, "concurrency": "1"},
    follow=True,
)
print("messages", [str(m) for m in done.context["messages"]])
"""


def test_the_list_and_a_backfill_work_with_use_tz_false(empty_dsn: str) -> None:
    env = environment(empty_dsn, SDCORE_DJANGO_USE_TZ="0")
    migrated = manage(empty_dsn, "migrate", env=env)
    assert migrated.returncode == 0, migrated.stderr
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute(  # a stored schedule made an hour ago (fixture data, not the admin's)
            "INSERT INTO sdcore_schedules (name, origin, kind, expression, fingerprint,"
            " handler, created_at) VALUES ('nightly', 'stored', 'cron', '*/5 * * * *', 'f',"
            " 'h', now() - interval '1 hour')"
        )
        conn.execute(
            "INSERT INTO sdcore_schedules (name, origin, kind, expression, fingerprint,"
            " handler) VALUES (%s, 'stored', 'interval', '60000', 'f', %s)",
            (HOSTILE, HOSTILE),
        )
    shown = manage(empty_dsn, "shell", "-c", NAIVE_LIST, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "status 200" in shown.stdout
    assert "hostile False True" in shown.stdout  # escaped wherever it is shown
    assert "missed 11 last True" in shown.stdout or "missed 12 last True" in shown.stdout
    # Naive times in TIME_ZONE reach the control plane aware: its own refusal (no replica
    # registers the handler), not a naive/aware comparison error.
    assert "no running replica registers its handler" in shown.stdout, shown.stdout
