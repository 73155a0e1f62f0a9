"""The ``sdcore`` argument parser and the validators of its option values.

Every value is checked here, before a connection is opened: a bad id, duration or table name is a
usage error (exit 2) and never reaches SQL.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import NoReturn

from sdcore.cli._metrics import add_run_arguments
from sdcore.postgres import InvalidIdentifierError, check_identifier

DEFAULT_TABLE = "job_scheduler"
DEFAULT_OUTBOX_TABLE = "outbox"
DEFAULT_LIST_LIMIT = 50
MAX_LIST_LIMIT = 10_000
DEFAULT_BATCH_SIZE = 1_000
MAX_BATCH_SIZE = 100_000
MAX_DURATION = timedelta(days=36_500)
MAX_REASON_LENGTH = 1_000
MAX_CODE_LENGTH = 64
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_LOG_LEVEL = "WARNING"
COMPLETION_SHELLS = ("bash", "zsh")
FINISHED_STATUSES = ("SUCCESS", "FAIL")
TRANSACTION_POOLING_ENV = "SDCORE_TRANSACTION_POOLING"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})
ALL_STATUSES = ("RUNNING", *FINISHED_STATUSES)

# Units in this order, each at most once: "1d12h" yes, "12h1d" and "1d1d" no. ASCII digits only
# (``\d`` would accept Arabic-Indic digits), at most 9 per unit so int() is always cheap.
_DURATION = re.compile(
    r"(?:(?P<d>[0-9]{1,9})d)?(?:(?P<h>[0-9]{1,9})h)?(?:(?P<m>[0-9]{1,9})m)?(?:(?P<s>[0-9]{1,9})s)?"
)
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.IGNORECASE)


class UsageError(Exception):
    """A command line that cannot be run as written (exit status 2)."""


class HelpExit(Exception):
    """``--help`` was printed: stop with ``status`` instead of calling ``sys.exit``."""

    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(status)


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that raises instead of exiting, so ``main`` can return a code."""

    def error(self, message: str) -> NoReturn:
        hint = f" (see `{self.prog} --help`)"
        raise UsageError(message + hint)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            self._print_message(message)
        raise HelpExit(status)


def parse_duration(text: str) -> timedelta:
    """Parse a positive duration such as ``30d``, ``12h``, ``90m``, ``45s`` or ``1d12h``.

    Args:
        text: Digits followed by a unit (d, h, m, s), units in that order, each at most once.

    Returns:
        The duration.

    Raises:
        argparse.ArgumentTypeError: Empty, zero, negative, malformed or over 36,500 days.
    """
    match = _DURATION.fullmatch(text)
    if not text or match is None:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: use a number and a unit (d, h, m, s), "
            "for example 30d, 12h, 90m, 45s or 1d12h"
        )
    parts = {unit: int(value) for unit, value in match.groupdict(default="0").items()}
    duration = timedelta(days=parts["d"], hours=parts["h"], minutes=parts["m"], seconds=parts["s"])
    if duration <= timedelta(0):
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: must be greater than zero")
    if duration > MAX_DURATION:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: at most {MAX_DURATION.days} days"
        )
    return duration


def parse_job_id(text: str) -> str:
    """Validate a job id (a UUID in its canonical 8-4-4-4-12 form) and return it lower-cased.

    Raises:
        argparse.ArgumentTypeError: Not a canonical UUID.
    """
    if _UUID.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(
            f"invalid job id {text[:80]!r}: expected a UUID such as "
            "0b5f8a52-4c1e-4f43-9a43-6f1c2d3e4f50, as shown by `sdcore jobs list`"
        )
    return text.lower()


def _int_in(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not re.fullmatch(r"[0-9]{1,9}", text):
            raise argparse.ArgumentTypeError(
                f"invalid number {text[:40]!r}: expected {low}..{high}"
            )
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range: expected {low}..{high}")
        return value

    return parse


def _identifier(field: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        try:
            return check_identifier(field, text)
        except InvalidIdentifierError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _text(field: str, limit: int, *, strip: bool = False) -> Callable[[str], str]:
    # argv can hold lone surrogates (undecodable bytes) and NUL cannot reach PostgreSQL text.
    def parse(text: str) -> str:
        value = text.strip() if strip else text
        if "\x00" in value:
            raise argparse.ArgumentTypeError(f"invalid {field}: contains a NUL character")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise argparse.ArgumentTypeError(f"invalid {field}: not valid UTF-8") from None
        if not value:
            raise argparse.ArgumentTypeError(f"invalid {field}: must not be empty")
        if len(value) > limit:
            raise argparse.ArgumentTypeError(f"invalid {field}: longer than {limit} characters")
        return value

    return parse


def _connection_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    # Accepted before and after the command. Below the top level the default is SUPPRESS, so
    # a subcommand that does not repeat an option keeps the top-level value.
    def default(value: object) -> object:
        return value if top else argparse.SUPPRESS

    group = parser.add_argument_group("connection")
    group.add_argument(
        "--database-url",
        metavar="URL",
        default=default(None),
        help="libpq URL or key=value string (default: $DATABASE_URL)",
    )
    group.add_argument(
        "--table",
        type=_identifier("table"),
        default=default(DEFAULT_TABLE),
        help=f"lease table name (default: {DEFAULT_TABLE})",
    )
    group.add_argument(
        "--schema",
        type=_identifier("schema"),
        default=default(None),
        help="schema of the table (default: the connection's search_path)",
    )
    _logging_options(parser, top=top)


def _logging_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    # Like the connection options: accepted before and after the command.
    def default(value: object) -> object:
        return value if top else argparse.SUPPRESS

    group = parser.add_argument_group("logging (to stderr)")
    group.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=default(DEFAULT_LOG_LEVEL),
        help=f"the least severe level logged (default: {DEFAULT_LOG_LEVEL})",
    )
    group.add_argument(
        "--log-json",
        action="store_true",
        default=default(False),
        help="one JSON object per log record (time, level, logger, message, extra fields)",
    )


def _json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per line, stable keys, times in UTC as ISO 8601 with Z",
    )


def build_parser(version: str = "") -> argparse.ArgumentParser:
    """Return the parser of the whole ``sdcore`` command line.

    Args:
        version: What ``sdcore --version`` prints after the program name.
    """
    parser = _Parser(
        prog="sdcore",
        description=(
            "Operate sdcore: the job lease table, the schedules of an application, the "
            "transactional outbox and its relay."
        ),
        epilog="Errors: exit 1; usage errors: exit 2. Passwords are never printed.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version}".rstrip())
    _connection_options(parser, top=True)
    commands = parser.add_subparsers(dest="group", metavar="COMMAND", required=True)
    completion = commands.add_parser(
        "completion", help="print a shell completion script (bash or zsh)"
    )
    completion.add_argument(
        "shell",
        choices=COMPLETION_SHELLS,
        help="bash: eval \"$(sdcore completion bash)\"; zsh: eval \"$(sdcore completion zsh)\"",
    )

    db = commands.add_parser("db", help="print or apply the schema")
    db_commands = db.add_subparsers(dest="command", metavar="COMMAND", required=True)
    sql_cmd = db_commands.add_parser("sql", help="print the DDL (no database needed)")
    _connection_options(sql_cmd, top=False)
    upgrade = db_commands.add_parser(
        "upgrade", help="apply pending migrations (race-safe; a 0.1.0 table is upgraded in place)"
    )
    _connection_options(upgrade, top=False)
    status = db_commands.add_parser(
        "status", help="show applied and pending migrations (changes nothing)"
    )
    _connection_options(status, top=False)
    status.add_argument("--json", action="store_true", help="one JSON document on stdout")
    sql_cmd.add_argument(
        "--migrations",
        action="store_true",
        help="each migration's own script, recording itself in sdcore_migrations",
    )
    for command in (sql_cmd, upgrade, status):
        command.add_argument(
            "--outbox", action="store_true", help="also the transactional outbox table"
        )
        command.add_argument(
            "--schedules",
            action="store_true",
            help="also the schedules control-plane tables (sdcore_schedules…; in --schema)",
        )
        command.add_argument(
            "--outbox-table",
            type=_identifier("outbox table"),
            default="outbox",
            metavar="NAME",
            help="outbox table name (default: outbox; in --schema)",
        )

    jobs = commands.add_parser("jobs", help="inspect and operate job runs")
    job_commands = jobs.add_subparsers(dest="command", metavar="COMMAND", required=True)

    listing = job_commands.add_parser("list", help="show runs, newest first")
    _connection_options(listing, top=False)
    listing.add_argument(
        "--code", metavar="CODE", type=_text("code", MAX_CODE_LENGTH, strip=True), help="exact code"
    )
    listing.add_argument("--status", type=str.upper, choices=ALL_STATUSES, help="only this status")
    listing.add_argument(
        "--limit",
        type=_int_in(1, MAX_LIST_LIMIT),
        default=DEFAULT_LIST_LIMIT,
        metavar="N",
        help=f"at most this many rows, 1..{MAX_LIST_LIMIT} (default: {DEFAULT_LIST_LIMIT})",
    )
    _json_option(listing)

    release = job_commands.add_parser("release", help="mark a stuck RUNNING run FAIL")
    _connection_options(release, top=False)
    release.add_argument("id", type=parse_job_id, help="job id (UUID) from `sdcore jobs list`")
    release.add_argument(
        "--reason",
        metavar="TEXT",
        type=_text("reason", MAX_REASON_LENGTH),
        help="stored in the row's data",
    )

    prune = job_commands.add_parser("prune", help="delete old finished runs")
    _connection_options(prune, top=False)
    prune.add_argument(
        "--older-than",
        type=parse_duration,
        required=True,
        metavar="DURATION",
        help="finished before now minus this (database clock): 30d, 12h, 90m, 45s, 1d12h",
    )
    prune.add_argument(
        "--status",
        type=str.upper,
        choices=FINISHED_STATUSES,
        help="only this status (default: SUCCESS and FAIL; RUNNING is never pruned)",
    )
    prune.add_argument(
        "--batch-size",
        type=_int_in(1, MAX_BATCH_SIZE),
        default=DEFAULT_BATCH_SIZE,
        metavar="N",
        help=f"rows per DELETE transaction (default: {DEFAULT_BATCH_SIZE})",
    )
    prune.add_argument(
        "--include-initial",
        action="store_true",
        help="also delete INITIAL rows (their job would run again!)",
    )
    prune.add_argument("--dry-run", action="store_true", help="count, delete nothing")

    outbox = commands.add_parser("outbox", help="inspect and retry transactional outbox rows")
    outbox_commands = outbox.add_subparsers(dest="command", metavar="COMMAND", required=True)
    outbox_list = outbox_commands.add_parser("list", help="pending and dead rows, newest first")
    outbox_retry = outbox_commands.add_parser("retry", help="make a DEAD row due again")
    relay = commands.add_parser("relay", help="run the outbox relay until SIGTERM")
    for command in (outbox_list, outbox_retry, relay):
        _connection_options(command, top=False)
        command.add_argument(
            "--outbox-table",
            type=_identifier("outbox table"),
            default="outbox",
            metavar="NAME",
            help="outbox table name (default: outbox; in --schema)",
        )
    outbox_list.add_argument(
        "--status",
        type=str.upper,
        choices=("PENDING", "DEAD", "PUBLISHED", "ALL"),
        action="append",
        help="repeatable; default: PENDING and DEAD",
    )
    outbox_list.add_argument(
        "--limit",
        type=_int_in(1, MAX_LIST_LIMIT),
        default=DEFAULT_LIST_LIMIT,
        metavar="N",
        help=f"at most this many rows (default: {DEFAULT_LIST_LIMIT})",
    )
    _json_option(outbox_list)
    outbox_retry.add_argument("id", type=_int_in(1, 2**63 - 1), help="outbox row id")
    relay.add_argument("--redis-url", metavar="URL", help="Redis URL (default: $REDIS_URL)")
    relay.add_argument(
        "--transaction-pooling",
        action="store_true",
        default=None,
        help="the database URL is a transaction-mode pooler such as PgBouncer: no server-side "
        f"prepared statements (default: ${TRANSACTION_POOLING_ENV}=1)",
    )
    relay.add_argument("--prefix", default="bull", help="BullMQ key prefix (default: bull)")
    relay.add_argument(
        "--batch-size", type=_int_in(1, 10_000), default=100, metavar="N", help="rows per claim"
    )

    run = commands.add_parser(
        "run",
        help="run an application's Runtime (schedules, relay, processors) until SIGTERM",
        description=(
            "Import MODULE:ATTR — a sdcore Runtime, a Scheduler, an app with sdcore installed, or "
            "a factory returning one — and run it as a long-lived worker process. SIGTERM or "
            "SIGINT stops it gracefully."
        ),
    )
    run.add_argument("app", metavar="MODULE:ATTR", help="e.g. myapp.worker:runtime")
    _logging_options(run, top=False)
    run.add_argument("--no-scheduler", action="store_true", help="do not run the schedules")
    run.add_argument("--no-relay", action="store_true", help="do not run the outbox relay")
    run.add_argument("--no-processors", action="store_true", help="do not run the queue processors")
    add_run_arguments(run)  # --metrics-port (sdcore.cli._metrics)
    run.add_argument(
        "--ready-file",
        metavar="PATH",
        help="write the pid here once started, remove it at exit (for an exec readiness probe)",
    )

    demo = commands.add_parser(
        "demo",
        help="run N replicas of one per-second schedule, kill one, and judge: each tick once?",
    )
    _connection_options(demo, top=False)
    demo.add_argument(
        "--replicas", type=_int_in(2, 16), default=3, metavar="N", help="replica processes (2..16)"
    )
    demo.add_argument(
        "--duration",
        type=_int_in(10, 600),
        default=30,
        metavar="SECONDS",
        help="seconds of ticks to watch (10..600, default 30)",
    )
    demo.add_argument("--no-kill", action="store_true", help="do not SIGKILL a replica half-way")

    schedules = commands.add_parser("schedules", help="inspect the schedules of an application")
    schedule_commands = schedules.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, text in (
        ("list", "schedules with their next fire time (UTC and local)"),
        ("runs", "recent runs of one schedule"),
        ("missed", "expected ticks of one schedule without a SUCCESS row"),
    ):
        command = schedule_commands.add_parser(name, help=text)
        _connection_options(command, top=False)
        command.add_argument(
            "--app",
            required=name != "list",
            metavar="MODULE:ATTRIBUTE",
            help="where the Scheduler is, e.g. myapp.tasks:scheduler"
            + (" (list: without it, the cluster's schedules from the database)" * (name == "list")),
        )
        _json_option(command)
        if name != "list":
            command.add_argument("name", type=_text("name", MAX_CODE_LENGTH), help="schedule name")
        if name == "runs":
            command.add_argument(
                "--limit",
                type=_int_in(1, MAX_LIST_LIMIT),
                default=20,
                metavar="N",
                help="at most this many runs (default 20)",
            )
        if name == "missed":
            command.add_argument(
                "--since",
                type=parse_since,
                required=True,
                metavar="WHEN",
                help="ISO instant with a zone (2026-07-01T00:00:00Z) or a duration ago (24h)",
            )
            command.add_argument(
                "--until",
                type=parse_since,
                metavar="WHEN",
                help="end of the range (default: now)",
            )
            command.add_argument(
                "--check",
                action="store_true",
                help="exit status 3 if any tick is missed (for monitoring probes)",
            )
    from sdcore.cli._control import add_control_commands  # imports this module

    add_control_commands(schedule_commands, lambda c: _connection_options(c, top=False))
    from sdcore.cli._dashboard import register as add_dashboard  # imports this module

    add_dashboard(commands, lambda c: _connection_options(c, top=False))
    return parser


def transaction_pooling(option: bool | None, environ: Mapping[str, str]) -> bool:
    """Return ``--transaction-pooling``, else ``$SDCORE_TRANSACTION_POOLING`` (1/0, true/false).

    Raises:
        UsageError: The variable holds something else.
    """
    if option:
        return True
    value = environ.get(TRANSACTION_POOLING_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise UsageError(
        f"{TRANSACTION_POOLING_ENV} must be 1 or 0 (or true/false, yes/no, on/off), "
        f"got {value[:20]!r}"
    )


def parse_since(text: str) -> datetime:
    """Parse an aware ISO instant, or a duration meaning "that long ago"."""
    try:
        return datetime.now(UTC) - parse_duration(text)
    except argparse.ArgumentTypeError:
        pass
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid instant {text!r:.60}: use ISO 8601 with a zone or a duration like 24h"
        ) from None
    if value.tzinfo is None:
        raise argparse.ArgumentTypeError(f"instant {text!r:.60} needs a zone (e.g. Z or +02:00)")
    return value.astimezone(UTC)


def parse_args(argv: Sequence[str], version: str = "") -> argparse.Namespace:
    """Parse ``argv`` (without the program name).

    Raises:
        UsageError: The command line is invalid.
        HelpExit: Help or the version was printed.
    """
    return build_parser(version).parse_args(list(argv))
