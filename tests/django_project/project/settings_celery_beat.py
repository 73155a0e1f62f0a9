"""The test project with django-celery-beat's tables and ``beatapp`` (the importer's tests)."""

from .settings import *  # noqa: F403
from .settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "django_celery_beat", "beatapp"]
