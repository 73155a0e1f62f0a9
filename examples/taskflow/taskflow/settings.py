"""Settings, read once from the environment at start-up (the library itself never reads it)."""

from __future__ import annotations

import math
import os
import socket
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

DEFAULT_OVERDUE_CRON = "0 01 * * *"  # NestJS CronExpression.EVERY_DAY_AT_1AM
MIN_SECRET_BYTES = 32  # RFC 7518 §3.2: an HS256 key is at least as long as the hash
# Estimated as Shannon entropy of the secret's bytes times its length: "a"*32 is 0 bits,
# "changeme"*4 88, secrets.token_urlsafe(32) about 200.
MIN_SECRET_BITS = 128
DEFAULT_ISSUER = "taskflow"
DEFAULT_AUDIENCE = "taskflow-api"
DEFAULT_MAX_TOKEN_AGE_S = 24 * 3600
DEFAULT_MAX_BODY_BYTES = 64 * 1024  # the largest real body (100 member ids) is under 5 KB
_GENERATE = "generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"
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
        jwt_issuer: ``TASKFLOW_JWT_ISSUER``, the ``iss`` every token must carry.
        jwt_audience: ``TASKFLOW_JWT_AUDIENCE``, the ``aud`` every token must name.
        jwt_max_age_s: ``TASKFLOW_JWT_MAX_AGE_S``, the longest lifetime (``exp - iat``) accepted.
        max_body_bytes: ``TASKFLOW_MAX_BODY_BYTES``, larger request bodies get a 413 unread.
        operator_ids: ``TASKFLOW_OPERATOR_IDS``, comma-separated user ids whose token shows the
            details of ``/health`` (everyone else sees only ``{"status": ...}``).
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
    jwt_issuer: str = DEFAULT_ISSUER
    jwt_audience: str = DEFAULT_AUDIENCE
    jwt_max_age_s: int = DEFAULT_MAX_TOKEN_AGE_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    operator_ids: frozenset[uuid.UUID] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        database_url(self.database_url)  # validates
        check_secret(self.jwt_secret)
        check_cron(self.overdue_cron)
        if not self.jwt_issuer or not self.jwt_audience:
            raise SettingsError("TASKFLOW_JWT_ISSUER and TASKFLOW_JWT_AUDIENCE must not be empty")
        if not 60 <= self.jwt_max_age_s <= 30 * 86400:
            raise SettingsError("TASKFLOW_JWT_MAX_AGE_S must be from 60 to 2592000 (30 days)")
        if not 1024 <= self.max_body_bytes <= 16 * 1024 * 1024:
            raise SettingsError("TASKFLOW_MAX_BODY_BYTES must be from 1024 to 16777216")
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
            jwt_issuer=env.get("TASKFLOW_JWT_ISSUER", "").strip() or DEFAULT_ISSUER,
            jwt_audience=env.get("TASKFLOW_JWT_AUDIENCE", "").strip() or DEFAULT_AUDIENCE,
            jwt_max_age_s=_int(env, "TASKFLOW_JWT_MAX_AGE_S", DEFAULT_MAX_TOKEN_AGE_S),
            max_body_bytes=_int(env, "TASKFLOW_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES),
            operator_ids=_uuids(env, "TASKFLOW_OPERATOR_IDS"),
        )


def secret_bits(secret: str) -> float:
    """Estimate the entropy of ``secret`` in bits: Shannon entropy of its bytes × its length.

    An overestimate for structured text (``"abcdefghijklmnopqrstuvwxyz012345"`` scores 160), but
    it catches what length alone accepts: ``"a"*32`` (0), ``" "*32`` (0), ``"changeme"*4`` (88).
    """
    data = secret.encode()
    if not data:
        return 0.0
    total = len(data)
    per_byte = -sum(n / total * math.log2(n / total) for n in Counter(data).values())
    return abs(per_byte * total)  # abs: one distinct byte gives -0.0


def check_secret(secret: str) -> None:
    """Refuse an HS256 secret that is short or has little entropy.

    Raises:
        SettingsError: Fewer than 32 bytes, or fewer than 128 estimated bits.
    """
    if len(secret.encode()) < MIN_SECRET_BYTES:
        raise SettingsError(
            f"TASKFLOW_JWT_SECRET must hold at least {MIN_SECRET_BYTES} bytes (HS256); {_GENERATE}"
        )
    bits = secret_bits(secret)
    if bits < MIN_SECRET_BITS:
        raise SettingsError(
            f"TASKFLOW_JWT_SECRET is too predictable (about {bits:.0f} bits of entropy, at least "
            f"{MIN_SECRET_BITS} needed: repeated or few distinct characters); {_GENERATE}"
        )


def check_cron(expression: str) -> None:
    """Refuse a ``TASKFLOW_OVERDUE_CRON`` the scheduler would reject, with its reason.

    Raises:
        SettingsError: The expression does not parse.
    """
    from sdcore.scheduling import InvalidScheduleError, Scheduler

    from taskflow.clock import APP_TIME_ZONE

    async def noop(tick: object) -> None:
        return None

    try:
        Scheduler().add_cron("check", expression, noop, time_zone=APP_TIME_ZONE, exclusive=False)
    except InvalidScheduleError as exc:
        reason = str(exc).removeprefix("schedule 'check': ")
        raise SettingsError(f"TASKFLOW_OVERDUE_CRON is not valid: {reason}") from None


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


def _uuids(env: Mapping[str, str], name: str) -> frozenset[uuid.UUID]:
    ids = set()
    for raw in env.get(name, "").replace(" ", "").split(","):
        if raw:
            try:
                ids.add(uuid.UUID(raw))
            except ValueError:
                raise SettingsError(f"{name} must list user ids (UUIDs), got {raw!r:.40}") from None
    return frozenset(ids)


def _bool(env: Mapping[str, str], name: str, *, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name} must be 0 or 1, got {raw!r:.40}")
