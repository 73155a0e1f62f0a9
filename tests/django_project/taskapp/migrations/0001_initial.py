# ruff: noqa: RUF012 - a Django migration as makemigrations writes it
from django.db import migrations, models


class Migration(migrations.Migration):  # type: ignore[misc]
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [
        migrations.CreateModel(
            name="TaskRun",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False)),
                ("label", models.CharField(max_length=200)),
                ("attempt", models.IntegerField(default=0)),
                ("pid", models.IntegerField()),
            ],
        )
    ]
