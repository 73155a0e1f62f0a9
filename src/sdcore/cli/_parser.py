"""The ``sdcore`` argument parser: the top-level options, then each command module's parsers.

Each command module ``cli/_<command>.py`` exposes ``register(subparsers)``, which adds its
command(s) and names on every leaf parser the function that runs it (``args.handler``); this
module only calls them, in the order ``sdcore --help`` lists the commands. The validators and
option groups they share are in ``cli/_options.py`` (re-exported here for existing imports).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from sdcore.cli import _completion, _dashboard, _db, _demo, _jobs, _outbox, _run, _schedules
from sdcore.cli._options import (
    ALL_STATUSES,
    DEFAULT_OUTBOX_TABLE,
    DEFAULT_TABLE,
    FINISHED_STATUSES,
    TRANSACTION_POOLING_ENV,
    HelpExit,
    Parser,
    UsageError,
    connection_options,
    parse_duration,
    parse_job_id,
    parse_since,
    transaction_pooling,
)

__all__ = [
    "ALL_STATUSES",
    "DEFAULT_OUTBOX_TABLE",
    "DEFAULT_TABLE",
    "FINISHED_STATUSES",
    "TRANSACTION_POOLING_ENV",
    "HelpExit",
    "UsageError",
    "build_parser",
    "parse_args",
    "parse_duration",
    "parse_job_id",
    "parse_since",
    "transaction_pooling",
]

# In the order of ``sdcore --help``.
REGISTER = (
    _completion.register,
    _db.register,
    _jobs.register,
    _outbox.register,
    _run.register,
    _demo.register,
    _schedules.register,
    _dashboard.register,
)


def build_parser(version: str = "") -> argparse.ArgumentParser:
    """Return the parser of the whole ``sdcore`` command line.

    Args:
        version: What ``sdcore --version`` prints after the program name.
    """
    parser = Parser(
        prog="sdcore",
        description=(
            "Operate sdcore: the job lease table, the schedules control plane (list, pause, "
            "trigger, backfill, create), the transactional outbox and its relay."
        ),
        epilog="Errors: exit 1; usage errors: exit 2. Passwords are never printed.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version}".rstrip())
    connection_options(parser, top=True)
    commands = parser.add_subparsers(dest="group", metavar="COMMAND", required=True)
    for register in REGISTER:
        register(commands)
    return parser


def parse_args(argv: Sequence[str], version: str = "") -> argparse.Namespace:
    """Parse ``argv`` (without the program name).

    Raises:
        UsageError: The command line is invalid.
        HelpExit: Help or the version was printed.
    """
    return build_parser(version).parse_args(list(argv))
