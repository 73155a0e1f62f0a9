"""``sdcore schedules``: the schedules of an application, their runs and their missed ticks."""

from __future__ import annotations

import asyncio
import importlib
import sys
from datetime import UTC, datetime
from pathlib import Path

from sdcore.cli._db import CliError, Target
from sdcore.cli._format import escape, render_table
from sdcore.cli._jobs import Emit, list_jobs


def load_scheduler(spec: str) -> object:
    """Import ``module:attribute`` (the current directory is importable, as for uvicorn).

    Raises:
        CliError: Malformed spec, module not importable, attribute missing or not a Scheduler.
    """
    from sdcore.scheduling import Scheduler

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
    if callable(found) and not isinstance(found, Scheduler):
        found = found()  # a factory, e.g. create_scheduler
    if not isinstance(found, Scheduler):
        raise CliError(f"{spec!r} is a {type(found).__name__}, not a sdcore Scheduler")
    return found


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.isoformat(timespec="seconds")


def list_schedules(spec: str, emit: Emit) -> None:
    """Print every schedule with its next fire time in UTC and in its own zone."""
    from sdcore.scheduling import Scheduler

    scheduler = load_scheduler(spec)
    assert isinstance(scheduler, Scheduler)  # noqa: S101 - load_scheduler checked it
    rows = [
        [
            info.name,
            info.kind.value,
            info.description,
            info.time_zone,
            "yes" if info.exclusive else "no",
            "active" if info.active else "stopped",
            _when(None if info.next_fire_at is None else info.next_fire_at.astimezone(UTC)),
            _when(info.next_fire_local),
        ]
        for info in scheduler.schedules()
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


def schedule_runs(target: Target, spec: str, name: str, limit: int, emit: Emit) -> None:
    """Print the most recent runs (lease rows) of one schedule."""
    load_scheduler(spec)
    list_jobs(target, emit, code=name, status=None, limit=limit, as_json=False)


def missed_ticks(
    target: Target, spec: str, name: str, since: datetime, until: datetime | None, emit: Emit
) -> None:
    """Print the expected ticks of ``name`` in ``[since, until)`` that have no SUCCESS row."""
    from sdcore.job_scheduler import JobSchedulerError, JobSchedulerService
    from sdcore.scheduling import InvalidScheduleError, ScheduleNotFoundError, Scheduler

    scheduler = load_scheduler(spec)
    assert isinstance(scheduler, Scheduler)  # noqa: S101
    end = until or datetime.now(UTC)
    if since >= end:
        raise CliError("--since must be before --until")

    async def query() -> list[tuple[str, str]]:
        async with JobSchedulerService.connect(
            target.dsn, table=target.table, schema=target.schema, max_size=1
        ) as jobs:
            missed = await scheduler.missed_ticks(name, since, end, jobs=jobs)
        return [
            (m.run_key, "never started" if m.status is None else m.status.value) for m in missed
        ]

    try:
        found = asyncio.run(query())
    except ScheduleNotFoundError:
        raise CliError(f"no schedule named {escape(name)!r} in {spec}") from None
    except (InvalidScheduleError, JobSchedulerError, ValueError) as exc:
        raise CliError(str(exc)) from None
    for line in render_table(["run_key", "state"], [list(row) for row in found], {}):
        emit(line)
    emit(f"{len(found)} missed tick(s) of {escape(name)!r} in [{_when(since)}, {_when(end)})")
