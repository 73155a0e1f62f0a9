"""``main(argv) -> int``: parse, dispatch, and turn expected failures into one stderr line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from sdcore import __version__
from sdcore.cli._demo import DemoFailedError
from sdcore.cli._format import one_line
from sdcore.cli._logging import cli_logging
from sdcore.cli._options import HANDLER
from sdcore.cli._parser import HelpExit, UsageError, build_parser, parse_args
from sdcore.cli._target import CliError, MissedTicksError
from sdcore.postgres import redact_text

__all__ = ["DemoFailedError", "MissedTicksError", "main", "run"]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_MISSED = 3
EXIT_INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``sdcore`` command line and return its exit status (never calls ``sys.exit``).

    Args:
        argv: Arguments without the program name; ``None`` means ``sys.argv[1:]``.

    Returns:
        0 on success, 1 on an error (cannot connect, missing table, job not released, …),
        2 on a usage error (bad option, bad id, bad duration, no database URL), 3 when
        ``schedules missed --check`` found missed ticks, 130 when interrupted.
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ
    secrets = _dsns_in(arguments, environ)
    if not arguments:
        build_parser(__version__).print_help(sys.stderr)
        return EXIT_USAGE
    try:
        args = parse_args(arguments, __version__)
        as_json = args.log_json or environ.get("SDCORE_LOG_JSON", "") in ("1", "true")
        with cli_logging(args.log_level, as_json=as_json, secrets=secrets):
            _dispatch(args, environ)
    except HelpExit as exc:
        return exc.status
    except UsageError as exc:
        _error(str(exc), secrets)
        return EXIT_USAGE
    except MissedTicksError as exc:
        _error(str(exc), secrets)
        return EXIT_MISSED
    except CliError as exc:
        _error(str(exc), secrets)
        return EXIT_ERROR
    except KeyboardInterrupt:
        _error("interrupted", secrets)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away: not worth a message.
        return EXIT_ERROR
    except Exception as exc:  # noqa: BLE001 - even a bug must not print a password
        _error(f"unexpected {type(exc).__name__}: {exc} (this is a bug; please report it)", secrets)
        return EXIT_ERROR
    return EXIT_OK


def run() -> None:
    """Console-script entry point: ``sys.exit(main())``."""
    status = main()
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout again at exit; point it at /dev/null so that flush is silent.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        status = status or EXIT_ERROR
    sys.exit(status)


def _dispatch(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    # Every leaf parser names its handler (see cli/_parser.py): ``register(subparsers)``.
    handler = getattr(args, HANDLER, None)
    if handler is None:  # pragma: no cover - argparse requires a leaf command
        raise UsageError(f"unknown command {args.group}")
    handler(args, environ)


def _dsns_in(arguments: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """Every connection string the user gave, so its password is masked in any message."""
    found = [environ.get("DATABASE_URL", "")]
    for index, word in enumerate(arguments):
        if word == "--database-url" and index + 1 < len(arguments):
            found.append(arguments[index + 1])
        elif word.startswith("--database-url="):
            found.append(word.partition("=")[2])
    return [dsn for dsn in found if dsn]


def _error(message: str, secrets: Sequence[str]) -> None:
    for dsn in secrets:
        message = redact_text(message, dsn)
    print(f"sdcore: error: {one_line(redact_text(message))}", file=sys.stderr)
