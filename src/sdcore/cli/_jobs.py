"""The ``sdcore jobs`` commands: list, release and prune rows of the lease table.

The SQL is the library's (:class:`sdcore.job_scheduler.LeaseAdmin`); this module only parses and
prints. ``owner_token`` is the capability to write a run; no command selects it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sdcore.cli._format import compact_age, emit, escape, json_line, render_table, utc_iso
from sdcore.cli._options import (
    ALL_STATUSES,
    DEFAULT_BATCH_SIZE,
    DEFAULT_LIST_LIMIT,
    FINISHED_STATUSES,
    MAX_BATCH_SIZE,
    MAX_CODE_LENGTH,
    MAX_LIST_LIMIT,
    MAX_REASON_LENGTH,
    add_command,
    add_group,
    connection_options,
    int_in,
    json_option,
    limit_option,
    older_than_option,
    parse_job_id,
    text,
)
from sdcore.cli._target import AsyncConn, CliError, Target, run_admin, target_of
from sdcore.job_scheduler import (
    JobNotFoundError,
    JobNotRunningError,
    LeaseAdmin,
    LeaseRecord,
    PruneReport,
    ReleasedRun,
)

PROGRESS_EVERY_S = 5.0

LIST_HEADERS = (
    "id",
    "code",
    "type",
    "run_key",
    "status",
    "fencing_token",
    "modified_at",
    "age",
    "name",
)
# Long free-text columns are cut in the table; --json carries the full values.
LIST_WIDTHS = {"code": 24, "run_key": 28, "name": 32}

Emit = Callable[[str], None]


def list_jobs(
    target: Target,
    emit: Emit,
    *,
    code: str | None,
    status: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """Print runs newest first, as an aligned table or as JSON lines.

    Args:
        target: Database and table.
        emit: Writes one line of output.
        code: Only this exact code (equality, never a pattern).
        status: Only this status.
        limit: At most this many rows.
        as_json: One JSON object per row with full values instead of the table.

    Raises:
        CliError: Database unreachable or table missing.
    """

    async def fetch(admin: LeaseAdmin, conn: AsyncConn) -> list[LeaseRecord]:
        return await admin.list_runs(conn, code=code, status=status, limit=limit)

    rows = run_admin(target, fetch)
    if as_json:
        for row in rows:
            emit(json_line(_as_json(row)))
        return
    if not rows:
        emit("no jobs found")
        return
    for line in render_table(LIST_HEADERS, [_as_cells(row) for row in rows], LIST_WIDTHS):
        emit(line)
    if len(rows) == limit:
        emit(f"(limit {limit} reached: older jobs may exist; raise --limit or filter)")


def _as_cells(row: LeaseRecord) -> list[str]:
    return [
        row.id,
        row.code,
        row.type,
        "-" if row.run_key is None else row.run_key,
        row.status,
        str(row.fencing_token),
        utc_iso(row.modified_at),
        compact_age(row.age),
        "-" if row.name is None else row.name,
    ]


_JSON_FIELDS = (
    "id",
    "code",
    "name",
    "type",
    "run_key",
    "status",
    "fencing_token",
    "lock_key",
    "idempotency_key",
    "data",
)


def _as_json(row: LeaseRecord) -> dict[str, Any]:
    shown: dict[str, Any] = {name: getattr(row, name) for name in _JSON_FIELDS}
    shown["created_at"] = utc_iso(row.created_at, precise=True)
    shown["modified_at"] = utc_iso(row.modified_at, precise=True)
    shown["age_seconds"] = round(row.age.total_seconds(), 3)
    return shown


def release_job(target: Target, emit: Emit, *, job_id: str, reason: str | None) -> None:
    """Mark a RUNNING run FAIL so that the next acquire takes it at once.

    The owner's next heartbeat (and its finalize) returns ``False``: it requires the row to be
    RUNNING with the owner's token. The fencing token grows on the next acquire.

    Args:
        target: Database and table.
        emit: Writes one line of output.
        job_id: The row's id, already validated as a UUID.
        reason: Stored in ``data.reason`` (``null`` when omitted).

    Raises:
        CliError: No such job, the job is not RUNNING, or a database failure.
    """

    async def release(admin: LeaseAdmin, conn: AsyncConn) -> ReleasedRun:
        return await admin.release(conn, job_id, reason=reason)

    try:
        released = run_admin(target, release)
    except JobNotFoundError:
        raise CliError(f"no such job {job_id} in {target.shown}") from None
    except JobNotRunningError as exc:
        raise CliError(
            f"job {job_id} is not RUNNING (status {escape(exc.status)}); nothing released"
        ) from None
    key = "" if released.run_key is None else f", run_key {escape(released.run_key)}"
    emit(
        f"released job {job_id} (code {escape(released.code)}, {released.type}{key}, "
        f"fencing_token {released.fencing_token}): marked FAIL; the owner's next heartbeat "
        "fails and the next acquire takes the run"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class PruneOptions:
    """What ``jobs prune`` deletes."""

    older_than: timedelta
    statuses: tuple[str, ...]
    batch_size: int
    include_initial: bool
    dry_run: bool


def prune_jobs(target: Target, emit: Emit, options: PruneOptions) -> None:
    """Delete finished rows last modified before the database's now minus ``older_than``.

    The cutoff is read once from ``clock_timestamp()``; each batch is its own transaction, so a
    long prune never holds many locks and an interruption keeps what was already deleted.

    Args:
        target: Database and table.
        emit: Writes one line of output.
        options: Age, statuses, batch size, INITIAL handling, dry run.

    Raises:
        CliError: Database unreachable or table missing.
    """

    def progress(deleted: int) -> None:
        now = time.monotonic()
        if now - shown[0] >= PROGRESS_EVERY_S:
            shown[0] = now
            emit(f"  … deleted {_rows(deleted)} so far")

    shown = [time.monotonic()]

    async def prune(admin: LeaseAdmin, conn: AsyncConn) -> PruneReport:
        return await admin.prune(
            conn,
            older_than=options.older_than,
            statuses=options.statuses,
            batch_size=options.batch_size,
            include_initial=options.include_initial,
            dry_run=options.dry_run,
            progress=progress,
        )

    report = run_admin(target, prune)
    scope = f"{'/'.join(report.statuses)} rows modified before {utc_iso(report.cutoff)}"
    if report.dry_run:
        emit(f"dry run: would delete {_rows(report.matching)} ({scope}); nothing deleted")
    else:
        emit(f"deleted {_rows(report.deleted)} ({scope})")
    if report.kept_initial:
        emit(
            f"kept {_rows(report.kept_initial, 'INITIAL row')}: deleting one lets its job run "
            "again (--include-initial deletes them)"
        )


def _rows(count: int, noun: str = "row") -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def register(subparsers: Any) -> None:
    """Add ``sdcore jobs list|release|prune``."""
    commands = add_group(subparsers, "jobs", "inspect and operate job runs")

    listing = add_command(commands, "list", _list, help="show runs, newest first")
    connection_options(listing)
    listing.add_argument(
        "--code", metavar="CODE", type=text("code", MAX_CODE_LENGTH, strip=True), help="exact code"
    )
    listing.add_argument("--status", type=str.upper, choices=ALL_STATUSES, help="only this status")
    limit_option(
        listing,
        DEFAULT_LIST_LIMIT,
        f"at most this many rows, 1..{MAX_LIST_LIMIT} (default: {DEFAULT_LIST_LIMIT})",
    )
    json_option(listing)

    release = add_command(commands, "release", _release, help="mark a stuck RUNNING run FAIL")
    connection_options(release)
    release.add_argument("id", type=parse_job_id, help="job id (UUID) from `sdcore jobs list`")
    release.add_argument(
        "--reason",
        metavar="TEXT",
        type=text("reason", MAX_REASON_LENGTH),
        help="stored in the row's data",
    )

    prune = add_command(commands, "prune", _prune, help="delete old finished runs")
    connection_options(prune)
    older_than_option(
        prune, "finished before now minus this (database clock): 30d, 12h, 90m, 45s, 1d12h"
    )
    prune.add_argument(
        "--status",
        type=str.upper,
        choices=FINISHED_STATUSES,
        help="only this status (default: SUCCESS and FAIL; RUNNING is never pruned)",
    )
    prune.add_argument(
        "--batch-size",
        type=int_in(1, MAX_BATCH_SIZE),
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


def _list(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    list_jobs(
        target_of(args, environ),
        emit,
        code=args.code,
        status=args.status,
        limit=args.limit,
        as_json=args.json,
    )


def _release(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    release_job(target_of(args, environ), emit, job_id=args.id, reason=args.reason)


def _prune(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    options = PruneOptions(
        older_than=args.older_than,
        statuses=FINISHED_STATUSES if args.status is None else (args.status,),
        batch_size=args.batch_size,
        include_initial=args.include_initial,
        dry_run=args.dry_run,
    )
    prune_jobs(target_of(args, environ), emit, options)
