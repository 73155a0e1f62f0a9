# ruff: noqa: RUF012 - a Django migration as makemigrations writes it
from django.db import migrations, models


class Migration(migrations.Migration):  # type: ignore[misc]
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [
        migrations.CreateModel(
            name="TickRow",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False)),
                ("schedule", models.CharField(max_length=100)),
                ("scheduled_at", models.DateTimeField()),
                ("idempotency_key", models.CharField(max_length=200)),
                ("fencing_token", models.BigIntegerField()),
                ("pid", models.IntegerField()),
            ],
        )
    ]
