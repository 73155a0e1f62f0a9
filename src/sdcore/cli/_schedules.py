"""``sdcore schedules``: the schedules of an application, their runs and their missed ticks."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from datetime import UTC, datetime
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

from sdcore.cli import _control
from sdcore.cli import _missed as _missed_cli
from sdcore.cli._app_import import ProgramStartedError, import_app_module, program_started_message
from sdcore.cli._format import emit, escape, json_line, render_table, utc_iso
from sdcore.cli._jobs import Emit, list_jobs
from sdcore.cli._options import (
    MAX_CODE_LENGTH,
    add_command,
    add_group,
    connection_options,
    json_option,
    limit_option,
    parse_since,
    text,
)
from sdcore.cli._target import (
    CliError,
    MissedTicksError,
    Target,
    target_of,
)

if TYPE_CHECKING:
    from sdcore.scheduling import Scheduler

SCHEDULE_KEYS = (
    "name",
    "kind",
    "schedule",
    "time_zone",
    "exclusive",
    "active",
    "running",
    "next_fire_at",
    "next_fire_local",
)


def _scheduling() -> ModuleType:
    try:
        import sdcore.scheduling
    except ImportError as exc:
        raise CliError(f"`sdcore schedules` needs its extra: {exc}") from None
    return sdcore.scheduling


def load_scheduler(spec: str) -> Scheduler:
    """Import ``module:attribute`` (the current directory is importable, as for uvicorn).

    Raises:
        CliError: The scheduling extra is missing, malformed spec, module not importable,
            attribute missing or not a Scheduler.
    """
    scheduler_class = _scheduling().Scheduler
    from sdcore.runtime import Runtime

    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise CliError(f"--app must look like module:attribute, got {escape(spec)!s:.80}")
    try:
        module = import_app_module(module_name)
    except ProgramStartedError as exc:
        raise CliError(program_started_message(module_name, exc)) from None
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to see
        raise CliError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    found: object = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise CliError(f"{module_name!r} has no attribute {attribute!r}")
        found = getattr(found, part)
    if callable(found) and not isinstance(found, scheduler_class | Runtime):
        found = found()  # a factory, e.g. create_scheduler
    if isinstance(found, Runtime):
        found = found.scheduler  # the Runtime's schedules, as `sdcore run` takes them
    if not isinstance(found, scheduler_class):
        raise CliError(f"{spec!r} is a {type(found).__name__}, not a sdcore Scheduler or Runtime")
    return cast("Scheduler", found)


def _when(value: datetime | None) -> str:
    return "-" if value is None else utc_iso(value)


def _local(value: datetime | None) -> str:
    # A local wall time keeps its offset: that is what the column is for.
    return "-" if value is None else value.isoformat(timespec="seconds")


def list_schedules(spec: str, emit: Emit, *, as_json: bool = False) -> None:
    """Print every schedule with its next fire time in UTC and in its own zone.

    Args:
        spec: ``module:attribute`` of the Scheduler.
        emit: Writes one line of output.
        as_json: One JSON object per schedule (keys :data:`SCHEDULE_KEYS`) instead of the table.

    Raises:
        CliError: The scheduler cannot be loaded.
    """
    scheduler = load_scheduler(spec)
    infos = scheduler.schedules()
    if as_json:
        for info in infos:
            emit(
                json_line(
                    {
                        "name": info.name,
                        "kind": info.kind.value,
                        "schedule": info.description,
                        "time_zone": info.time_zone,
                        "exclusive": info.exclusive,
                        "active": info.active,
                        "running": info.running,
                        "next_fire_at": None
                        if info.next_fire_at is None
                        else utc_iso(info.next_fire_at),
                        "next_fire_local": None
                        if info.next_fire_local is None
                        else info.next_fire_local.isoformat(timespec="seconds"),
                    }
                )
            )
        return
    rows = [
        [
            info.name,
            info.kind.value,
            info.description,
            info.time_zone,
            "yes" if info.exclusive else "no",
            "active" if info.active else "stopped",
            _when(info.next_fire_at),
            _local(info.next_fire_local),
        ]
        for info in infos
    ]
    header = [
        "name",
        "kind",
        "schedule",
        "zone",
        "exclusive",
        "state",
        "next (UTC)",
        "next (local)",
    ]
    for line in render_table(header, rows, {"schedule": 40}):
        emit(line)
    if not rows:
        emit("(no schedules)")


def schedule_runs(
    target: Target, spec: str, name: str, limit: int, emit: Emit, *, as_json: bool = False
) -> None:
    """Print the most recent runs (lease rows) of one schedule."""
    load_scheduler(spec)
    list_jobs(target, emit, code=name, status=None, limit=limit, as_json=as_json)


def register(subparsers: Any) -> None:
    """Add ``sdcore schedules list|runs|missed`` and the control-plane commands."""
    commands = add_group(
        subparsers,
        "schedules",
        "list, pause/resume, trigger, backfill and create schedules across the replicas",
    )
    for name, handler, about in (
        ("list", _list, "schedules with their next fire time (UTC and local)"),
        (
            "runs",
            _runs,
            "an application's lease rows of one schedule (--app; `history` has the control "
            "plane's run history, with lag, replica and error)",
        ),
        ("missed", _missed, "expected ticks of one schedule without a SUCCESS row, and why"),
    ):
        command = add_command(commands, name, handler, help=about)
        connection_options(command)
        command.add_argument(
            "--app",
            required=name == "runs",
            metavar="MODULE:ATTRIBUTE",
            help="where the Scheduler (or Runtime) is, e.g. myapp.tasks:runtime"
            + {
                "list": " (without it: the cluster's schedules, from the database)",
                "missed": " (without it: the definition stored by the control plane)",
                "runs": "",
            }[name],
        )
        json_option(command)
        if name != "list":
            command.add_argument("name", type=text("name", MAX_CODE_LENGTH), help="schedule name")
        if name == "runs":
            limit_option(command, 20, "at most this many runs (default 20)")
        if name == "missed":
            command.add_argument(
                "--since",
                type=parse_since,
                metavar="WHEN",
                help="ISO instant with a zone (2026-07-01T00:00:00Z) or a duration ago "
                "(default: the first recorded run, at most 24h ago)",
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
    _control.register(commands)


def _list(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    if args.app:
        list_schedules(args.app, emit, as_json=args.json)
    else:  # the cluster's schedules, from the control plane's tables
        _control.list_cluster(target_of(args, environ), emit, as_json=args.json)


def _runs(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    target = target_of(args, environ)
    schedule_runs(target, args.app, args.name, args.limit, emit, as_json=args.json)


def _missed(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    target = target_of(args, environ)
    end = args.until or datetime.now(UTC)
    if args.app:
        scheduler, where, stored = load_scheduler(args.app), args.app, False
    else:
        scheduler = _missed_cli.stored_scheduler(target, args.name)
        where, stored = "the control plane", True
    missed = _missed_cli.missed_ticks(
        target,
        scheduler,
        args.name,
        args.since,
        end,
        emit,
        as_json=args.json,
        where=where,
        stored=stored,
    )
    if args.check and missed:
        raise MissedTicksError(f"{missed} missed tick(s) of {args.name!r}")
