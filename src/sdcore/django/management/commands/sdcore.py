"""``manage.py sdcore …``: the ``sdcore`` command line on Django's database and ``SDCORE``.

One command is Django's own: ``manage.py sdcore import-celery-beat`` reads django-celery-beat's
periodic tasks (see ``sdcore.django._celery_beat``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence
from typing import Any

from django.core.management.base import BaseCommand, CommandError

# Django's own options, which ``manage.py`` has already applied before this command runs.
_DJANGO_OPTIONS = ("--settings", "--pythonpath")
WORKER = "sdcore.django._runtime:_worker"


def cli_arguments(argv: Sequence[str]) -> list[str]:
    """The ``sdcore`` arguments for ``manage.py sdcore ARGV``: the database and schema of the
    settings first (an option given after the command still wins), and ``run`` runs the
    project's Runtime."""
    from sdcore.django._settings import SdcoreSettings, database_url

    chosen = SdcoreSettings.from_django()
    words = list(argv)
    prefix = ["--database-url", database_url()]
    if chosen.schema is not None:
        prefix += ["--schema", chosen.schema]
    if words and words[0] == "run" and not any(w in ("-h", "--help") for w in words[1:]):
        words = ["run", WORKER, *words[1:]]
    return [*prefix, *words]


def _without_django_options(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for word in argv:
        if skip:
            skip = False
            continue
        if word in _DJANGO_OPTIONS:
            skip = True
            continue
        if word.startswith(tuple(f"{o}=" for o in _DJANGO_OPTIONS)):
            continue
        out.append(word)
    return out


class Command(BaseCommand):  # type: ignore[misc]
    help = "Run an sdcore command on this project's database (`manage.py sdcore --help`)."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("args", nargs=argparse.REMAINDER, metavar="SDCORE_ARGS")

    def run_from_argv(self, argv: list[str]) -> None:
        """Hand every argument after ``sdcore`` to the ``sdcore`` command line."""
        status = self._main(_without_django_options(argv[2:]))
        if status:
            sys.exit(status)

    def handle(self, *args: str, **options: Any) -> None:
        """``call_command("sdcore", "schedules", "list")``: a failure is a ``CommandError``;
        the output goes to the command's ``stdout`` / ``stderr`` (``call_command(...,
        stdout=buffer)``)."""
        # The streams OutputWrapper wraps: its own write() would add a newline to each piece.
        out = getattr(self.stdout, "_out", self.stdout)
        err = getattr(self.stderr, "_out", self.stderr)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = self._main(list(args))
        if status:
            raise CommandError(f"sdcore exited with status {status}", returncode=status)

    def _main(self, argv: list[str]) -> int:
        from django.db import connections

        from sdcore.cli import main
        from sdcore.django._celery_beat import COMMAND, import_celery_beat

        try:
            if argv and argv[0] == COMMAND:
                return import_celery_beat(argv[1:], self.stdout.write)
            return main(cli_arguments(argv))
        finally:
            connections.close_all()
