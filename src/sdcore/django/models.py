"""Read-only Django models over sdcore's own tables, for the admin (``sdcore.django.admin``).

Unmanaged (``managed = False``): sdcore's migrations own the tables, Django never creates, alters
or writes them. Each table has a one-column primary key and maps row for row, so the admin's
lists get Django's search, filters, ordering and paging. Nothing writes through these models:
the admin's actions call the control plane (``ScheduleAdmin``, ``OutboxAdmin``), which
validates, records the actor and notifies the replicas.

Permissions: ``view`` only of Django's defaults (adding, changing or deleting a row by hand would
bypass the control plane), and one per operator action: ``sdcore.pause_schedule``,
``sdcore.resume_schedule``, ``sdcore.trigger_schedule``, ``sdcore.backfill_schedule``,
``sdcore.retry_outbox``.
"""

from __future__ import annotations

from django.db import models

from sdcore.django._tables import db_table

__all__ = ["OutboxMessage", "Schedule", "ScheduleAction", "ScheduleRun"]

# Declared once, used by the models and the migration that creates their permissions.
SCHEDULE_PERMISSIONS = (
    ("pause_schedule", "Can pause a schedule"),
    ("resume_schedule", "Can resume a schedule"),
    ("trigger_schedule", "Can trigger a schedule"),
    ("backfill_schedule", "Can backfill a schedule"),
)
OUTBOX_PERMISSIONS = (("retry_outbox", "Can retry an outbox row"),)
VIEW_ONLY = ("view",)


class Schedule(models.Model):  # type: ignore[misc]
    """A schedule of the cluster (the schedules table; removed stored schedules are hidden)."""

    name = models.TextField(primary_key=True)
    origin = models.TextField()
    kind = models.TextField()
    expression = models.TextField()
    time_zone = models.TextField()
    day_rule = models.TextField()
    options = models.JSONField()
    handler = models.TextField(null=True)
    args = models.JSONField(null=True)
    paused = models.BooleanField()
    paused_at = models.DateTimeField(null=True)
    paused_by = models.TextField(null=True)
    paused_reason = models.TextField(null=True)
    resumed_at = models.DateTimeField(null=True)
    removed_at = models.DateTimeField(null=True)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = db_table("schedules")
        default_permissions = VIEW_ONLY
        permissions = SCHEDULE_PERMISSIONS
        ordering = ("name",)

    def __str__(self) -> str:
        return str(self.name)


class ScheduleRun(models.Model):  # type: ignore[misc]
    """One run of a schedule's tick (the run history)."""

    id = models.BigIntegerField(primary_key=True)
    schedule = models.TextField()
    run_key = models.TextField()
    source = models.TextField()
    scheduled_at = models.DateTimeField()
    attempt = models.IntegerField()
    fencing_token = models.BigIntegerField(null=True)
    replica_id = models.UUIDField()
    host = models.TextField()
    pid = models.IntegerField()
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True)
    status = models.TextField()
    error = models.TextField(null=True)

    class Meta:
        managed = False
        db_table = db_table("schedules", "runs")
        default_permissions = VIEW_ONLY
        ordering = ("-started_at", "-id")
        verbose_name = "schedule run"

    def __str__(self) -> str:
        return f"{self.schedule} {self.run_key} ({self.status})"


class ScheduleAction(models.Model):  # type: ignore[misc]
    """One control action (pause, resume, trigger, backfill, …): who, why, when, outcome."""

    id = models.BigIntegerField(primary_key=True)
    schedule = models.TextField()
    action = models.TextField()
    actor = models.TextField()
    reason = models.TextField(null=True)
    params = models.JSONField()
    progress = models.JSONField(null=True)
    outcome = models.TextField(null=True)
    request_id = models.TextField(null=True)
    created_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True)

    class Meta:
        managed = False
        db_table = db_table("schedules", "actions")
        default_permissions = VIEW_ONLY
        ordering = ("-id",)
        verbose_name = "schedule action"

    def __str__(self) -> str:
        return f"{self.action} {self.schedule} by {self.actor}"


class OutboxMessage(models.Model):  # type: ignore[misc]
    """A row of the transactional outbox (``PENDING``, ``PUBLISHED`` or ``DEAD``)."""

    id = models.BigIntegerField(primary_key=True)
    idempotency_key = models.TextField()
    queue = models.TextField()
    name = models.TextField()
    job_id = models.TextField()
    payload = models.JSONField()
    options = models.JSONField()
    status = models.TextField()
    attempts = models.IntegerField()
    max_attempts = models.IntegerField()
    next_attempt_at = models.DateTimeField()
    claimed_until = models.DateTimeField(null=True)
    last_error = models.TextField(null=True)
    lost_claims = models.IntegerField()
    created_at = models.DateTimeField()
    published_at = models.DateTimeField(null=True)
    pruned_at = models.DateTimeField(null=True)

    class Meta:
        managed = False
        db_table = db_table("outbox")
        default_permissions = VIEW_ONLY
        permissions = OUTBOX_PERMISSIONS
        ordering = ("-id",)
        verbose_name = "outbox message"

    def __str__(self) -> str:
        return f"#{self.id} {self.queue}/{self.name} ({self.status})"
