"""The Django app config of ``sdcore.django`` (label ``sdcore``)."""

from __future__ import annotations

import hashlib
from typing import Any

from django.apps import AppConfig

__all__ = ["SdcoreConfig"]

# The session advisory lock one ``manage.py migrate`` holds on a PostgreSQL database from its
# pre_migrate to its post_migrate signal: pods that migrate at once take turns, Django's own
# creation of ``django_migrations`` included (two at once: one fails on a duplicate pg_type).
MIGRATE_LOCK_ID = int.from_bytes(
    hashlib.sha256(b"sdcore/django-migrate").digest()[:8], "big", signed=True
)


class SdcoreConfig(AppConfig):  # type: ignore[misc]
    """Checks ``settings.SDCORE`` and the database at start-up, then imports every installed
    app's ``schedules`` module (as the admin imports ``admin``). On Django 6 it imports
    ``django.tasks``, whose system check then runs the ``TASKS`` backends' own checks
    (``sdcore.django.tasks.SdcoreBackend`` warns without ``SDCORE["REDIS_URL"]``). Each
    ``migrate`` on a PostgreSQL database holds :data:`MIGRATE_LOCK_ID` while it runs."""

    name = "sdcore.django"
    label = "sdcore"
    verbose_name = "sdcore"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        import django
        from django.db.models.signals import post_migrate, pre_migrate
        from django.utils.module_loading import autodiscover_modules

        from sdcore.django._settings import SdcoreSettings

        SdcoreSettings.from_django()
        pre_migrate.connect(_lock_migrate, sender=self, dispatch_uid="sdcore-migrate-lock")
        post_migrate.connect(_unlock_migrate, sender=self, dispatch_uid="sdcore-migrate-unlock")
        if django.VERSION >= (6, 0):
            import django.tasks  # registers Django's check of the TASKS backends
        autodiscover_modules("schedules")


# The database aliases whose migrate holds the lock in this process (``flush`` also sends
# post_migrate, without a pre_migrate).
_held: set[str] = set()


def _lock_migrate(*, using: str, **_: Any) -> None:
    """Wait for any other ``migrate`` of the database, then hold the lock (session-level:
    released at post_migrate, or when a failed run's connection closes)."""
    from django.db import connections

    connection = connections[using]
    if connection.vendor == "postgresql" and using not in _held:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_lock(%s)", [MIGRATE_LOCK_ID])
        _held.add(using)


def _unlock_migrate(*, using: str, **_: Any) -> None:
    from django.db import connections

    if using in _held:
        _held.discard(using)
        with connections[using].cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [MIGRATE_LOCK_ID])
