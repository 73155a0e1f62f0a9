"""``sdcore schedules pause|resume|trigger|backfill|history|log|create|update|remove|prune`` and
the cluster-wide ``sdcore schedules list`` (without ``--app``): the control plane's commands."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import socket
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors

from sdcore.cli._db import CliError, Target, _cannot_connect, _connect_kwargs, describe_error
from sdcore.cli._format import compact_age, escape, json_line, render_table, utc_iso
from sdcore.cli._parser import parse_duration, parse_since

__all__ = ["CONTROL_COMMANDS", "add_control_commands", "run_control"]

T = TypeVar("T")
Emit = Callable[[str], None]

CONTROL_COMMANDS = (
    "pause",
    "resume",
    "trigger",
    "backfill",
    "history",
    "log",
    "create",
    "update",
    "remove",
    "prune",
)


def _name(text: str) -> str:
    if not text.strip() or len(text) > 64 or "\x00" in text:
        raise argparse.ArgumentTypeError(f"invalid schedule name {text!r:.70}")
    return text


def _reason(text: str) -> str:
    if not text.strip() or len(text) > 1000 or "\x00" in text:
        raise argparse.ArgumentTypeError("reason must be 1..1000 characters, no NUL")
    return text


def _positive(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r:.40}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value

    return parse


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--args is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--args must be a JSON object")
    return value


def _option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--option must look like key=value, got {text!r:.60}")
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return key, value


def add_control_commands(
    commands: Any,
    connection: Callable[[argparse.ArgumentParser], None],
) -> None:
    """Add the control-plane subcommands to ``sdcore schedules``."""
    helps = {
        "pause": "pause a schedule on every replica (who/why recorded)",
        "resume": "resume a paused schedule (its catch-up policy applies)",
        "trigger": "run a schedule once now on exactly one replica, even while paused",
        "backfill": "run every tick of a past window that has no SUCCESS, exactly once",
        "history": "runs of a schedule: status, lag, duration, replica, fencing token, error",
        "log": "the control actions of a schedule (who, why, when, progress)",
        "create": "create a stored schedule for a handler the replicas register",
        "update": "change a stored schedule (replicas follow within 2 s)",
        "remove": "remove a stored schedule",
        "prune": "delete run history and finished actions older than a duration",
    }
    for command_name in CONTROL_COMMANDS:
        command = commands.add_parser(command_name, help=helps[command_name])
        connection(command)
        if command_name != "prune":
            command.add_argument("name", type=_name, help="schedule name")
        if command_name in ("pause", "resume", "trigger", "backfill", "create", "update", "remove"):
            command.add_argument("--reason", type=_reason, metavar="TEXT", help="why (recorded)")
            command.add_argument(
                "--actor", type=_reason, metavar="WHO", help="who (default: user@host)"
            )
            command.add_argument("--json", action="store_true", help="the action as JSON")
        if command_name == "backfill":
            command.add_argument(
                "--from",
                dest="start",
                type=parse_since,
                required=True,
                metavar="ISO",
                help="first instant, inclusive (ISO 8601 with a zone)",
            )
            command.add_argument(
                "--to",
                dest="end",
                type=parse_since,
                required=True,
                metavar="ISO",
                help="last instant, inclusive",
            )
            command.add_argument(
                "--concurrency",
                type=_positive(1, 32),
                default=1,
                metavar="N",
                help="ticks at once when the schedule's overlap is allow (default 1)",
            )
            command.add_argument(
                "--wait", action="store_true", help="follow the progress until it finishes"
            )
            command.add_argument(
                "--timeout",
                type=_positive(1, 86_400),
                default=600,
                metavar="SECONDS",
                help="with --wait: give up waiting after this long (default 600)",
            )
        if command_name in ("history", "log"):
            command.add_argument(
                "--limit",
                type=_positive(1, 10_000),
                default=20,
                metavar="N",
                help="at most this many (default 20)",
            )
            command.add_argument("--json", action="store_true", help="one JSON object per line")
        if command_name in ("create", "update"):
            command.add_argument("--handler", type=_name, required=True, help="handler name")
            which = command.add_mutually_exclusive_group(required=True)
            which.add_argument("--cron", metavar="EXPR", help="cron expression")
            which.add_argument(
                "--every-ms", type=_positive(1, 2**31 - 1), metavar="MS", help="interval"
            )
            command.add_argument("--time-zone", default="UTC", metavar="ZONE", help="IANA zone")
            command.add_argument(
                "--args", type=_json_object, default={}, metavar="JSON", help="handler arguments"
            )
            command.add_argument(
                "--option",
                type=_option,
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help="a schedule option (retries=2, catch_up=latest, lease_ms=60000…)",
            )
        if command_name == "prune":
            command.add_argument(
                "--older-than",
                type=parse_duration,
                required=True,
                metavar="DURATION",
                help="e.g. 30d",
            )


def _actor(args: argparse.Namespace) -> str:
    if getattr(args, "actor", None):
        return str(args.actor)
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"[:200]


def _run(target: Target, operation: Callable[[Any], Awaitable[T]]) -> T:
    from psycopg_pool import AsyncConnectionPool

    from sdcore.scheduling import PostgresScheduleStore, ScheduleAdmin

    async def go() -> T:
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            target.dsn, min_size=1, max_size=2, kwargs=_connect_kwargs(target.dsn), open=False
        )
        try:
            await pool.open(wait=True, timeout=15)
        except Exception as exc:  # noqa: BLE001 - one redacted message
            await pool.close()
            raise _cannot_connect(exc, target.dsn) from None
        try:
            store = PostgresScheduleStore(pool, schema=target.schema, lease_table=target.table)
            return await operation(ScheduleAdmin(store))
        finally:
            await pool.close()

    try:
        return asyncio.run(go())
    except (pg_errors.UndefinedTable, pg_errors.InvalidSchemaName):
        words = "sdcore db upgrade --schedules"
        if target.schema:
            words += f" --schema {target.schema}"
        raise CliError(f"the schedules tables do not exist; run `{words}`") from None
    except psycopg.Error as exc:
        raise describe_error(exc, target) from None


def _when(value: datetime | None) -> str:
    return "-" if value is None else utc_iso(value)


def _action_json(action: Any) -> dict[str, Any]:
    return {
        "id": action.id,
        "schedule": action.schedule,
        "action": action.action.value,
        "actor": action.actor,
        "reason": action.reason,
        "params": dict(action.params),
        "progress": None if action.progress is None else dict(action.progress),
        "outcome": action.outcome,
        "created_at": utc_iso(action.created_at, precise=True),
        "finished_at": None
        if action.finished_at is None
        else utc_iso(action.finished_at, precise=True),
    }


def _describe(action: Any) -> str:
    what = action.action.value
    base = f"{what} of {escape(action.schedule)!s} recorded as action {action.id}"
    if what == "trigger":
        return base + f" (run key trigger:{action.id}); one replica runs it within ~2 s"
    if what == "backfill":
        ticks = action.params.get("ticks")
        return base + f" ({ticks} tick(s)); follow it with `sdcore schedules log {action.schedule}`"
    return base + "; every replica applies it within ~2 s"


def run_control(args: argparse.Namespace, target: Target, emit: Emit) -> None:
    """Run one control-plane command.

    Raises:
        CliError: Refused (nothing changed), or the database failed.
    """
    from sdcore.scheduling import InvalidScheduleError, ScheduleControlError

    command = args.command
    try:
        if command == "list":
            _list(target, emit, as_json=args.json)
        elif command in ("pause", "resume", "trigger", "remove"):
            action = _run(
                target,
                lambda admin: getattr(admin, command)(
                    args.name, actor=_actor(args), reason=args.reason
                ),
            )
            emit(json_line(_action_json(action)) if args.json else _describe(action))
        elif command == "backfill":
            _backfill(args, target, emit)
        elif command in ("create", "update"):
            options = dict(args.option)
            action = _run(
                target,
                lambda admin: getattr(admin, command)(
                    args.name,
                    handler=args.handler,
                    cron=args.cron,
                    every_ms=args.every_ms,
                    time_zone=args.time_zone,
                    args=args.args,
                    options=options,
                    actor=_actor(args),
                    reason=args.reason,
                ),
            )
            emit(json_line(_action_json(action)) if args.json else _describe(action))
        elif command == "history":
            _history(args, target, emit)
        elif command == "log":
            actions = _run(target, lambda admin: admin.actions(args.name, limit=args.limit))
            _emit_actions(actions, emit, as_json=args.json)
        elif command == "prune":
            count = _run(target, lambda admin: admin.prune(args.older_than))
            emit(f"deleted {count} run(s) and action(s)")
    except (ScheduleControlError, InvalidScheduleError) as exc:
        raise CliError(str(exc)) from None


def _backfill(args: argparse.Namespace, target: Target, emit: Emit) -> None:
    action = _run(
        target,
        lambda admin: admin.backfill(
            args.name,
            args.start,
            args.end,
            actor=_actor(args),
            reason=args.reason,
            concurrency=args.concurrency,
        ),
    )
    emit(json_line(_action_json(action)) if args.json else _describe(action))
    if not args.wait:
        return

    async def follow(admin: Any) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + args.timeout
        shown = None
        while True:
            current = await admin.action(action.id)
            if current.progress != shown and current.progress is not None:
                shown = current.progress
                p = dict(shown)
                emit(
                    f"progress: {p.get('succeeded', 0)} succeeded, {p.get('failed', 0)} failed, "
                    f"{p.get('remaining', '?')} remaining of {p.get('total', '?')}"
                )
            if current.finished_at is not None or loop.time() > deadline:
                return current
            await asyncio.sleep(0.5)

    final = _run(target, follow)
    if final.finished_at is None:
        raise CliError(f"backfill {action.id} still running after {args.timeout} s")
    emit(f"backfill {action.id} finished: {final.outcome}")
    if final.outcome != "SUCCESS":
        raise CliError(f"backfill {action.id} finished with failed ticks (see history)")


def _list(target: Target, emit: Emit, *, as_json: bool) -> None:
    states = _run(target, lambda admin: admin.list_schedules())
    if as_json:
        for s in states:
            emit(
                json_line(
                    {
                        "name": s.name,
                        "origin": s.origin,
                        "kind": s.kind,
                        "expression": s.expression,
                        "time_zone": s.time_zone,
                        "paused": s.paused,
                        "paused_at": None if s.paused_at is None else utc_iso(s.paused_at),
                        "paused_by": s.paused_by,
                        "paused_reason": s.paused_reason,
                        "handler": s.handler,
                        "args": s.args,
                        "next_fire_at": None if s.next_fire_at is None else utc_iso(s.next_fire_at),
                        "last_run_at": None if s.last_run_at is None else utc_iso(s.last_run_at),
                        "last_status": s.last_status,
                        "replicas": list(s.replicas),
                        "last_seen_at": None if s.last_seen_at is None else utc_iso(s.last_seen_at),
                        "versions": s.versions,
                    }
                )
            )
        return
    rows = [
        [
            escape(s.name),
            s.origin,
            escape(s.expression if s.kind != "interval" else f"every {s.expression} ms"),
            escape(s.time_zone),
            f"paused by {escape(s.paused_by or '?')}" if s.paused else "active",
            _when(s.next_fire_at),
            f"{_when(s.last_run_at)} {s.last_status or ''}".strip(),
            str(len(s.replicas)) + (f" ({s.versions} versions!)" if s.versions > 1 else ""),
        ]
        for s in states
    ]
    headers = ["NAME", "ORIGIN", "WHEN", "ZONE", "STATE", "NEXT", "LAST RUN", "REPLICAS"]
    for line in render_table(headers, rows, {"NAME": 40, "WHEN": 30, "STATE": 30}):
        emit(line)


def _history(args: argparse.Namespace, target: Target, emit: Emit) -> None:
    runs = _run(target, lambda admin: admin.history(args.name, limit=args.limit))
    if args.json:
        for r in runs:
            emit(
                json_line(
                    {
                        "schedule": r.schedule,
                        "run_key": r.run_key,
                        "source": r.source,
                        "status": r.status,
                        "scheduled_at": utc_iso(r.scheduled_at, precise=True),
                        "started_at": utc_iso(r.started_at, precise=True),
                        "finished_at": None
                        if r.finished_at is None
                        else utc_iso(r.finished_at, precise=True),
                        "lag_ms": round(r.lag.total_seconds() * 1000),
                        "duration_ms": None
                        if r.duration is None
                        else round(r.duration.total_seconds() * 1000),
                        "attempt": r.attempt,
                        "fencing_token": r.fencing_token,
                        "host": r.host,
                        "pid": r.pid,
                        "error": r.error,
                    }
                )
            )
        return
    rows = [
        [
            escape(r.run_key),
            r.source,
            r.status,
            _when(r.started_at),
            f"{r.lag.total_seconds():.3f}s",
            "-" if r.duration is None else f"{r.duration.total_seconds():.3f}s",
            f"{escape(r.host)}:{r.pid}",
            "-" if r.fencing_token is None else str(r.fencing_token),
            escape(r.error or ""),
        ]
        for r in runs
    ]
    headers = ["RUN KEY", "SOURCE", "STATUS", "STARTED", "LAG", "DURATION", "REPLICA", "FENCE"]
    for line in render_table([*headers, "ERROR"], rows, {"RUN KEY": 40, "ERROR": 60}):
        emit(line)


def _emit_actions(actions: Sequence[Any], emit: Emit, *, as_json: bool) -> None:
    if as_json:
        for action in actions:
            emit(json_line(_action_json(action)))
        return
    rows = []
    for a in actions:
        progress = ""
        if a.progress:
            p = dict(a.progress)
            progress = (
                f"{p.get('succeeded', 0)}/{p.get('total', 0)} ok, {p.get('failed', 0)} failed"
            )
        age = "-" if a.finished_at is None else compact_age(a.finished_at - a.created_at)
        rows.append(
            [
                str(a.id),
                a.action.value,
                escape(a.actor),
                _when(a.created_at),
                a.outcome or "open",
                age,
                progress,
                escape(a.reason or ""),
            ]
        )
    headers = ["ID", "ACTION", "ACTOR", "AT", "OUTCOME", "TOOK", "PROGRESS", "REASON"]
    for line in render_table(headers, rows, {"ACTOR": 30, "REASON": 60}):
        emit(line)
