"""Unit tests, no network: the Paris business day, the overdue rule, tokens, the event, settings."""

from __future__ import annotations

import ast
import dataclasses
import time
import uuid
import warnings
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo

import jwt
import pytest
from jwt.warnings import InsecureKeyLengthWarning
from taskflow.auth import AuthUser, decode_token, encode_token
from taskflow.clock import business_day
from taskflow.db import TaskStatus
from taskflow.errors import UnauthorizedError
from taskflow.events import TASK_STATUS_CHANGED, TaskStatusChanged
from taskflow.overdue import is_overdue
from taskflow.settings import DEFAULT_OVERDUE_CRON, Settings, SettingsError

from tests.taskflow._support import EXAMPLE, SECRET

NOW = datetime(2026, 6, 30, 23, 0, tzinfo=UTC)
USER = uuid.UUID("7b0c7f4e-0d1c-4a55-9a7c-1f0e2a0c0001")


# --------------------------------------------------------------------------- business day


@pytest.mark.parametrize(
    ("instant", "day"),
    [
        # The seed's case: 01:00 in Paris on July 1st (summer, UTC+2) is still June 30 in UTC.
        (datetime(2026, 6, 30, 23, 0, tzinfo=UTC), date(2026, 7, 1)),
        (datetime(2026, 6, 30, 21, 59, 59, tzinfo=UTC), date(2026, 6, 30)),
        (datetime(2026, 6, 30, 22, 0, tzinfo=UTC), date(2026, 7, 1)),
        # Winter (UTC+1): the day changes at 23:00 UTC.
        (datetime(2026, 1, 15, 22, 59, 59, tzinfo=UTC), date(2026, 1, 15)),
        (datetime(2026, 1, 15, 23, 0, tzinfo=UTC), date(2026, 1, 16)),
        # Spring forward, 2026-03-29 (02:00 CET -> 03:00 CEST at 01:00 UTC).
        (datetime(2026, 3, 28, 22, 59, 59, tzinfo=UTC), date(2026, 3, 28)),
        (datetime(2026, 3, 28, 23, 0, tzinfo=UTC), date(2026, 3, 29)),
        (datetime(2026, 3, 29, 0, 0, tzinfo=UTC), date(2026, 3, 29)),  # 01:00 CET: the job
        (datetime(2026, 3, 29, 22, 0, tzinfo=UTC), date(2026, 3, 30)),  # already CEST
        # Fall back, 2026-10-25 (03:00 CEST -> 02:00 CET at 01:00 UTC).
        (datetime(2026, 10, 24, 21, 59, 59, tzinfo=UTC), date(2026, 10, 24)),
        (datetime(2026, 10, 24, 22, 0, tzinfo=UTC), date(2026, 10, 25)),
        (datetime(2026, 10, 24, 23, 0, tzinfo=UTC), date(2026, 10, 25)),  # 01:00 CEST: the job
        (datetime(2026, 10, 25, 22, 59, 59, tzinfo=UTC), date(2026, 10, 25)),  # now CET
        (datetime(2026, 10, 25, 23, 0, tzinfo=UTC), date(2026, 10, 26)),
        # Any zone in, the Paris day out.
        (datetime(2026, 6, 30, 20, 0, tzinfo=ZoneInfo("America/New_York")), date(2026, 7, 1)),
    ],
    ids=lambda value: value.isoformat() if isinstance(value, datetime) else str(value),
)
def test_business_day_is_the_calendar_day_in_paris(instant: datetime, day: date) -> None:
    assert business_day(instant) == day


def test_business_day_refuses_a_naive_instant() -> None:
    with pytest.raises(ValueError, match="aware"):
        business_day(datetime(2026, 7, 1, 1, 0))  # noqa: DTZ001 - the point of the test


# --------------------------------------------------------------------------- overdue rule

TODAY = date(2026, 7, 1)


@pytest.mark.parametrize(
    ("status", "due", "archived", "expected"),
    [
        (TaskStatus.TODO, date(2026, 6, 30), False, True),
        (TaskStatus.IN_PROGRESS, date(2025, 1, 1), False, True),
        (TaskStatus.TODO, TODAY, False, False),  # due today is not late yet
        (TaskStatus.TODO, date(2026, 7, 2), False, False),
        (TaskStatus.TODO, None, False, False),
        (TaskStatus.TODO, date(2026, 6, 30), True, False),  # archived
        (TaskStatus.DONE, date(2026, 6, 30), False, False),
        (TaskStatus.OVERDUE, date(2026, 6, 30), False, False),  # hence idempotent
    ],
    ids=[
        "todo-late",
        "in-progress-late",
        "due-today",
        "due-tomorrow",
        "no-due-date",
        "archived",
        "done",
        "already-overdue",
    ],
)
def test_overdue_rule(status: TaskStatus, due: date | None, archived: bool, expected: bool) -> None:
    assert is_overdue(status=status, due_date=due, archived=archived, today=TODAY) is expected


# --------------------------------------------------------------------------- tokens


def test_token_round_trip() -> None:
    token = encode_token(USER, SECRET, now=datetime.now(UTC), email="ada@example.com")
    assert decode_token(token, SECRET) == AuthUser(id=USER, email="ada@example.com")
    header = jwt.get_unverified_header(token)
    assert header["alg"] == "HS256"
    assert jwt.decode(token, options={"verify_signature": False})["sub"] == str(USER)


def _forge(claims: dict[str, object], *, key: str = SECRET, algorithm: str = "HS256") -> str:
    with warnings.catch_warnings():  # a short key for HS512 is the forger's business
        warnings.simplefilter("ignore", InsecureKeyLengthWarning)
        return jwt.encode(claims, key, algorithm=algorithm)


_NOW = int(time.time())


def _claims(**changes: object) -> dict[str, object]:
    """Valid claims for ``USER`` (issued now, one hour), with ``changes``; ``None`` drops one."""
    claims: dict[str, object] = {
        "sub": str(USER),
        "iss": "taskflow",
        "aud": "taskflow-api",
        "iat": _NOW,
        "exp": _NOW + 3600,
    }
    claims.update(changes)
    return {k: v for k, v in claims.items() if v is not None}


@pytest.mark.parametrize(
    ("token", "detail"),
    [
        (_forge(_claims(), key="another-secret" * 4), "not valid"),
        (_forge(_claims(iat=1_000, exp=1_000_000)), "expired"),
        (_forge(_claims(exp=None)), "not valid"),
        (_forge(_claims(sub=None)), "not valid"),
        (_forge(_claims(iat=None)), "not valid"),
        (_forge(_claims(sub="alice")), "subject"),
        (_forge(_claims(), algorithm="HS512"), "not valid"),
        (_forge(_claims(), key="", algorithm="none"), "not valid"),
        ("not-a-jwt", "not valid"),
        # What a valid signature does not vouch for: issuer, audience, lifetime, claim types.
        (_forge(_claims(iss="https://evil.example")), "not issued for this service"),
        (_forge(_claims(iss=None)), "not valid"),
        (_forge(_claims(aud="another-api")), "not issued for this service"),
        (_forge(_claims(aud=None)), "not valid"),
        (_forge(_claims(exp=_NOW + 100 * 365 * 86400)), "lives longer"),
        (_forge(_claims(exp=str(_NOW + 3600))), "not valid"),
        (_forge(_claims(iat=_NOW + 3600, exp=_NOW + 7200)), "not valid"),
        (_forge(_claims(email="a" * 400 + "@example.com")), "email"),
        (_forge(_claims(email="a\u0000@example.com")), "email"),
        (_forge(_claims(email=42)), "email"),
    ],
    ids=[
        "wrong-key",
        "expired",
        "no-exp",
        "no-sub",
        "no-iat",
        "sub-not-uuid",
        "hs512",
        "alg-none",
        "junk",
        "foreign-issuer",
        "no-issuer",
        "foreign-audience",
        "no-audience",
        "100-years",
        "exp-as-string",
        "iat-in-the-future",
        "email-too-long",
        "email-with-nul",
        "email-not-a-string",
    ],
)
def test_bad_tokens_are_unauthorized(token: str, detail: str) -> None:
    with pytest.raises(UnauthorizedError, match=detail) as caught:
        decode_token(token, SECRET)
    assert caught.value.status == 401


def test_issuer_audience_and_lifetime_come_from_the_settings() -> None:
    token = encode_token(
        USER, SECRET, now=datetime.now(UTC), ttl=timedelta(hours=30), issuer="idp", audience="tf"
    )
    assert decode_token(token, SECRET, issuer="idp", audience="tf", max_age_s=31 * 3600).id == USER
    with pytest.raises(UnauthorizedError, match="lives longer"):
        decode_token(token, SECRET, issuer="idp", audience="tf")
    with pytest.raises(UnauthorizedError, match="not issued"):
        decode_token(token, SECRET, issuer="taskflow", audience="tf", max_age_s=31 * 3600)


def test_expiry_follows_the_given_clock() -> None:
    issued = datetime(2020, 1, 1, tzinfo=UTC)
    token = encode_token(USER, SECRET, now=issued, ttl=timedelta(minutes=5))
    with pytest.raises(UnauthorizedError, match="expired"):
        decode_token(token, SECRET)


# --------------------------------------------------------------------------- the event


def _event() -> TaskStatusChanged:
    return TaskStatusChanged(
        task_id=uuid.UUID(int=1),
        project_id=uuid.UUID(int=2),
        from_status=TaskStatus.TODO,
        to_status=TaskStatus.DONE,
        changed_by=USER,
        occurred_at=NOW,
    )


def test_the_event_is_immutable_and_a_value() -> None:
    event = _event()
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.to_status = TaskStatus.TODO  # type: ignore[misc]
    with pytest.raises((AttributeError, TypeError)):
        event.extra = 1  # type: ignore[attr-defined]
    assert event == _event()
    assert hash(event) == hash(_event())
    assert TASK_STATUS_CHANGED == "task.status.changed"


def test_the_event_needs_every_field_by_keyword() -> None:
    with pytest.raises(TypeError):
        TaskStatusChanged(uuid.UUID(int=1))  # type: ignore[call-arg]


# --------------------------------------------------------------------------- settings

ENV = {"DATABASE_URL": "postgresql://app@db:5432/taskflow", "TASKFLOW_JWT_SECRET": SECRET}


def test_settings_from_the_environment() -> None:
    settings = Settings.from_env(ENV)
    assert settings.redis_url is None
    assert not settings.queues_enabled
    assert settings.overdue_cron == DEFAULT_OVERDUE_CRON == "0 01 * * *"
    assert settings.libpq_url == "postgresql://app@db:5432/taskflow"
    assert settings.sqlalchemy_url == "postgresql+psycopg://app@db:5432/taskflow"
    assert settings.replica_name  # host:pid by default
    queued = Settings.from_env(
        {
            **ENV,
            "REDIS_URL": "redis://cache:6379/0",
            "TASKFLOW_OVERDUE_CRON": "* * * * * *",
            "TASKFLOW_RUN_WORKERS": "0",
            "TASKFLOW_NOTIFY_BACKOFF_MS": "50",
        }
    )
    assert queued.queues_enabled
    assert queued.overdue_cron == "* * * * * *"
    assert queued.run_workers is False
    assert queued.notify_backoff_ms == 50


@pytest.mark.parametrize(
    "url",
    ["postgres://app@db/taskflow", "postgresql+psycopg://app@db/taskflow"],
    ids=["postgres", "psycopg"],
)
def test_database_url_spellings(url: str) -> None:
    settings = Settings.from_env({**ENV, "DATABASE_URL": url})
    assert settings.libpq_url == "postgresql://app@db/taskflow"
    assert settings.sqlalchemy_url == "postgresql+psycopg://app@db/taskflow"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DATABASE_URL": ENV["DATABASE_URL"]}, "TASKFLOW_JWT_SECRET is not set"),
        ({**ENV, "TASKFLOW_JWT_SECRET": "short"}, "at least 32 bytes"),
        ({"TASKFLOW_JWT_SECRET": SECRET}, "DATABASE_URL is not set"),
        ({**ENV, "DATABASE_URL": "mysql://db/x"}, "DATABASE_URL must look like"),
        ({**ENV, "DATABASE_URL": "postgresql+asyncpg://db/x"}, "DATABASE_URL must look like"),
        ({**ENV, "REDIS_URL": "localhost:6379"}, "REDIS_URL must start"),
        ({**ENV, "TASKFLOW_NOTIFY_ATTEMPTS": "five"}, "must be an integer"),
        ({**ENV, "TASKFLOW_RUN_WORKERS": "maybe"}, "must be 0 or 1"),
    ],
    ids=[
        "no-secret",
        "short-secret",
        "no-db",
        "not-postgres",
        "other-driver",
        "bad-redis",
        "bad-int",
        "bad-bool",
    ],
)
def test_settings_refuse_a_bad_environment(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_env(env)


# --------------------------------------------------------------------------- public API only

PUBLIC = {
    "sdcore.cli",
    "sdcore.demo",
    "sdcore.events",
    "sdcore.fastapi",
    "sdcore.job_scheduler",
    "sdcore.outbox",
    "sdcore.postgres",
    "sdcore.queues",
    "sdcore.runtime",
    "sdcore.scheduling",
    "sdcore.sqlalchemy",
}


def test_the_example_imports_only_sdcore_public_packages() -> None:
    imported: dict[str, str] = {}
    for path in sorted((EXAMPLE / "taskflow").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            for name in names:
                if name == "sdcore" or name.startswith("sdcore."):
                    imported[name] = path.name
    assert imported, "the example should use sdcore"
    assert set(imported) <= PUBLIC, imported
