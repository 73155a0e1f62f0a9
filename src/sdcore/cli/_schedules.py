"""``sdcore schedules``: the schedules of an application, their runs and their missed ticks."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

from sdcore.cli import _control
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
    run_admin,
    started_runtime,
    target_of,
)
from sdcore.job_scheduler import LeaseAdmin

if TYPE_CHECKING:
    from sdcore.scheduling import MissedTick, Scheduler

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

    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise CliError(f"--app must look like module:attribute, got {escape(spec)!s:.80}")
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to see
        raise CliError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    found: object = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise CliError(f"{module_name!r} has no attribute {attribute!r}")
        found = getattr(found, part)
    if callable(found) and not isinstance(found, scheduler_class):
        found = found()  # a factory, e.g. create_scheduler
    if not isinstance(found, scheduler_class):
        raise CliError(f"{spec!r} is a {type(found).__name__}, not a sdcore Scheduler")
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


def missed_ticks(
    target: Target,
    spec: str,
    name: str,
    since: datetime,
    until: datetime | None,
    emit: Emit,
    *,
    as_json: bool = False,
) -> int:
    """Print the expected ticks of ``name`` in ``[since, until)`` that have no SUCCESS row.

    Returns:
        How many ticks are missed.

    A schedule with no lease row at all is refused rather than listed tick by tick: a
    non-exclusive schedule (a Scheduler without ``jobs=``, or ``exclusive=False``) never writes
    one, so its ticks cannot be told apart from ticks that never ran.

    Raises:
        CliError: Unknown schedule, bad range, no recorded run at all, database failure.
    """
    from sdcore.job_scheduler import JobSchedulerError

    scheduling = _scheduling()
    scheduler = load_scheduler(spec)
    end = until or datetime.now(UTC)
    if since >= end:
        raise CliError("--since must be before --until")
    try:
        info = scheduler.get(name)
    except scheduling.ScheduleNotFoundError:
        raise CliError(f"no schedule named {escape(name)!r} in {spec}") from None

    async def recorded(admin: LeaseAdmin, conn: Any) -> bool:
        return await admin.has_schedule_runs(conn, name)

    if not run_admin(target, recorded):
        how = (
            "it is not exclusive in this Scheduler (no jobs= or exclusive=False)"
            if not info.exclusive
            else "it never ran against this table"
        )
        raise CliError(
            f"no run of {escape(name)!r} is recorded in {target.shown}; {how}. Non-exclusive "
            "schedules write no lease rows, so their missed ticks cannot be checked "
            "(check --table/--schema if it does run exclusively)"
        )

    async def query() -> list[MissedTick]:
        async with started_runtime(target) as runtime:
            return await scheduler.missed_ticks(name, since, end, jobs=runtime.jobs)

    try:
        found = asyncio.run(query())
    except (scheduling.InvalidScheduleError, JobSchedulerError, ValueError) as exc:
        raise CliError(str(exc)) from None
    if as_json:
        for tick in found:
            emit(
                json_line(
                    {
                        "run_key": tick.run_key,
                        "scheduled_at": utc_iso(tick.scheduled_at),
                        "status": None if tick.status is None else tick.status.value,
                        "given_back": tick.given_back,
                    }
                )
            )
        return len(found)
    rows = [[m.run_key, _missed_state(m)] for m in found]
    for line in render_table(["run_key", "state"], rows, {}):
        emit(line)
    emit(f"{len(found)} missed tick(s) of {escape(name)!r} in [{_when(since)}, {_when(end)})")
    return len(found)


def _missed_state(tick: MissedTick) -> str:
    if tick.status is None:
        return "never started"
    if tick.given_back is not None:
        return f"given back, never ran ({tick.given_back})"
    return tick.status.value


def register(subparsers: Any) -> None:
    """Add ``sdcore schedules list|runs|missed`` and the control-plane commands."""
    commands = add_group(subparsers, "schedules", "inspect the schedules of an application")
    for name, handler, about in (
        ("list", _list, "schedules with their next fire time (UTC and local)"),
        ("runs", _runs, "recent runs of one schedule"),
        ("missed", _missed, "expected ticks of one schedule without a SUCCESS row"),
    ):
        command = add_command(commands, name, handler, help=about)
        connection_options(command)
        command.add_argument(
            "--app",
            required=name != "list",
            metavar="MODULE:ATTRIBUTE",
            help="where the Scheduler is, e.g. myapp.tasks:scheduler"
            + (" (list: without it, the cluster's schedules from the database)" * (name == "list")),
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
    missed = missed_ticks(
        target, args.app, args.name, args.since, args.until, emit, as_json=args.json
    )
    if args.check and missed:
        raise MissedTicksError(f"{missed} missed tick(s) of {args.name!r}")
