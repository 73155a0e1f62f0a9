"""``sdcore db sql|upgrade|status``: print the DDL, apply pending migrations, show their state."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg import sql

from sdcore.cli._format import emit, json_line, render_table, utc_iso
from sdcore.cli._options import add_command, add_group, connection_options, outbox_table_option
from sdcore.cli._target import Target, connect_async, describe_error, target_of
from sdcore.postgres import (
    DEFAULT_TABLES,
    Component,
    MigrationStatus,
    UpgradeReport,
    full_sql,
    migration_scripts,
    migration_status,
    upgrade,
)


def _tables(
    target: Target, outbox_table: str | None, schedules: bool = False
) -> list[tuple[Component, Target]]:
    tables: list[tuple[Component, Target]] = [("lease", target)]
    if outbox_table is not None:
        outbox = Target(dsn=target.dsn, table=outbox_table, schema=target.schema, outbox=True)
        tables.append(("outbox", outbox))
    if schedules:  # the control plane: pause, trigger, backfill, stored schedules, history
        control = Target(dsn=target.dsn, table=DEFAULT_TABLES["schedules"], schema=target.schema)
        tables.append(("schedules", control))
    return tables


def db_sql(
    target: Target,
    outbox_table: str | None = None,
    *,
    per_migration: bool = False,
    schedules: bool = False,
) -> list[str]:
    """Return the DDL lines of the table(s) (what ``db upgrade`` applies to an empty database).

    With ``per_migration``, each migration's own script instead, each recording itself in
    ``sdcore_migrations`` so that ``db upgrade`` sees a database migrated by another tool as
    up to date.
    """
    lines: list[str] = []
    for component, table in _tables(target, outbox_table, schedules):
        if lines:
            lines.append("")
        if per_migration:
            for script in migration_scripts(component, table=table.table, schema=table.schema):
                lines += [*script.sql.rstrip("\n").splitlines(), ""]
            lines.pop()
            continue
        lines += (
            full_sql(component, table=table.table, schema=table.schema).rstrip("\n").splitlines()
        )
    return lines


def db_upgrade(
    target: Target, outbox_table: str | None = None, *, schedules: bool = False
) -> list[str]:
    """Apply the pending migrations under sdcore's schema advisory lock and report them.

    Raises:
        CliError: The database cannot be reached or refused a migration.
    """
    lines: list[str] = []
    try:
        for component, table in _tables(target, outbox_table, schedules):
            lines += asyncio.run(_upgrade(table, component))
        return lines
    except psycopg.Error as exc:
        raise describe_error(exc, target) from None


def db_status(
    target: Target, outbox_table: str | None = None, *, schedules: bool = False
) -> list[MigrationStatus]:
    """Return the applied and pending migrations of the table(s); changes nothing.

    Raises:
        CliError: The database cannot be reached.
    """
    try:
        return [
            asyncio.run(_status(table, component))
            for component, table in _tables(target, outbox_table, schedules)
        ]
    except psycopg.Error as exc:
        raise describe_error(exc, target) from None


async def _status(target: Target, component: Component) -> MigrationStatus:
    async with await connect_async(target) as conn:
        return await migration_status(conn, component, table=target.table, schema=target.schema)


async def _upgrade(target: Target, component: Component) -> list[str]:
    async with await connect_async(target) as conn:
        report = await upgrade(conn, component, table=target.table, schema=target.schema)
    lines = _report(target, report)
    lines += [f"applied {component} migration {m.name} to {target.shown}" for m in report.applied]
    return lines


def _report(target: Target, report: UpgradeReport) -> list[str]:
    before, after = report.before, report.after
    lines: list[str] = []
    if target.schema is not None and not before.schema_exists:
        lines.append(f"created schema {sql.Identifier(target.schema).as_string(None)}")
    if not before.table_exists:
        lines.append(f"created table {target.shown} with {after.indexes} indexes")
    else:
        added = after.indexes - before.indexes
        if added > 0:
            noun = "index" if added == 1 else "indexes"
            lines.append(f"table {target.shown} exists; created {added} missing {noun}")
    if not lines and not report.applied:
        lines.append(f"table {target.shown} is up to date; nothing to do")
    return lines


def format_migration_status(statuses: list[MigrationStatus], *, as_json: bool) -> list[str]:
    """Render ``db status``: one block per table, or one JSON object per table with ``--json``."""
    lines: list[str] = []
    for status in statuses:
        shown = Target(dsn="", table=status.table, schema=status.schema).shown
        if as_json:
            lines.append(
                json_line(
                    {
                        "component": status.component,
                        "table": status.table,
                        "schema": status.schema,
                        "up_to_date": status.up_to_date,
                        "applied": [
                            {"name": a.name, "applied_at": utc_iso(a.applied_at, precise=True)}
                            for a in status.applied
                        ],
                        "pending": [m.name for m in status.pending],
                        "modified": list(status.modified),
                        "unknown": list(status.unknown),
                    }
                )
            )
            continue
        rows = [[a.name, "applied", utc_iso(a.applied_at)] for a in status.applied]
        rows += [[m.name, "pending", ""] for m in status.pending]
        state = "up to date" if status.up_to_date else f"{len(status.pending)} pending"
        lines.append(f"{status.component} table {shown}: {state}")
        lines += ["  " + line for line in render_table(["migration", "state", "applied"], rows, {})]
        lines += [f"  warning: {name} changed since it was applied" for name in status.modified]
        lines += [f"  note: {name} was applied by a newer sdcore" for name in status.unknown]
    return lines


def register(subparsers: Any) -> None:
    """Add ``sdcore db sql|upgrade|status``."""
    commands = add_group(subparsers, "db", "print or apply the schema")
    sql_cmd = add_command(commands, "sql", _sql, help="print the DDL (no database needed)")
    connection_options(sql_cmd)
    upgrade = add_command(
        commands,
        "upgrade",
        _upgrade_command,
        help="apply pending migrations (race-safe; a 0.1.0 table is upgraded in place)",
    )
    connection_options(upgrade)
    status = add_command(
        commands,
        "status",
        _status_command,
        help="show applied and pending migrations (changes nothing)",
    )
    connection_options(status)
    status.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per table and line (JSON Lines) on stdout",
    )
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
        outbox_table_option(command)


def _outbox_of(args: argparse.Namespace) -> str | None:
    return args.outbox_table if args.outbox else None


def _sql(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    target = Target(dsn="", table=args.table, schema=args.schema)
    lines = db_sql(
        target, _outbox_of(args), per_migration=args.migrations, schedules=args.schedules
    )
    for line in lines:
        emit(line)


def _upgrade_command(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    for line in db_upgrade(target_of(args, environ), _outbox_of(args), schedules=args.schedules):
        emit(line)


def _status_command(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    statuses = db_status(target_of(args, environ), _outbox_of(args), schedules=args.schedules)
    for line in format_migration_status(statuses, as_json=args.json):
        emit(line)
