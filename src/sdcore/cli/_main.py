"""``main(argv) -> int``: parse, dispatch, and turn expected failures into one stderr line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from sdcore import __version__
from sdcore.cli._completion import completion_script
from sdcore.cli._control import CONTROL_COMMANDS, run_control
from sdcore.cli._dashboard import run_dashboard
from sdcore.cli._db import (
    CliError,
    Target,
    db_sql,
    db_status,
    db_upgrade,
    format_migration_status,
    resolve_dsn,
)
from sdcore.cli._format import one_line
from sdcore.cli._jobs import PruneOptions, list_jobs, prune_jobs, release_job
from sdcore.cli._logging import cli_logging
from sdcore.cli._outbox import list_outbox, retry_outbox, run_relay
from sdcore.cli._parser import (
    FINISHED_STATUSES,
    HelpExit,
    UsageError,
    build_parser,
    parse_args,
    transaction_pooling,
)
from sdcore.cli._run import RunOptions, run_app
from sdcore.cli._schedules import list_schedules, missed_ticks, schedule_runs
from sdcore.postgres import redact_text

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_MISSED = 3
EXIT_INTERRUPTED = 130


class DemoFailedError(CliError):
    """The demo's verdict found a doubled or missed tick."""


class MissedTicksError(CliError):
    """``schedules missed --check`` found missed ticks (exit status 3)."""


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
    command = (args.group, getattr(args, "command", ""))
    if command == ("db", "sql"):
        target = Target(dsn="", table=args.table, schema=args.schema)
        outbox_table = args.outbox_table if args.outbox else None
        for line in db_sql(
            target, outbox_table, per_migration=args.migrations, schedules=args.schedules
        ):
            _emit(line)
        return
    if args.group == "completion":
        for line in completion_script(build_parser(__version__), args.shell):
            _emit(line)
        return
    if args.group == "demo":
        _demo(args, environ)
        return
    if args.group == "run":
        run_options = RunOptions(
            spec=args.app,
            scheduler=not args.no_scheduler,
            relay=not args.no_relay,
            processors=not args.no_processors,
            ready_file=Path(args.ready_file) if args.ready_file else None,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
        )
        run_app(run_options, _emit)
        return
    if args.group == "dashboard":
        return run_dashboard(args, environ, _emit)
    if command == ("schedules", "list") and args.app:
        list_schedules(args.app, _emit, as_json=args.json)
        return
    target = Target(
        dsn=resolve_dsn(args.database_url, environ), table=args.table, schema=args.schema
    )
    if command == ("db", "upgrade"):
        for line in db_upgrade(
            target, args.outbox_table if args.outbox else None, schedules=args.schedules
        ):
            _emit(line)
    elif command == ("db", "status"):
        statuses = db_status(
            target, args.outbox_table if args.outbox else None, schedules=args.schedules
        )
        for line in format_migration_status(statuses, as_json=args.json):
            _emit(line)
    elif command == ("jobs", "list"):
        list_jobs(
            target, _emit, code=args.code, status=args.status, limit=args.limit, as_json=args.json
        )
    elif command == ("jobs", "release"):
        release_job(target, _emit, job_id=args.id, reason=args.reason)
    elif command == ("jobs", "prune"):
        options = PruneOptions(
            older_than=args.older_than,
            statuses=FINISHED_STATUSES if args.status is None else (args.status,),
            batch_size=args.batch_size,
            include_initial=args.include_initial,
            dry_run=args.dry_run,
        )
        prune_jobs(target, _emit, options)
    elif args.group in ("outbox", "relay"):
        _outbox(args, target, environ)
    elif args.group == "schedules" and args.command in (*CONTROL_COMMANDS, "list"):
        run_control(args, target, _emit)
    elif command == ("schedules", "runs"):
        schedule_runs(target, args.app, args.name, args.limit, _emit, as_json=args.json)
    elif command == ("schedules", "missed"):
        missed = missed_ticks(
            target, args.app, args.name, args.since, args.until, _emit, as_json=args.json
        )
        if args.check and missed:
            raise MissedTicksError(f"{missed} missed tick(s) of {args.name!r}")
    else:  # pragma: no cover - argparse only accepts the commands above
        raise UsageError(f"unknown command {' '.join(command)}")


def _outbox(args: argparse.Namespace, target: Target, environ: Mapping[str, str]) -> None:
    outbox = Target(dsn=target.dsn, table=args.outbox_table, schema=target.schema, outbox=True)
    if args.group == "relay":
        url = args.redis_url or environ.get("REDIS_URL")
        if not url:
            raise UsageError("the relay needs Redis: --redis-url or REDIS_URL")
        run_relay(
            outbox,
            _emit,
            redis_url=url,
            prefix=args.prefix,
            batch_size=args.batch_size,
            transaction_pooling=transaction_pooling(args.transaction_pooling, environ),
        )
    elif args.command == "list":
        chosen = args.status or ["PENDING", "DEAD"]
        statuses = ["PENDING", "DEAD", "PUBLISHED"] if "ALL" in chosen else sorted(set(chosen))
        list_outbox(outbox, _emit, statuses=statuses, limit=args.limit, as_json=args.json)
    else:
        retry_outbox(outbox, _emit, args.id)


def _demo(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    try:
        from sdcore.demo import DemoOptions, EmbeddedUnavailableError, run_demo
    except ImportError as exc:
        raise CliError(f"the demo needs its extra: pip install 'sdcore[demo]' ({exc})") from None
    url = args.database_url or environ.get("DATABASE_URL") or None
    options = DemoOptions(
        replicas=args.replicas, duration_s=args.duration, database_url=url, kill=not args.no_kill
    )
    try:
        status = run_demo(options, _emit)
    except (EmbeddedUnavailableError, RuntimeError, OSError) as exc:
        raise CliError(str(exc)) from None
    if status:
        raise DemoFailedError("the demo saw a tick run twice or not at all (see the verdict)")


def _emit(line: str) -> None:
    try:
        print(line)
    except UnicodeEncodeError:
        encoding = sys.stdout.encoding or "ascii"
        print(line.encode(encoding, "backslashreplace").decode(encoding))


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
