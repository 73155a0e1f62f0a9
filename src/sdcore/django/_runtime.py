"""The process's :class:`~sdcore.runtime.Runtime`, built from Django's settings."""

from __future__ import annotations

import logging
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
    Runtime, with the queue processors of ``SDCORE["PROCESSORS"]`` and those of the
    ``django.tasks`` backends of ``settings.TASKS`` that are
    ``sdcore.django.tasks.SdcoreBackend`` (Django 6 only)."""
    import django
    from django.conf import settings

    from sdcore.django._settings import SdcoreSettings

    runtime = get_runtime()
    add_processors(runtime, SdcoreSettings.from_django().processors)
    tasks = getattr(settings, "TASKS", None)
    if django.VERSION >= (6, 0) and tasks:
        from sdcore.django.tasks import register_processors

        register_processors(runtime, tasks)
    return runtime


def add_processors(runtime: Runtime, paths: tuple[str, ...]) -> None:
    """Import the processors ``paths`` name and add each to ``runtime`` (once per queue).

    Without Redis nothing is imported (no queue runs; outbox rows wait in PostgreSQL): a
    warning says so.

    Raises:
        django.core.exceptions.ImproperlyConfigured: A path that does not import, an object
            that is no processor, or a second processor of a queue.
    """
    if not paths:
        return
    from django.core.exceptions import ImproperlyConfigured
    from django.utils.module_loading import import_string

    if not runtime.queues_enabled:
        logging.getLogger("sdcore.django").warning(
            "SDCORE['PROCESSORS'] is set but SDCORE['REDIS_URL'] is not: no queue processor "
            "runs (outbox rows wait in PostgreSQL)",
            extra={"action": "processors_without_redis"},
        )
        return
    from sdcore.queues import Processor

    taken = {getattr(p, "queue", None) for p in runtime.processors}
    for path in paths:
        try:
            found = import_string(path)
        except ImportError as exc:
            raise ImproperlyConfigured(
                f"SDCORE['PROCESSORS']: {path!r} does not import: {exc}"
            ) from None
        made = found() if callable(found) and not isinstance(found, Processor) else found
        chosen = list(made) if isinstance(made, list | tuple) else [made]
        for processor in chosen:
            if not isinstance(processor, Processor):
                raise ImproperlyConfigured(
                    f"SDCORE['PROCESSORS']: {path!r} gives {type(processor).__name__}, not a "
                    "sdcore.queues.Processor (name an instance, a Processor class whose "
                    "constructor takes no argument, or a function that returns processors)"
                )
            if processor.queue in taken:
                raise ImproperlyConfigured(
                    f"SDCORE['PROCESSORS']: {path!r} gives a second processor of queue "
                    f"{processor.queue!r}"
                )
            taken.add(processor.queue)
            runtime.processors.append(processor)
