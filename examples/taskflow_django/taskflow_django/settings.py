"""TaskFlow's settings, from the environment.

``DATABASE_URL`` (required): the PostgreSQL of the tasks and of sdcore's tables.
``REDIS_URL`` (optional): with it, a status change writes a notification job to the outbox and
``manage.py sdcore run`` relays it to BullMQ and processes it; without it, the change is
"e-mailed" by a log line after the commit.
``TASKFLOW_NOTIFY_QUEUE`` (default ``mail``): the BullMQ queue of the notification jobs.
``TASKFLOW_OVERDUE_CRON`` (default ``0 1 * * *``): when ``mark-overdue-tasks`` fires, in Paris.
"""

import os

from django.core.exceptions import ImproperlyConfigured
from psycopg.conninfo import conninfo_to_dict

try:
    _database = conninfo_to_dict(os.environ["DATABASE_URL"])
except KeyError:
    raise ImproperlyConfigured(
        "DATABASE_URL is not set: export DATABASE_URL=postgresql://user@host:5432/taskflow"
    ) from None

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "taskflow-example-not-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "0") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "sdcore.django", "tasks"]
MIDDLEWARE = ["django.middleware.common.CommonMiddleware"]
ROOT_URLCONF = "taskflow_django.urls"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _database.get("dbname", ""),
        "USER": _database.get("user", ""),
        "PASSWORD": _database.get("password", ""),
        "HOST": _database.get("host", ""),
        "PORT": _database.get("port", ""),
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
SDCORE = {"REDIS_URL": os.environ.get("REDIS_URL") or None, "GRACE_PERIOD_MS": 5_000}
TASKFLOW_NOTIFY_QUEUE = os.environ.get("TASKFLOW_NOTIFY_QUEUE", "mail")
TASKFLOW_OVERDUE_CRON = os.environ.get("TASKFLOW_OVERDUE_CRON", "0 1 * * *")
LOGGING = {
    "version": 1,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "loggers": {
        "tasks": {"handlers": ["stderr"], "level": "INFO"},
        "sdcore": {"handlers": ["stderr"], "level": "WARNING"},
    },
}
