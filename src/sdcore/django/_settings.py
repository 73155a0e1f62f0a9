"""``SDCORE = {...}``: the validated settings, and the libpq DSN of Django's database."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from psycopg import pq
from psycopg.conninfo import make_conninfo

from sdcore._internal.redis_url import RedisUrlError, UntaggedPrefixError, check_queue_target
from sdcore._internal.validation import Refusal, boolean, int_between, text

__all__ = ["SdcoreSettings", "database_url"]

POSTGRESQL_ENGINE = "django.db.backends.postgresql"
_KEYS = frozenset(
    {
        "DATABASE",
        "REDIS_URL",
        "QUEUE_PREFIX",
        "SCHEMA",
        "GRACE_PERIOD_MS",
        "POOL_SIZE",
        "TIME_ZONE",
        "RELAY",
        "SCHEDULING",
        "CONTROL",
        "PROCESSORS",
    }
)
# libpq's own keywords: Django's OPTIONS may also hold its own (isolation_level, pool,
# server_side_binding, assume_role, prepare_threshold…), which are no part of a conninfo.
_LIBPQ = frozenset(option.keyword.decode() for option in pq.Conninfo.get_defaults())


def _improperly_configured(message: str) -> Exception:
    from django.core.exceptions import ImproperlyConfigured

    error: Exception = ImproperlyConfigured(message)
    return error


def _refused(refusal: Refusal) -> Exception:
    return _improperly_configured(f"SDCORE[{refusal.name!r}] {refusal.problem}")


def _check_queue_prefix(redis_url: str | None, prefix: str) -> None:
    """Refuse a Redis URL sdcore cannot read, or a Cluster URL with an untagged prefix."""
    if redis_url is None:
        return
    try:
        check_queue_target(redis_url, prefix)
    except RedisUrlError as exc:
        raise _improperly_configured(f"SDCORE['REDIS_URL']: {exc}") from None
    except UntaggedPrefixError as exc:
        raise _improperly_configured(
            f"SDCORE['QUEUE_PREFIX'] with a redis+cluster:// REDIS_URL: {exc}"
        ) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class SdcoreSettings:
    """``settings.SDCORE``, validated.

    Attributes:
        database: The alias in ``DATABASES`` sdcore uses (``"DATABASE"``, default ``"default"``).
        redis_url: Redis for the outbox relay and the queue processors (``"REDIS_URL"``), or
            ``None``: outbox rows wait in PostgreSQL.
        queue_prefix: BullMQ key prefix of the relay and the queue processors
            (``"QUEUE_PREFIX"``, default ``"bull"``); on a ``redis+cluster://`` URL it must
            hold a hash tag, e.g. ``"{bull}"``.
        schema: Schema of sdcore's tables (``"SCHEMA"``), or ``None`` for the ``search_path``.
        grace_period_ms: How long running ticks and jobs may finish at shutdown
            (``"GRACE_PERIOD_MS"``, default 10,000).
        pool_size: Connections of the worker's pool (``"POOL_SIZE"``, at least 2, default 10).
        time_zone: Default IANA zone of cron schedules (``"TIME_ZONE"``, default ``"UTC"``).
        relay: Run the outbox relay in ``manage.py sdcore run`` (``"RELAY"``, default ``True``).
        scheduling: Run the schedules there (``"SCHEDULING"``, default ``True``).
        control: Run the schedules control plane there (``"CONTROL"``, default ``True``).
        processors: Dotted paths of the queue processors ``manage.py sdcore run`` runs
            (``"PROCESSORS"``, default none): each names a ``sdcore.queues.Processor``, or a
            callable without arguments that returns one or a list of them.
    """

    database: str = "default"
    redis_url: str | None = None
    queue_prefix: str = "bull"
    schema: str | None = None
    grace_period_ms: int = 10_000
    pool_size: int = 10
    time_zone: str = "UTC"
    relay: bool = True
    scheduling: bool = True
    control: bool = True
    processors: tuple[str, ...] = ()

    @classmethod
    def from_mapping(cls, values: object) -> SdcoreSettings:
        """Validate a ``SDCORE`` dict.

        Raises:
            django.core.exceptions.ImproperlyConfigured: Not a dict, an unknown key, or a value
                of the wrong type or out of range (the message names the key).
        """
        if values is None:
            return cls()
        if not isinstance(values, Mapping):
            raise _improperly_configured(f"SDCORE must be a dict, got {type(values).__name__}")
        unknown = sorted(str(key) for key in values if key not in _KEYS)
        if unknown:
            raise _improperly_configured(
                f"SDCORE has unknown key(s) {', '.join(map(repr, unknown))}: "
                f"use {', '.join(sorted(_KEYS))}"
            )
        get = values.get
        redis_url = get("REDIS_URL")
        if redis_url is not None:
            redis_url = text("REDIS_URL", redis_url, empty=True, error=_refused) or None
        queue_prefix = text("QUEUE_PREFIX", get("QUEUE_PREFIX", "bull"), error=_refused)
        _check_queue_prefix(redis_url, queue_prefix)
        schema = get("SCHEMA")
        if schema is not None:
            from sdcore.postgres import InvalidIdentifierError, check_identifier

            try:
                check_identifier("schema", text("SCHEMA", schema, error=_refused))
            except InvalidIdentifierError as exc:
                raise _improperly_configured(f"SDCORE['SCHEMA']: {exc}") from None
        return cls(
            database=text("DATABASE", get("DATABASE", "default"), error=_refused),
            redis_url=redis_url,
            queue_prefix=queue_prefix,
            schema=schema,
            grace_period_ms=int_between(
                "GRACE_PERIOD_MS", get("GRACE_PERIOD_MS", 10_000), 0, 2**31 - 1, error=_refused
            ),
            pool_size=int_between("POOL_SIZE", get("POOL_SIZE", 10), 2, 1_000, error=_refused),
            time_zone=text("TIME_ZONE", get("TIME_ZONE", "UTC"), error=_refused),
            relay=boolean("RELAY", get("RELAY", True), error=_refused),
            scheduling=boolean("SCHEDULING", get("SCHEDULING", True), error=_refused),
            control=boolean("CONTROL", get("CONTROL", True), error=_refused),
            processors=_dotted_paths(get("PROCESSORS", ())),
        )

    @classmethod
    def from_django(cls) -> SdcoreSettings:
        """Read and validate ``settings.SDCORE`` and check the database it names.

        Raises:
            django.core.exceptions.ImproperlyConfigured: A bad ``SDCORE``, an alias missing from
                ``DATABASES``, a backend other than PostgreSQL, or psycopg 2 instead of 3.
        """
        from django.conf import settings

        chosen = cls.from_mapping(getattr(settings, "SDCORE", None))
        check_database(chosen.database, settings.DATABASES)
        return chosen


def _dotted_paths(value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise _improperly_configured(
            "SDCORE['PROCESSORS'] must be a list of dotted paths "
            f"(['myapp.processors.Mail', …]), got {type(value).__name__}"
        )
    paths = tuple(text("PROCESSORS", item, error=_refused) for item in value)
    for path in paths:
        if "." not in path.strip("."):
            raise _improperly_configured(
                f"SDCORE['PROCESSORS'] holds {path!r}: a dotted path names a module and an "
                "object in it ('myapp.processors.Mail')"
            )
    return paths


def check_database(alias: str, databases: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse a database sdcore cannot run on (an unknown alias, not PostgreSQL, psycopg 2).

    Raises:
        django.core.exceptions.ImproperlyConfigured: The message says what to change.
    """
    if alias not in databases:
        raise _improperly_configured(
            f"SDCORE['DATABASE'] is {alias!r}, which is not in DATABASES "
            f"({', '.join(map(repr, databases)) or 'none'})"
        )
    engine = databases[alias].get("ENGINE", "")
    if not _is_postgresql(engine):
        raise _improperly_configured(
            f"sdcore.django needs PostgreSQL: DATABASES[{alias!r}]['ENGINE'] is {engine!r}, "
            f"expected {POSTGRESQL_ENGINE!r} or a backend built on it (PostGIS…; sdcore's "
            "lease, outbox and schedules are PostgreSQL tables, no other database is supported)"
        )
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    if not is_psycopg3:
        raise _improperly_configured(
            "sdcore.django needs psycopg 3, but Django loaded psycopg2 (psycopg 3 did not "
            "import): `pip install 'psycopg[binary]'` (or psycopg[c])"
        )


def _is_postgresql(engine: object) -> bool:
    """Whether ``engine`` is Django's PostgreSQL backend or one built on it (PostGIS, a
    metrics wrapper): its ``DatabaseWrapper`` says ``vendor = "postgresql"``."""
    if engine == POSTGRESQL_ENGINE:
        return True
    if not isinstance(engine, str) or not engine:
        return False
    try:
        base = importlib.import_module(f"{engine}.base")
    except Exception:  # noqa: BLE001 - a backend that does not import is not one sdcore runs on
        return False
    return getattr(getattr(base, "DatabaseWrapper", None), "vendor", None) == "postgresql"


def conninfo_of(params: Mapping[str, Any]) -> str:
    """Return the libpq conninfo of Django's connection parameters (libpq keywords only)."""
    kept = {
        key: str(value)
        for key, value in params.items()
        if key in _LIBPQ and value is not None and value != ""
    }
    return make_conninfo("", **kept)


def database_url(alias: str | None = None) -> str:
    """Return the libpq connection string of a Django database (``key=value`` form).

    Built from ``DATABASES[alias]`` as Django's PostgreSQL backend connects (``NAME``,
    ``USER``, ``PASSWORD``, ``HOST``, ``PORT`` and the libpq keywords of ``OPTIONS`` such as
    ``sslmode``), so a test database (``test_…``) is followed too.

    Args:
        alias: The alias; ``None`` means ``SDCORE["DATABASE"]`` (default ``"default"``).

    Raises:
        django.core.exceptions.ImproperlyConfigured: See :meth:`SdcoreSettings.from_django`.
    """
    from django.db import connections

    chosen = SdcoreSettings.from_django()
    name = chosen.database if alias is None else alias
    if alias is not None:
        from django.conf import settings

        check_database(name, settings.DATABASES)
    return conninfo_of(connections[name].get_connection_params())
