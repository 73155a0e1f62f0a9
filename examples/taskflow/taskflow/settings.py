"""Settings, read once from the environment at start-up (the library itself never reads it)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

DEFAULT_OVERDUE_CRON = "0 01 * * *"  # NestJS CronExpression.EVERY_DAY_AT_1AM
MIN_SECRET_BYTES = 32  # RFC 7518 §3.2: an HS256 key is at least as long as the hash
_SCHEMES = {"postgres", "postgresql", "postgresql+psycopg"}


class SettingsError(ValueError):
    """The environment does not describe a runnable TaskFlow (the message says how to fix it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Everything TaskFlow reads from its environment.

    Attributes:
        database_url: ``DATABASE_URL``, a ``postgresql://`` URL (``postgresql+psycopg://`` too).
        jwt_secret: ``TASKFLOW_JWT_SECRET``, the HS256 key of the Bearer tokens (≥ 32 bytes).
        redis_url: ``REDIS_URL``; ``None`` runs without queues (simulated e-mails).
        overdue_cron: ``TASKFLOW_OVERDUE_CRON``, when ``mark-overdue-tasks`` fires (Paris time).
        overdue_catch_up_ms: ``TASKFLOW_OVERDUE_CATCH_UP_MS``: at start, run the latest tick
            missed within this window (all replicas were down at 01:00); ``0`` turns it off.
        queue_prefix: ``TASKFLOW_QUEUE_PREFIX``, the BullMQ key prefix.
        notify_attempts: ``TASKFLOW_NOTIFY_ATTEMPTS``, attempts of a notification job.
        notify_backoff_ms: ``TASKFLOW_NOTIFY_BACKOFF_MS``, first retry delay (exponential).
        run_workers: ``TASKFLOW_RUN_WORKERS`` (default ``1``): process notification jobs in the
            API process; ``0`` leaves them to ``python -m taskflow.worker``.
        replica_name: ``TASKFLOW_REPLICA_NAME``, shown in logs and in the overdue job's ledger.
    """

    database_url: str
    jwt_secret: str
    redis_url: str | None = None
    overdue_cron: str = DEFAULT_OVERDUE_CRON
    overdue_catch_up_ms: int = 6 * 3600 * 1000
    queue_prefix: str = "bull"
    notify_attempts: int = 5
    notify_backoff_ms: int = 1000
    run_workers: bool = True
    replica_name: str = ""

    def __post_init__(self) -> None:
        database_url(self.database_url)  # validates
        if len(self.jwt_secret.encode()) < MIN_SECRET_BYTES:
            raise SettingsError(
                f"TASKFLOW_JWT_SECRET must hold at least {MIN_SECRET_BYTES} bytes (HS256); "
                "generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        if self.redis_url is not None and urlsplit(self.redis_url).scheme not in (
            "redis",
            "rediss",
            "unix",
        ):
            raise SettingsError("REDIS_URL must start with redis://, rediss:// or unix://")
        if not 1 <= self.notify_attempts <= 100:
            raise SettingsError("TASKFLOW_NOTIFY_ATTEMPTS must be from 1 to 100")
        if self.notify_backoff_ms < 0 or self.overdue_catch_up_ms < 0:
            raise SettingsError("durations must not be negative")
        if not self.replica_name:
            object.__setattr__(self, "replica_name", f"{socket.gethostname()}:{os.getpid()}")

    @property
    def queues_enabled(self) -> bool:
        """Whether a Redis URL is set (the seed's ``ConditionalModule.registerWhen``)."""
        return self.redis_url is not None

    @property
    def libpq_url(self) -> str:
        """The database URL for psycopg and sdcore (``postgresql://``)."""
        return database_url(self.database_url)

    @property
    def sqlalchemy_url(self) -> str:
        """The database URL for SQLAlchemy's async engine (``postgresql+psycopg://``)."""
        return "postgresql+psycopg" + self.libpq_url.removeprefix("postgresql")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read the settings from ``environ`` (default: ``os.environ``).

        Raises:
            SettingsError: A required variable is missing or a value is invalid.
        """
        env = os.environ if environ is None else environ
        url = env.get("DATABASE_URL", "").strip()
        if not url:
            raise SettingsError(
                "DATABASE_URL is not set: point it at PostgreSQL, e.g. "
                "postgresql://postgres@127.0.0.1:5432/taskflow"
            )
        secret = env.get("TASKFLOW_JWT_SECRET", "")
        if not secret:
            raise SettingsError(
                "TASKFLOW_JWT_SECRET is not set: TaskFlow refuses to start without the key that "
                "signs its Bearer tokens. Generate one with: "
                "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        return cls(
            database_url=url,
            jwt_secret=secret,
            redis_url=env.get("REDIS_URL", "").strip() or None,
            overdue_cron=env.get("TASKFLOW_OVERDUE_CRON", "").strip() or DEFAULT_OVERDUE_CRON,
            overdue_catch_up_ms=_int(env, "TASKFLOW_OVERDUE_CATCH_UP_MS", 6 * 3600 * 1000),
            queue_prefix=env.get("TASKFLOW_QUEUE_PREFIX", "").strip() or "bull",
            notify_attempts=_int(env, "TASKFLOW_NOTIFY_ATTEMPTS", 5),
            notify_backoff_ms=_int(env, "TASKFLOW_NOTIFY_BACKOFF_MS", 1000),
            run_workers=_bool(env, "TASKFLOW_RUN_WORKERS", default=True),
            replica_name=env.get("TASKFLOW_REPLICA_NAME", "").strip(),
        )


def database_url(url: str) -> str:
    """Normalize a PostgreSQL URL to ``postgresql://…`` (libpq, psycopg, sdcore).

    Raises:
        SettingsError: Not a PostgreSQL URL, or a driver other than psycopg.
    """
    parts = urlsplit(url.strip())
    if parts.scheme not in _SCHEMES or not parts.path.strip("/"):
        raise SettingsError(
            "DATABASE_URL must look like postgresql://user[:password]@host:port/dbname "
            "(postgresql+psycopg:// is accepted too)"
        )
    return urlunsplit(parts._replace(scheme="postgresql"))


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SettingsError(f"{name} must be an integer, got {raw!r:.40}") from None


def _bool(env: Mapping[str, str], name: str, *, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name} must be 0 or 1, got {raw!r:.40}")
