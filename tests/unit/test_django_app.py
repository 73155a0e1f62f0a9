"""``sdcore.django`` without a database: its migration files and its settings checks."""

from __future__ import annotations

import re
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from psycopg.conninfo import conninfo_to_dict

from sdcore.django import SdcoreSettings
from sdcore.django._runtime import add_processors
from sdcore.django._settings import check_database, conninfo_of
from sdcore.postgres import migrations
from sdcore.queues import Processor
from sdcore.runtime import Runtime

MIGRATIONS = Path(__file__).resolve().parents[2] / "src" / "sdcore" / "django" / "migrations"
_CALL = re.compile(r'sdcore_migration\("(\w+)", (\d+), after=(None|"\w+")\)')
# Django migrations of the app's own (unmanaged) models, between sdcore's steps.
MODEL_MIGRATIONS = {"0018_admin_models"}


def test_one_django_migration_per_sdcore_step_in_order() -> None:
    steps = [
        (c, m.version, m.slug) for c in ("lease", "outbox", "schedules") for m in migrations(c)
    ]
    every = sorted(p for p in MIGRATIONS.glob("0*.py"))
    assert [int(p.name[:4]) for p in every] == list(range(1, len(every) + 1))
    assert {p.stem for p in every} >= MODEL_MIGRATIONS
    files = [p for p in every if p.stem not in MODEL_MIGRATIONS]
    assert [p.name[5:] for p in files] == [f"{c}_{slug}.py" for c, _, slug in steps]
    previous = "None"
    for path in every:
        text = path.read_text(encoding="utf-8")
        if path.stem in MODEL_MIGRATIONS:
            assert f'("sdcore", {previous})' in text, path.name
        else:
            component, version, _ = steps[files.index(path)]
            found = _CALL.search(text)
            assert found is not None, path.name
            assert found.groups() == (component, str(version), previous), path.name
        previous = f'"{path.stem}"'


def test_settings_defaults_and_refusals() -> None:
    assert SdcoreSettings.from_mapping(None) == SdcoreSettings()
    chosen = SdcoreSettings.from_mapping({"REDIS_URL": "", "SCHEMA": "app", "RELAY": False})
    assert (chosen.redis_url, chosen.schema, chosen.relay) == (None, "app", False)
    with pytest.raises(ImproperlyConfigured, match=r"SDCORE\['GRACE_PERIOD_MS'\] must be an int"):
        SdcoreSettings.from_mapping({"GRACE_PERIOD_MS": 1.5})
    with pytest.raises(ImproperlyConfigured, match="SDCORE must be a dict, got list"):
        SdcoreSettings.from_mapping([])


def test_a_cluster_url_takes_the_queue_prefix_setting_with_a_hash_tag() -> None:
    cluster = "redis+cluster://127.0.0.1:7000"
    with pytest.raises(ImproperlyConfigured, match=r"SDCORE\['QUEUE_PREFIX'\].*hash tag.*'bull'"):
        SdcoreSettings.from_mapping({"REDIS_URL": cluster})
    chosen = SdcoreSettings.from_mapping({"REDIS_URL": cluster, "QUEUE_PREFIX": "{bull}"})
    assert (chosen.redis_url, chosen.queue_prefix) == (cluster, "{bull}")
    assert SdcoreSettings.from_mapping({"REDIS_URL": "redis://h/0"}).queue_prefix == "bull"
    with pytest.raises(ImproperlyConfigured, match=r"SDCORE\['REDIS_URL'\]: .*scheme 'http'"):
        SdcoreSettings.from_mapping({"REDIS_URL": "http://h"})


def test_only_postgresql_is_accepted() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"needs PostgreSQL.*mysql"):
        check_database("default", {"default": {"ENGINE": "django.db.backends.mysql"}})
    check_database("default", {"default": {"ENGINE": "django.db.backends.postgresql"}})
    # A backend built on Django's PostgreSQL one is PostgreSQL too.
    check_database("default", {"default": {"ENGINE": "tests.django_project.wrapped_backend"}})
    for engine in ("django.db.backends.sqlite3", "no.such.backend", ""):
        with pytest.raises(ImproperlyConfigured, match="needs PostgreSQL"):
            check_database("default", {"default": {"ENGINE": engine}})


def test_the_dsn_keeps_libpq_keywords_only() -> None:
    params = {
        "dbname": "app",
        "user": "u",
        "password": "p w'x",
        "host": "db",
        "port": 5433,
        "sslmode": "require",
        "client_encoding": "UTF8",
        "cursor_factory": object(),
        "prepare_threshold": None,
        "server_side_binding": True,
        "context": object(),
    }
    assert conninfo_to_dict(conninfo_of(params)) == {
        "dbname": "app",
        "user": "u",
        "password": "p w'x",
        "host": "db",
        "port": "5433",
        "sslmode": "require",
        "client_encoding": "UTF8",
    }


@pytest.mark.parametrize("path", ["sdcore", "/", "", "/sd core", "/a?b"])
def test_the_dashboard_mount_path_is_checked(path: str) -> None:
    from sdcore.django import dashboard_asgi

    async def app(scope: object, receive: object, send: object) -> None:
        raise AssertionError("not reached")

    with pytest.raises(ValueError, match="path must be an absolute path below the root"):
        dashboard_asgi(app, path=path)
    assert dashboard_asgi(app, path="/ops/sdcore/") is not None


def test_the_dashboard_mount_refuses_websockets_unread() -> None:
    import asyncio

    from sdcore.django import dashboard_asgi

    async def django_app(scope: object, receive: object, send: object) -> None:
        raise AssertionError("Django is not reached")

    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> MutableMapping[str, Any]:
        raise AssertionError("nothing is read")

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    async def call() -> None:
        scope = {"type": "websocket", "path": "/sdcore/ws", "headers": [], "query_string": b""}
        await dashboard_asgi(django_app)(scope, receive, send)

    asyncio.run(call())
    assert sent == [{"type": "websocket.close", "code": 1008}]


# Processors the PROCESSORS setting names (tests.unit.test_django_app.<name>).
class MailProcessor(Processor):
    queue = "mail"

    async def process(self, job: Any) -> None:
        pass


def both_queues() -> list[Processor]:
    second = MailProcessor()
    second.queue = "sms"
    return [MailProcessor(), second]


NOT_A_PROCESSOR = object()
HERE = "tests.unit.test_django_app"


def test_queue_prefix_and_processors_settings() -> None:
    chosen = SdcoreSettings.from_mapping(
        {"QUEUE_PREFIX": "{bull}", "PROCESSORS": [f"{HERE}.MailProcessor"]}
    )
    assert (chosen.queue_prefix, chosen.processors) == ("{bull}", (f"{HERE}.MailProcessor",))
    assert SdcoreSettings().queue_prefix == "bull"
    with pytest.raises(ImproperlyConfigured, match=r"PROCESSORS'\] must be a list"):
        SdcoreSettings.from_mapping({"PROCESSORS": f"{HERE}.MailProcessor"})
    with pytest.raises(ImproperlyConfigured, match="a dotted path names a module"):
        SdcoreSettings.from_mapping({"PROCESSORS": ["MailProcessor"]})
    with pytest.raises(ImproperlyConfigured, match=r"QUEUE_PREFIX'\] must be a non-blank str"):
        SdcoreSettings.from_mapping({"QUEUE_PREFIX": 3})


def test_the_worker_adds_the_processors_the_settings_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runtime = Runtime("postgresql://u@h/db", redis_url="redis://127.0.0.1:6379/0")
    add_processors(runtime, (f"{HERE}.MailProcessor",))
    assert [type(p).__name__ for p in runtime.processors] == ["MailProcessor"]
    with pytest.raises(ImproperlyConfigured, match="a second processor of queue 'mail'"):
        add_processors(runtime, (f"{HERE}.both_queues",))
    runtime = Runtime("postgresql://u@h/db", redis_url="redis://127.0.0.1:6379/0")
    add_processors(runtime, (f"{HERE}.both_queues",))
    assert [p.queue for p in runtime.processors] == ["mail", "sms"]
    with pytest.raises(
        ImproperlyConfigured, match=r"gives object, not a sdcore\.queues\.Processor"
    ):
        add_processors(runtime, (f"{HERE}.NOT_A_PROCESSOR",))
    with pytest.raises(ImproperlyConfigured, match=r"'nowhere\.Mail' does not import"):
        add_processors(runtime, ("nowhere.Mail",))
    without_redis = Runtime("postgresql://u@h/db")
    add_processors(without_redis, ("nowhere.Mail",))  # not imported: no queue runs
    assert without_redis.processors == []
    assert "no queue processor runs" in caplog.text
