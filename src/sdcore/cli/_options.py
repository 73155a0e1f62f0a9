"""The pieces every ``sdcore`` command parser is built from: the parser class, the option
groups, and the validators of option values.

Every value is checked here, before a connection is opened: a bad id, duration or table name is a
usage error (exit 2) and never reaches SQL. A command module (``cli/_<command>.py``) exposes
``register(subparsers)``, which adds its parsers with :func:`add_command` so that each leaf
parser names the function that runs it (stored as ``args.sdcore_handler``, a name no option
uses: ``schedules create --handler`` is an option of its own).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn

from sdcore._internal.redis_url import RedisUrlError, UntaggedPrefixError, check_queue_target
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
MAX_REQUEST_ID = 200
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_LOG_LEVEL = "WARNING"
FINISHED_STATUSES = ("SUCCESS", "FAIL")
ALL_STATUSES = ("RUNNING", *FINISHED_STATUSES)
TRANSACTION_POOLING_ENV = "SDCORE_TRANSACTION_POOLING"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})

# Units in this order, each at most once: "1d12h" yes, "12h1d" and "1d1d" no. ASCII digits only
# (``\d`` would accept Arabic-Indic digits), at most 9 per unit so int() is always cheap.
_DURATION = re.compile(
    r"(?:(?P<d>[0-9]{1,9})d)?(?:(?P<h>[0-9]{1,9})h)?(?:(?P<m>[0-9]{1,9})m)?(?:(?P<s>[0-9]{1,9})s)?"
)
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.IGNORECASE)

Handler = Callable[[argparse.Namespace, Mapping[str, str]], None]
"""What a leaf parser runs: ``handler(args, environ)``; output through ``_format.emit``."""
HANDLER = "sdcore_handler"


class UsageError(Exception):
    """A command line that cannot be run as written (exit status 2)."""


def check_queue_prefix(option: str, redis_url: str, prefix: str) -> None:
    """Refuse, before any connection, a bad Redis URL or, with a ``redis+cluster://`` URL, a
    BullMQ prefix ``option`` without a hash tag.

    Raises:
        UsageError: The URL or the prefix, named.
    """
    try:
        check_queue_target(redis_url, prefix)
    except RedisUrlError as exc:
        raise UsageError(f"the Redis URL: {exc}") from None
    except UntaggedPrefixError as exc:
        raise UsageError(f"{option}: {exc}") from None


class HelpExit(Exception):
    """``--help`` was printed: stop with ``status`` instead of calling ``sys.exit``."""

    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(status)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that raises instead of exiting, so ``main`` can return a code."""

    def error(self, message: str) -> NoReturn:
        hint = f" (see `{self.prog} --help`)"
        raise UsageError(message + hint)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            self._print_message(message)
        raise HelpExit(status)


Subparsers = argparse._SubParsersAction  # the type of ``add_subparsers()``'s result


def add_command(
    subparsers: Any, name: str, handler: Handler | None = None, **kwargs: Any
) -> argparse.ArgumentParser:
    """Add the parser of command ``name``; a leaf names its ``handler`` (see :data:`HANDLER`)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(name, **kwargs)
    if handler is not None:
        parser.set_defaults(**{HANDLER: handler})
    return parser


def add_group(subparsers: Any, name: str, about: str) -> Any:
    """Add a command that only holds subcommands (``db``, ``jobs``…); return its subparsers."""
    group = add_command(subparsers, name, help=about)
    return group.add_subparsers(dest="command", metavar="COMMAND", required=True)


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
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise argparse.ArgumentTypeError(
            f"instant {text!r:.60} is out of range: in UTC it must fall in the years 1 to 9999"
        ) from None


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


def int_in(low: int, high: int) -> Callable[[str], int]:
    """A validator of ASCII digits in ``low..high`` (no sign, space or ``_``)."""
    # At most 9 digits (int() stays cheap), more only when ``high`` needs them.
    digits = re.compile(f"[0-9]{{1,{max(9, len(str(high)))}}}")

    def parse(text: str) -> int:
        if not digits.fullmatch(text):
            raise argparse.ArgumentTypeError(
                f"invalid number {text[:40]!r}: expected {low}..{high}"
            )
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range: expected {low}..{high}")
        return value

    return parse


def identifier(field: str) -> Callable[[str], str]:
    """A validator of a PostgreSQL identifier (table or schema name)."""

    def parse(text: str) -> str:
        try:
            return check_identifier(field, text)
        except InvalidIdentifierError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def text(field: str, limit: int, *, strip: bool = False) -> Callable[[str], str]:
    """A validator of free text: not blank, at most ``limit`` characters, UTF-8, no NUL."""

    # argv can hold lone surrogates (undecodable bytes) and NUL cannot reach PostgreSQL text.
    def parse(text: str) -> str:
        value = text.strip() if strip else text
        if "\x00" in value:
            raise argparse.ArgumentTypeError(f"invalid {field}: contains a NUL character")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise argparse.ArgumentTypeError(f"invalid {field}: not valid UTF-8") from None
        if not value.strip():
            raise argparse.ArgumentTypeError(f"invalid {field}: must not be empty")
        if len(value) > limit:
            raise argparse.ArgumentTypeError(f"invalid {field}: longer than {limit} characters")
        return value

    return parse


def json_object(text: str) -> dict[str, Any]:
    """Parse ``--args``: a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--args is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--args must be a JSON object")
    return value


def key_value(text: str) -> tuple[str, Any]:
    """Parse ``--option key=value``; the value is JSON when it parses, else the text."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--option must look like key=value, got {text!r:.60}")
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return key, value


def _defaults(top: bool) -> Callable[[object], object]:
    # Below the top level the default is SUPPRESS, so a subcommand that does not repeat an
    # option keeps the top-level value.
    return lambda value: value if top else argparse.SUPPRESS


def connection_options(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    """``--database-url``, ``--table``, ``--schema`` and the logging options (before and after
    the command)."""
    default = _defaults(top)
    group = parser.add_argument_group("connection")
    group.add_argument(
        "--database-url",
        metavar="URL",
        default=default(None),
        help="libpq URL or key=value string (default: $DATABASE_URL)",
    )
    group.add_argument(
        "--table",
        type=identifier("table"),
        default=default(DEFAULT_TABLE),
        help=f"lease table name (default: {DEFAULT_TABLE})",
    )
    group.add_argument(
        "--schema",
        type=identifier("schema"),
        default=default(None),
        help="schema of the table (default: the connection's search_path)",
    )
    logging_options(parser, top=top)


def logging_options(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    """``--log-level`` and ``--log-json``: accepted before and after the command."""
    default = _defaults(top)
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


def json_option(parser: argparse.ArgumentParser) -> None:
    """``--json``: one JSON object per line."""
    parser.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per line, stable keys, times in UTC as ISO 8601 with Z",
    )


def outbox_table_option(parser: argparse.ArgumentParser) -> None:
    """``--outbox-table NAME``."""
    parser.add_argument(
        "--outbox-table",
        type=identifier("outbox table"),
        default=DEFAULT_OUTBOX_TABLE,
        metavar="NAME",
        help=f"outbox table name (default: {DEFAULT_OUTBOX_TABLE}; in --schema)",
    )


def limit_option(parser: argparse.ArgumentParser, default: int, about: str) -> None:
    """``--limit N`` (1 to 10,000)."""
    parser.add_argument(
        "--limit", type=int_in(1, MAX_LIST_LIMIT), default=default, metavar="N", help=about
    )


def older_than_option(parser: argparse.ArgumentParser, about: str) -> None:
    """``--older-than DURATION`` (required)."""
    parser.add_argument(
        "--older-than", type=parse_duration, required=True, metavar="DURATION", help=about
    )


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
