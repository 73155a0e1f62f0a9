"""``sdcore.django.enqueue_once`` on Django's connection, against real PostgreSQL.

Each script runs in the test project (``manage.py shell -c``): commit, rollback (whole and of
an inner ``atomic()``), outside ``atomic()``, bad input, and the relay woken at commit only.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from sdcore.outbox import OutboxKeyConflictError, OutboxRelay, PostgresOutboxStore
from sdcore.sync import Outbox
from sdcore.testing import RecordingPublisher
from tests.django_project.harness import environment, manage

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

CASES = r"""
import json
from django.conf import settings
from django.db import connection, transaction
from django.db.transaction import TransactionManagementError
from django.test.utils import CaptureQueriesContext
from sdcore.django import AtomicBlockRequiredError, enqueue_once
from sdcore.outbox import (
    InvalidOutboxMessageError, OutboxKeyConflictError, OutboxTransactionRequiredError,
)
from tickapp.models import TickRow

out = {}
message = {"queue": "mail", "name": "notify", "payload": {"task": 1}}

with transaction.atomic(), CaptureQueriesContext(connection) as seen:
    out["first"] = enqueue_once(idempotency_key="committed", **message)
    out["again"] = enqueue_once(idempotency_key="committed", **message)
out["logged"] = any("INSERT INTO" in q["sql"] for q in seen.captured_queries)

try:
    with transaction.atomic():
        enqueue_once(idempotency_key="rolled-back", **message)
        raise RuntimeError("the view failed")
except RuntimeError:
    pass

with transaction.atomic():
    enqueue_once(idempotency_key="outer", **message)
    try:
        with transaction.atomic():
            enqueue_once(idempotency_key="inner", **message)
            raise RuntimeError("the inner block failed")
    except RuntimeError:
        pass

try:
    enqueue_once(idempotency_key="autocommit", **message)
except AtomicBlockRequiredError as exc:
    out["outside"] = [
        str(exc),
        isinstance(exc, OutboxTransactionRequiredError),
        isinstance(exc, TransactionManagementError),
    ]

with transaction.atomic():
    try:
        enqueue_once(idempotency_key="bad", queue="no spaces", name="n", payload={})
    except InvalidOutboxMessageError as exc:
        out["bad_queue"] = str(exc)
    try:
        enqueue_once(idempotency_key="bad", queue="q", name="n", payload={"x": object()})
    except Exception as exc:
        out["bad_payload"] = type(exc).__name__
    try:
        enqueue_once(idempotency_key="committed", queue="mail", name="other", payload={})
    except OutboxKeyConflictError as exc:
        out["conflict"] = str(exc)
    try:
        enqueue_once(idempotency_key="x", using=3, **message)
    except TypeError as exc:
        out["bad_using"] = str(exc)
    # The transaction is still usable: the ORM and another enqueue commit with it.
    out["usable"] = TickRow.objects.count()
    enqueue_once(idempotency_key="after-errors", **message)

try:
    with transaction.atomic():
        transaction.set_rollback(True)  # Django refuses queries until the block ends
        enqueue_once(idempotency_key="doomed", **message)
except TransactionManagementError as exc:
    out["doomed"] = str(exc)

settings.DATABASES["lite"] = {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}
for alias in ("lite", "missing"):
    try:
        enqueue_once(idempotency_key="elsewhere", using=alias, **message)
    except Exception as exc:
        out[alias] = f"{type(exc).__name__}: {exc}"

print("RESULT", json.dumps(out))
"""


BINDING = """
from django.db import connection
with connection.cursor() as cursor:
    print("CURSOR", type(cursor.cursor).__name__)
"""


def _result(stdout: str) -> dict[str, Any]:
    line = next(line for line in stdout.splitlines() if line.startswith("RESULT "))
    found: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return found


def _migrated(dsn: str) -> None:
    result = manage(dsn, "migrate")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "settings",
    ["project.settings", "project.settings_server_binding"],
    ids=["client-binding", "server-binding"],
)
def test_enqueue_once_joins_the_callers_transaction(empty_dsn: str, settings: str) -> None:
    _migrated(empty_dsn)
    env = environment(empty_dsn, DJANGO_SETTINGS_MODULE=settings)
    result = manage(empty_dsn, "shell", "-c", CASES + BINDING, env=env)
    assert result.returncode == 0, result.stderr
    out = _result(result.stdout)
    expected = "ServerBindingCursor" if settings.endswith("binding") else "Cursor"
    assert f"CURSOR {expected}" in result.stdout.splitlines()
    assert (out["first"], out["again"]) == (True, False)
    assert out["logged"]  # through Django's cursor: in its query log
    text, is_outbox_error, is_django_error = out["outside"]
    assert "not inside transaction.atomic()" in text
    assert "with transaction.atomic(using='default'):" in text
    assert (is_outbox_error, is_django_error) == (True, True)
    assert "queue" in out["bad_queue"]
    assert out["bad_payload"] == "JsonTypeError"
    assert "committed" in out["conflict"]
    assert out["bad_using"] == "using must be a DATABASES alias (a str), got int"
    assert out["usable"] == 0
    assert "ImproperlyConfigured: sdcore.django needs PostgreSQL" in out["lite"]
    assert "django.db.backends.sqlite3" in out["lite"]
    assert "'missing', which is not in DATABASES" in out["missing"]
    assert "You can't execute queries until the end of the 'atomic' block" in out["doomed"]
    with psycopg.connect(empty_dsn) as conn:
        keys = {row[0] for row in conn.execute("SELECT idempotency_key FROM outbox").fetchall()}
    assert keys == {"committed", "outer", "after-errors"}
    # The same key through the psycopg path: the same row, the same rules.
    with psycopg.connect(empty_dsn) as conn, conn.transaction():
        same = Outbox().enqueue_once(
            conn, idempotency_key="committed", queue="mail", name="notify", payload={"task": 1}
        )
        assert same is False
        with pytest.raises(OutboxKeyConflictError):
            Outbox().enqueue_once(
                conn, idempotency_key="committed", queue="mail", name="notify", payload={}
            )


def test_enqueue_once_writes_to_the_schema_of_the_settings(empty_dsn: str) -> None:
    env = environment(empty_dsn, SDCORE_DJANGO_SCHEMA="sdcore_app")
    assert manage(empty_dsn, "migrate", env=env).returncode == 0
    code = (
        "from django.db import transaction\n"
        "from sdcore.django import enqueue_once\n"
        "with transaction.atomic():\n"
        "    enqueue_once(idempotency_key='k', queue='q', name='n', payload={})\n"
    )
    result = manage(empty_dsn, "shell", "-c", code, env=env)
    assert result.returncode == 0, result.stderr
    with psycopg.connect(empty_dsn) as conn:
        found = conn.execute("SELECT idempotency_key FROM sdcore_app.outbox").fetchall()
    assert found == [("k",)]


WAKE = r"""
import time
from django.db import transaction
from sdcore.django import enqueue_once

message = {"queue": "mail", "name": "notify", "payload": {}}
try:
    with transaction.atomic():
        enqueue_once(idempotency_key="rolled-back", **message)
        raise RuntimeError("rolled back")
except RuntimeError:
    pass
time.sleep(1.5)  # a wake from the rollback would have reached the relay by now
print("OPENED", time.time())
with transaction.atomic():
    enqueue_once(idempotency_key="committed", **message)
    time.sleep(1.0)  # written, not committed: the relay must not see it yet
    print("COMMITTING", time.time())
print("COMMITTED", time.time())
"""


class _TimedPublisher(RecordingPublisher):
    def __init__(self) -> None:
        super().__init__()
        self.at: list[float] = []

    async def publish(self, messages: Sequence[Any]) -> list[BaseException | None]:
        self.at += [time.time()] * len(messages)
        return await super().publish(messages)


def _stamp(stdout: str, word: str) -> float:
    return float(next(line for line in stdout.splitlines() if line.startswith(word)).split()[1])


async def test_the_relay_wakes_at_commit_and_not_at_a_rollback(empty_dsn: str) -> None:
    await asyncio.to_thread(_migrated, empty_dsn)
    publisher = _TimedPublisher()
    heard: list[float] = []
    async with (
        AsyncConnectionPool(empty_dsn, min_size=1, max_size=4, open=False) as pool,
        await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True) as listener,
    ):
        await pool.open()
        await listener.execute("LISTEN sdcore_outbox")

        async def listen() -> None:
            async for _ in listener.notifies():
                heard.append(time.time())

        listening = asyncio.create_task(listen())
        # Polling once a minute: only a NOTIFY can bring the row within the test's second.
        async with OutboxRelay(
            PostgresOutboxStore(pool), publisher, poll_interval_ms=60_000
        ) as relay:
            for _ in range(100):
                if relay.state.listening:
                    break
                await asyncio.sleep(0.05)
            assert relay.state.listening
            await asyncio.sleep(0.2)  # the catch-up round at start has found nothing
            result = await asyncio.to_thread(manage, empty_dsn, "shell", "-c", WAKE)
            assert result.returncode == 0, result.stderr
            for _ in range(100):
                if publisher.jobs:
                    break
                await asyncio.sleep(0.02)
        listening.cancel()
    opened = _stamp(result.stdout, "OPENED")
    committing = _stamp(result.stdout, "COMMITTING")
    committed = _stamp(result.stdout, "COMMITTED")
    assert [m.idempotency_key for m in publisher.publishes] == ["committed"]
    assert len(heard) == 1  # the rollback sent none
    assert committing <= heard[0] <= committed + 0.5
    assert heard[0] > opened + 0.9  # not while the transaction was open
    assert committing <= publisher.at[0] < committed + 1.0
