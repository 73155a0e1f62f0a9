"""sdcore in a Django project: ``INSTALLED_APPS += ["sdcore.django"]``.

- ``SDCORE = {...}`` in the settings (:class:`SdcoreSettings`); the database is
  ``DATABASES["default"]`` (or ``SDCORE["DATABASE"]``), PostgreSQL with psycopg 3 only;
- ``manage.py migrate`` applies sdcore's migrations (the same as ``sdcore db upgrade``);
- schedules declared on :data:`scheduler` in each app's ``schedules.py``;
- :func:`enqueue_once`: an outbox message in the caller's ``transaction.atomic()``;
- ``manage.py sdcore …``: the ``sdcore`` command line on those settings; ``manage.py sdcore run``
  is the worker process;
- the admin's pages and actions (``sdcore.django.admin``), and :func:`dashboard_asgi`: the
  sdcore dashboard in the project's ASGI application, for staff users;
- on Django 6, ``sdcore.django.tasks.SdcoreBackend``: a ``django.tasks`` backend on the outbox,
  whose tasks ``manage.py sdcore run`` runs.
"""

from sdcore.django._dashboard import dashboard_asgi
from sdcore.django._outbox import AtomicBlockRequiredError, enqueue_once
from sdcore.django._runtime import get_runtime
from sdcore.django._scheduler import DjangoScheduler, scheduler
from sdcore.django._settings import SdcoreSettings, database_url

__all__ = [
    "AtomicBlockRequiredError",
    "DjangoScheduler",
    "SdcoreSettings",
    "dashboard_asgi",
    "database_url",
    "enqueue_once",
    "get_runtime",
    "scheduler",
]
