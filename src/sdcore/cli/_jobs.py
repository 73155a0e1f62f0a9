"""The ``sdcore jobs`` commands: list, release and prune rows of the lease table.

``owner_token`` is the capability to write a run; no command selects it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from psycopg.rows import dict_row

from sdcore.cli import _queries as q
from sdcore.cli._db import CliError, Target, connection
from sdcore.cli._format import compact_age, escape, json_line, render_table, utc_iso

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
    conditions = [
        text
        for text, value in ((q.LIST_BY_CODE, code), (q.LIST_BY_STATUS, status))
        if value is not None
    ]
    query = q.render(q.LIST, target.identifier, conditions=" AND ".join(conditions) or q.LIST_ALL)
    params = {"code": code, "status": status, "limit": limit}
    with connection(target) as conn, conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(query, params).fetchall()
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


def _as_cells(row: dict[str, Any]) -> list[str]:
    return [
        row["id"],
        row["code"],
        row["type"],
        "-" if row["run_key"] is None else row["run_key"],
        row["status"],
        str(row["fencing_token"]),
        utc_iso(row["modified_at"]),
        compact_age(row["age"]),
        "-" if row["name"] is None else row["name"],
    ]


def _as_json(row: dict[str, Any]) -> dict[str, Any]:
    shown = {key: value for key, value in row.items() if key != "age"}
    shown["created_at"] = utc_iso(row["created_at"], precise=True)
    shown["modified_at"] = utc_iso(row["modified_at"], precise=True)
    shown["age_seconds"] = round(row["age"].total_seconds(), 3)
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
    params = {"id": job_id, "reason": reason}
    with connection(target) as conn:
        released = conn.execute(q.render(q.RELEASE, target.identifier), params).fetchone()
        current = None
        if released is None:
            current = conn.execute(q.render(q.STATUS_OF, target.identifier), params).fetchone()
    if released is not None:
        code, type_, run_key, fencing = released
        key = "" if run_key is None else f", run_key {escape(run_key)}"
        emit(
            f"released job {job_id} (code {escape(code)}, {type_}{key}, fencing_token {fencing}):"
            " marked FAIL; the owner's next heartbeat fails and the next acquire takes the run"
        )
        return
    if current is None:
        raise CliError(f"no such job {job_id} in {target.shown}")
    raise CliError(f"job {job_id} is not RUNNING (status {escape(current[0])}); nothing released")


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
    params: dict[str, Any] = {
        "older_than": options.older_than,
        "statuses": list(options.statuses),
        "include_initial": options.include_initial,
        "batch": options.batch_size,
    }
    deleted = 0
    with connection(target) as conn:
        cutoff_row = conn.execute(q.PRUNE_CUTOFF, params).fetchone()
        if cutoff_row is None:  # pragma: no cover - a SELECT of one expression returns a row
            raise CliError("the database returned no clock reading")
        cutoff: datetime = cutoff_row[0]
        params["cutoff"] = cutoff
        counts = conn.execute(q.render(q.PRUNE_COUNT, target.identifier), params).fetchone()
        matching, kept_initial = counts if counts is not None else (0, 0)
        if not options.dry_run:
            batch = q.render(q.PRUNE_BATCH, target.identifier)
            try:
                while True:
                    count = conn.execute(batch, params).rowcount
                    deleted += count
                    if count < options.batch_size:
                        break
            except KeyboardInterrupt:
                emit(f"interrupted: deleted {_rows(deleted)} before stopping")
                raise
    scope = f"{'/'.join(options.statuses)} rows modified before {utc_iso(cutoff)}"
    if options.dry_run:
        emit(f"dry run: would delete {_rows(matching)} ({scope}); nothing deleted")
    else:
        emit(f"deleted {_rows(deleted)} ({scope})")
    if kept_initial:
        emit(
            f"kept {_rows(kept_initial, 'INITIAL row')}: deleting one lets its job run again "
            "(--include-initial deletes them)"
        )


def _rows(count: int, noun: str = "row") -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
