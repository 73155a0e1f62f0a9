"""One row per tick a handler ran (the exactly-once check reads them)."""

from django.db import models


class TickRow(models.Model):  # type: ignore[misc]
    schedule = models.CharField(max_length=100)
    scheduled_at = models.DateTimeField()
    idempotency_key = models.CharField(max_length=200)
    fencing_token = models.BigIntegerField()
    pid = models.IntegerField()
