"""The admin's read-only models over sdcore's tables, and their permissions.

Unmanaged: no SQL (sdcore's migrations own the tables); their ``db_table`` follows
``SDCORE["SCHEMA"]`` as the models' does.
"""

from django.db import migrations, models

from sdcore.django._tables import db_table


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies = [("sdcore", "0017_schedules_replica_digest")]  # noqa: RUF012

    operations = [  # noqa: RUF012
        migrations.CreateModel(
            name="OutboxMessage",
            fields=[
                ("id", models.BigIntegerField(primary_key=True, serialize=False)),
                ("idempotency_key", models.TextField()),
                ("queue", models.TextField()),
                ("name", models.TextField()),
                ("job_id", models.TextField()),
                ("payload", models.JSONField()),
                ("options", models.JSONField()),
                ("status", models.TextField()),
                ("attempts", models.IntegerField()),
                ("max_attempts", models.IntegerField()),
                ("next_attempt_at", models.DateTimeField()),
                ("claimed_until", models.DateTimeField(null=True)),
                ("last_error", models.TextField(null=True)),
                ("lost_claims", models.IntegerField()),
                ("created_at", models.DateTimeField()),
                ("published_at", models.DateTimeField(null=True)),
                ("pruned_at", models.DateTimeField(null=True)),
            ],
            options={
                "verbose_name": "outbox message",
                "db_table": db_table("outbox"),
                "ordering": ("-id",),
                "permissions": (("retry_outbox", "Can retry an outbox row"),),
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
        migrations.CreateModel(
            name="Schedule",
            fields=[
                ("name", models.TextField(primary_key=True, serialize=False)),
                ("origin", models.TextField()),
                ("kind", models.TextField()),
                ("expression", models.TextField()),
                ("time_zone", models.TextField()),
                ("day_rule", models.TextField()),
                ("options", models.JSONField()),
                ("handler", models.TextField(null=True)),
                ("args", models.JSONField(null=True)),
                ("paused", models.BooleanField()),
                ("paused_at", models.DateTimeField(null=True)),
                ("paused_by", models.TextField(null=True)),
                ("paused_reason", models.TextField(null=True)),
                ("resumed_at", models.DateTimeField(null=True)),
                ("removed_at", models.DateTimeField(null=True)),
                ("created_at", models.DateTimeField()),
                ("updated_at", models.DateTimeField()),
            ],
            options={
                "db_table": db_table("schedules"),
                "ordering": ("name",),
                "permissions": (
                    ("pause_schedule", "Can pause a schedule"),
                    ("resume_schedule", "Can resume a schedule"),
                    ("trigger_schedule", "Can trigger a schedule"),
                    ("backfill_schedule", "Can backfill a schedule"),
                ),
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
        migrations.CreateModel(
            name="ScheduleAction",
            fields=[
                ("id", models.BigIntegerField(primary_key=True, serialize=False)),
                ("schedule", models.TextField()),
                ("action", models.TextField()),
                ("actor", models.TextField()),
                ("reason", models.TextField(null=True)),
                ("params", models.JSONField()),
                ("progress", models.JSONField(null=True)),
                ("outcome", models.TextField(null=True)),
                ("request_id", models.TextField(null=True)),
                ("created_at", models.DateTimeField()),
                ("finished_at", models.DateTimeField(null=True)),
            ],
            options={
                "verbose_name": "schedule action",
                "db_table": db_table("schedules", "actions"),
                "ordering": ("-id",),
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
        migrations.CreateModel(
            name="ScheduleRun",
            fields=[
                ("id", models.BigIntegerField(primary_key=True, serialize=False)),
                ("schedule", models.TextField()),
                ("run_key", models.TextField()),
                ("source", models.TextField()),
                ("scheduled_at", models.DateTimeField()),
                ("attempt", models.IntegerField()),
                ("fencing_token", models.BigIntegerField(null=True)),
                ("replica_id", models.UUIDField()),
                ("host", models.TextField()),
                ("pid", models.IntegerField()),
                ("started_at", models.DateTimeField()),
                ("finished_at", models.DateTimeField(null=True)),
                ("status", models.TextField()),
                ("error", models.TextField(null=True)),
            ],
            options={
                "verbose_name": "schedule run",
                "db_table": db_table("schedules", "runs"),
                "ordering": ("-started_at", "-id"),
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
    ]
