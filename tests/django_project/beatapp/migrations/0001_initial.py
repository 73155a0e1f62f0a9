# ruff: noqa: RUF012 - a Django migration as makemigrations writes it
from django.db import migrations, models


class Migration(migrations.Migration):  # type: ignore[misc]
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [
        migrations.CreateModel(
            name="BeatRun",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False)),
                ("handler", models.CharField(max_length=200)),
                ("schedule", models.CharField(max_length=200)),
                ("args", models.JSONField()),
            ],
        )
    ]
