"""``manage.py addtask TITLE --owner EMAIL [--due YYYY-MM-DD]``: create a task, print its id."""

from __future__ import annotations

import argparse
from datetime import date
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.core.validators import validate_email

from tasks.models import Task


def _day(value: str) -> date:
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--due must be YYYY-MM-DD, got {value!r}") from None


class Command(BaseCommand):  # type: ignore[misc]
    help = "Create a TODO task and print its id."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("title")
        parser.add_argument("--owner", required=True, help="who gets the notifications")
        parser.add_argument("--due", type=_day, default=None, help="due date, YYYY-MM-DD")

    def handle(self, *args: Any, **options: Any) -> None:
        title: str = options["title"]
        if not title.strip() or len(title) > 200:
            raise CommandError("the title must be 1 to 200 characters")
        try:
            validate_email(options["owner"])
        except ValidationError:
            raise CommandError(
                f"--owner must be an e-mail address, got {options['owner']!r}"
            ) from None
        task = Task.objects.create(
            title=title, owner_email=options["owner"], due_date=options["due"]
        )
        self.stdout.write(str(task.pk))
