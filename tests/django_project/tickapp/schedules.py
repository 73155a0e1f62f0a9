"""Schedules of the test app, on only when ``SDCORE_DJANGO_TICKS`` is set.

``every-second`` writes a row with the ORM from a plain def; ``breaks-its-transaction`` (with
``SDCORE_DJANGO_TICKS=broken``) leaves its connection in a failed transaction and raises, then
the next tick must still write.
"""

import contextlib
import os

from django.db import connection, transaction
from tickapp.models import TickRow  # type: ignore[import-not-found]

from sdcore.django import scheduler

TICKS = os.environ.get("SDCORE_DJANGO_TICKS", "")

if TICKS:

    @scheduler.interval(1_000, name="every-second")
    def every_second(tick):  # type: ignore[no-untyped-def]
        assert tick.lease is not None
        TickRow.objects.create(
            schedule=tick.schedule,
            scheduled_at=tick.scheduled_at,
            idempotency_key=tick.lease.idempotency_key,
            fencing_token=tick.lease.fencing_token,
            pid=os.getpid(),
        )


if TICKS == "broken":

    @scheduler.interval(1_000, name="breaks-its-transaction")
    def breaks(tick):  # type: ignore[no-untyped-def]
        transaction.set_autocommit(False)
        with connection.cursor() as cursor, contextlib.suppress(Exception):
            cursor.execute("SELECT 1/0")  # the transaction is left failed
        raise RuntimeError("handler failed on purpose")
