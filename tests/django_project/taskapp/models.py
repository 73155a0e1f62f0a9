"""One row per run of a ``django.tasks`` task (the once-only checks read them)."""

from django.db import models


class TaskRun(models.Model):  # type: ignore[misc]
    label = models.CharField(max_length=200)
    attempt = models.IntegerField(default=0)
    pid = models.IntegerField()
