"""The Django app config of ``sdcore.django`` (label ``sdcore``)."""

from __future__ import annotations

from django.apps import AppConfig

__all__ = ["SdcoreConfig"]


class SdcoreConfig(AppConfig):  # type: ignore[misc]
    """Checks ``settings.SDCORE`` and the database at start-up, then imports every installed
    app's ``schedules`` module (as the admin imports ``admin``). On Django 6 it imports
    ``django.tasks``, whose system check then runs the ``TASKS`` backends' own checks
    (``sdcore.django.tasks.SdcoreBackend`` warns without ``SDCORE["REDIS_URL"]``)."""

    name = "sdcore.django"
    label = "sdcore"
    verbose_name = "sdcore"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        import django
        from django.utils.module_loading import autodiscover_modules

        from sdcore.django._settings import SdcoreSettings

        SdcoreSettings.from_django()
        if django.VERSION >= (6, 0):
            import django.tasks  # registers Django's check of the TASKS backends
        autodiscover_modules("schedules")
