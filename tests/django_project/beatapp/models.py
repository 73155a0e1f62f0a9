"""One row per run of an imported schedule's handler."""

from django.db import models


class BeatRun(models.Model):  # type: ignore[misc]
    handler = models.CharField(max_length=200)
    schedule = models.CharField(max_length=200)
    args = models.JSONField()
