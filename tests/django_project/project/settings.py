"""Settings of the test project: the database comes from ``SDCORE_DJANGO_DSN`` (a libpq DSN).

``SDCORE_DJANGO_ENGINE`` replaces the engine (the sqlite refusal test), ``SDCORE_DJANGO_SCHEMA``
sets ``SDCORE["SCHEMA"]``, ``SDCORE_DJANGO_EXTRA`` is JSON merged into ``SDCORE``,
``SDCORE_DJANGO_USE_TZ=0`` sets ``USE_TZ = False``; ``SDCORE_DJANGO_TASKS`` (Django 6) installs
``taskapp`` and the ``django.tasks`` backend, its BullMQ queues prefixed with the variable's value.
"""

import json
import os

from psycopg.conninfo import conninfo_to_dict

_params = conninfo_to_dict(os.environ.get("SDCORE_DJANGO_DSN", "dbname=postgres"))

SECRET_KEY = "test-only"
DEBUG = False
USE_TZ = os.environ.get("SDCORE_DJANGO_USE_TZ", "1") == "1"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "sdcore.django",
    "tickapp",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "project.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
STATIC_URL = "static/"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
DATABASES = {
    "default": {
        "ENGINE": os.environ.get("SDCORE_DJANGO_ENGINE", "django.db.backends.postgresql"),
        "NAME": _params.get("dbname", "postgres"),
        "USER": _params.get("user", ""),
        "PASSWORD": _params.get("password", ""),
        "HOST": _params.get("host", ""),
        "PORT": _params.get("port", ""),
        "OPTIONS": {"sslmode": "disable"},
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
SDCORE: dict[str, object] = {"GRACE_PERIOD_MS": 3_000, "POOL_SIZE": 4}
if os.environ.get("SDCORE_DJANGO_SCHEMA"):
    SDCORE["SCHEMA"] = os.environ["SDCORE_DJANGO_SCHEMA"]
SDCORE.update(json.loads(os.environ.get("SDCORE_DJANGO_EXTRA", "{}")))
if os.environ.get("SDCORE_DJANGO_TASKS"):
    INSTALLED_APPS.append("taskapp")
    TASKS = {
        "default": {
            "BACKEND": "sdcore.django.tasks.SdcoreBackend",
            "QUEUES": ["default", "other"],
            "OPTIONS": {
                "QUEUE_PREFIX": os.environ["SDCORE_DJANGO_TASKS"],
                "CONCURRENCY": int(os.environ.get("SDCORE_DJANGO_TASKS_CONCURRENCY", "2")),
            },
        }
    }
if os.environ.get("SDCORE_DJANGO_LOG_STDERR"):
    # A manage.py child of the tests (harness.environment): sdcore's warnings on its stderr.
    # Never in the pytest process itself, whose loggers a dictConfig would reconfigure for
    # every test after it.
    LOGGING = {
        "version": 1,
        "disable_existing_loggers": False,
        "handlers": {"stderr": {"class": "logging.StreamHandler"}},
        "loggers": {"sdcore": {"handlers": ["stderr"], "level": "WARNING"}},
    }
