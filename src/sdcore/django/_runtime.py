"""The process's :class:`~sdcore.runtime.Runtime`, built from Django's settings."""

from __future__ import annotations

import threading

from sdcore.runtime import Runtime

__all__ = ["build_runtime", "get_runtime"]

APPLICATION_NAME = "sdcore-django"
_lock = threading.Lock()
# One Runtime per process, like Django's own registries (admin.site): schedules.py modules
# declare on it at import time and ``manage.py sdcore run`` starts it.
_built: list[Runtime] = []


def get_runtime() -> Runtime:
    """Return this process's Runtime, built from ``settings.SDCORE`` on first call.

    Nothing connects until it is started (``manage.py sdcore run`` does). Its database is
    ``DATABASES[SDCORE["DATABASE"]]``; migrations are Django's (``manage.py migrate``), so it
    never applies any itself.

    Raises:
        django.core.exceptions.ImproperlyConfigured: Bad settings (see ``SdcoreSettings``).
    """
    with _lock:
        if not _built:
            _built.append(build_runtime())
        return _built[0]


def build_runtime() -> Runtime:
    """Build a new Runtime from ``settings.SDCORE`` (:func:`get_runtime` caches one)."""
    from sdcore.django._settings import SdcoreSettings, database_url
    from sdcore.outbox import Outbox, RelaySettings
    from sdcore.postgres import PoolSettings
    from sdcore.scheduling import ControlSettings, SchedulingSettings

    chosen = SdcoreSettings.from_django()
    return Runtime(
        database_url(),
        redis_url=chosen.redis_url,
        queue_prefix=chosen.queue_prefix,
        pool=PoolSettings(max_size=chosen.pool_size, application_name=APPLICATION_NAME),
        relay=RelaySettings() if chosen.relay else None,
        scheduling=(SchedulingSettings(time_zone=chosen.time_zone) if chosen.scheduling else None),
        control=ControlSettings() if chosen.control else None,
        outbox=Outbox(schema=chosen.schema),
        ensure_schema=False,
        schema=chosen.schema,
        grace_period_ms=chosen.grace_period_ms,
        logger_name="sdcore.django",
    )


def _worker() -> Runtime:
    """What ``manage.py sdcore run`` runs (``sdcore run sdcore.django._runtime:_worker``): the
    Runtime, with the queue processors of the ``django.tasks`` backends of ``settings.TASKS``
    that are ``sdcore.django.tasks.SdcoreBackend`` (Django 6 only)."""
    import django
    from django.conf import settings

    runtime = get_runtime()
    tasks = getattr(settings, "TASKS", None)
    if django.VERSION >= (6, 0) and tasks:
        from sdcore.django.tasks import register_processors

        register_processors(runtime, tasks)
    return runtime
