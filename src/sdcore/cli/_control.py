"""``sdcore schedules pause|resume|trigger|backfill|history|log|create|update|remove|prune`` and
the cluster-wide ``sdcore schedules list`` (without ``--app``): the control plane's commands.

Each runs one :class:`~sdcore.scheduling.ScheduleAdmin` operation on the schedule store of a
command :class:`~sdcore.runtime.Runtime` (``_target.started_runtime``); output is rendered by
``_control_output``.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import getpass
import socket
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors

from sdcore.cli import _control_output as out
from sdcore.cli._format import emit, escape
from sdcore.cli._options import (
    MAX_CODE_LENGTH,
    MAX_REASON_LENGTH,
    MAX_REQUEST_ID,
    add_command,
    connection_options,
    int_in,
    json_object,
    key_value,
    limit_option,
    older_than_option,
    parse_since,
    text,
)
from sdcore.cli._target import CliError, Target, describe_error, started_runtime, target_of

__all__ = ["CONTROL_COMMANDS", "list_cluster", "register"]

T = TypeVar("T")
Emit = Callable[[str], None]

HELPS = {
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
CONTROL_COMMANDS = tuple(HELPS)
# The commands that record an action (with who and why).
_ACTIONS = ("pause", "resume", "trigger", "backfill", "create", "update", "remove")
_BACKFILL_POLL_S = 0.5


def register(commands: Any) -> None:
    """Add the control-plane subcommands to ``sdcore schedules`` (its subparsers)."""
    name = text("schedule name", MAX_CODE_LENGTH)
    reason = text("reason", MAX_REASON_LENGTH)
    for command_name, about in HELPS.items():
        command = add_command(commands, command_name, _control, help=about)
        connection_options(command)
        if command_name != "prune":
            command.add_argument("name", type=name, help="schedule name")
        if command_name in _ACTIONS:
            command.add_argument("--reason", type=reason, metavar="TEXT", help="why (recorded)")
            command.add_argument(
                "--actor", type=reason, metavar="WHO", help="who (default: user@host)"
            )
            command.add_argument("--json", action="store_true", help="the action as JSON")
        if command_name in ("trigger", "backfill"):
            command.add_argument(
                "--request-id",
                type=text("request id", MAX_REQUEST_ID),
                metavar="ID",
                help="this request's id (default: a new one per run); a retry with the same id "
                "returns the first action instead of recording another",
            )
        if command_name == "backfill":
            _backfill_options(command)
        if command_name in ("history", "log"):
            limit_option(command, 20, "at most this many (default 20)")
            command.add_argument("--json", action="store_true", help="one JSON object per line")
        if command_name in ("create", "update"):
            _definition_options(command, name, create=command_name == "create")
        if command_name == "prune":
            older_than_option(command, "e.g. 30d")


def _backfill_options(command: argparse.ArgumentParser) -> None:
    for flag, dest, about in (
        ("--from", "start", "first instant, inclusive (ISO 8601 with a zone)"),
        ("--to", "end", "last instant, inclusive"),
    ):
        command.add_argument(
            flag, dest=dest, type=parse_since, required=True, metavar="ISO", help=about
        )
    command.add_argument(
        "--concurrency",
        type=int_in(1, 32),
        default=1,
        metavar="N",
        help="ticks at once when the schedule's overlap is allow (default 1)",
    )
    command.add_argument(
        "--rerun-succeeded",
        action="store_true",
        help="also run again the ticks that had already succeeded (once each, under a run key "
        "of their own); without it they are counted as already succeeded and not re-run",
    )
    command.add_argument(
        "--wait", action="store_true", help="follow the progress until it finishes"
    )
    command.add_argument(
        "--timeout",
        type=int_in(1, 86_400),
        default=600,
        metavar="SECONDS",
        help="with --wait: give up waiting after this long (default 600)",
    )


def _definition_options(
    command: argparse.ArgumentParser, name: Callable[[str], str], *, create: bool
) -> None:
    # update changes only what it is given: nothing is required and nothing has a default.
    keep = "" if create else " (default: unchanged)"
    command.add_argument("--handler", type=name, required=create, help="handler name" + keep)
    which = command.add_mutually_exclusive_group(required=create)
    which.add_argument("--cron", metavar="EXPR", help="cron expression" + keep)
    which.add_argument(
        "--every-ms", type=int_in(1, 2**31 - 1), metavar="MS", help="interval" + keep
    )
    command.add_argument(
        "--time-zone", metavar="ZONE", help="IANA zone" + (keep or " (default: UTC)")
    )
    command.add_argument(
        "--args",
        type=json_object,
        metavar="JSON",
        help="handler arguments" + (" (replaces them all; default: unchanged)" if keep else ""),
    )
    command.add_argument(
        "--option",
        type=key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a schedule option (retries=2, catch_up=latest, lease_ms=60000…)"
        + (" (the others keep their values)" if keep else ""),
    )
    if not create:
        command.add_argument(
            "--expected-version",
            type=int_in(0, 2**63 - 1),
            metavar="N",
            help="refuse the change if the schedule is no longer at this version "
            "(VERSION in `sdcore schedules list`)",
        )


def _actor(args: argparse.Namespace) -> str:
    if getattr(args, "actor", None):
        return str(args.actor)
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"[:200]


def _request_id(args: argparse.Namespace) -> str:
    """The request id of a trigger or backfill: ``--request-id``, else a new one."""
    if getattr(args, "request_id", None):
        return str(args.request_id)
    return uuid.uuid4().hex


def _run(target: Target, operation: Callable[[Any], Awaitable[T]]) -> T:
    try:
        from sdcore.scheduling import (
            ControlWriteUncertainError,
            InvalidScheduleError,
            ScheduleAdmin,
            ScheduleControlError,
        )
    except ImportError as exc:
        raise CliError(f"`sdcore schedules` needs its extra: {exc}") from None

    async def go() -> T:
        async with started_runtime(target) as runtime:
            admin = ScheduleAdmin(runtime.schedule_store)
            try:
                return await operation(admin)
            except ScheduleControlError as exc:
                if exc.schedule is None or not exc.problem.startswith("no such schedule"):
                    raise
                names = [state.name for state in await admin.list_schedules()]
                raise CliError(f"{exc}{_missing_hint(exc.schedule, names)}") from None

    try:
        return asyncio.run(go())
    except (ScheduleControlError, InvalidScheduleError) as exc:
        raise CliError(str(exc)) from None
    except ControlWriteUncertainError as exc:
        again = ""
        if exc.request_id is not None:
            again = (
                f"; to retry without recording it twice, run it again with "
                f"--request-id {exc.request_id}"
            )
        raise CliError(str(exc) + again) from None
    except (pg_errors.UndefinedTable, pg_errors.UndefinedColumn, pg_errors.InvalidSchemaName):
        words = "sdcore db upgrade --schedules"
        if target.schema:
            words += f" --schema {target.schema}"
        raise CliError(f"the schedules tables do not exist; run `{words}`") from None
    except psycopg.Error as exc:
        raise describe_error(exc, target) from None


def list_cluster(target: Target, emit: Emit, *, as_json: bool) -> None:
    """Print the cluster's schedules, as the control plane's tables record them.

    Raises:
        CliError: The database failed, or the control plane's tables are missing.
    """
    states = _run(target, lambda admin: admin.list_schedules())
    out.emit_schedules(states, emit, as_json=as_json)
    if not states and not as_json:
        emit(NO_REPLICA)


NO_REPLICA = (
    "(no schedules: no replica has joined the control plane; a bare Scheduler does not, use a "
    "Runtime or a ScheduleControl — or name the application with --app)"
)


def _missing_hint(name: str, known: list[str]) -> str:
    """What to try instead of a schedule name the control plane does not know."""
    if not known:
        return f"; {NO_REPLICA[1:-1]}"
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {escape(close[0])!r}?)" if close else ""


def _control(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Run one control-plane command.

    Raises:
        CliError: Refused (nothing changed), or the database failed.
    """
    target = target_of(args, environ)
    command = args.command
    if command == "trigger":
        request = _request_id(args)
        action = _run(
            target,
            lambda admin: admin.trigger(
                args.name, actor=_actor(args), reason=args.reason, request_id=request
            ),
        )
        out.emit_action(action, emit, as_json=args.json)
    elif command in ("pause", "resume", "remove"):
        action = _run(
            target,
            lambda admin: getattr(admin, command)(
                args.name, actor=_actor(args), reason=args.reason
            ),
        )
        out.emit_action(action, emit, as_json=args.json)
    elif command == "backfill":
        _backfill(args, target)
    elif command == "create":
        options = dict(args.option)
        action = _run(
            target,
            lambda admin: admin.create(
                args.name,
                handler=args.handler,
                cron=args.cron,
                every_ms=args.every_ms,
                time_zone=args.time_zone or "UTC",
                args=args.args or {},
                options=options,
                actor=_actor(args),
                reason=args.reason,
            ),
        )
        out.emit_action(action, emit, as_json=args.json)
    elif command == "update":
        options = dict(args.option)
        action = _run(
            target,
            lambda admin: admin.update(
                args.name,
                handler=args.handler,
                cron=args.cron,
                every_ms=args.every_ms,
                time_zone=args.time_zone,
                args=args.args,
                options=options,
                expected_version=args.expected_version,
                actor=_actor(args),
                reason=args.reason,
            ),
        )
        out.emit_action(action, emit, as_json=args.json)
    elif command == "history":
        runs = _run(target, lambda admin: admin.history(args.name, limit=args.limit))
        out.emit_history(runs, emit, as_json=args.json)
    elif command == "log":
        actions = _run(target, lambda admin: admin.actions(args.name, limit=args.limit))
        out.emit_actions(actions, emit, as_json=args.json)
    elif command == "prune":
        count = _run(target, lambda admin: admin.prune(args.older_than))
        emit(f"deleted {count} run(s) and action(s)")


def _backfill(args: argparse.Namespace, target: Target) -> None:
    request = _request_id(args)
    action = _run(
        target,
        lambda admin: admin.backfill(
            args.name,
            args.start,
            args.end,
            actor=_actor(args),
            reason=args.reason,
            concurrency=args.concurrency,
            request_id=request,
            rerun_succeeded=args.rerun_succeeded,
        ),
    )
    out.emit_action(action, emit, as_json=args.json)
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
                emit(out.progress_line(shown))
            if current.finished_at is not None or loop.time() > deadline:
                return current
            await asyncio.sleep(_BACKFILL_POLL_S)

    final = _run(target, follow)
    if final.finished_at is None:
        raise CliError(f"backfill {action.id} still running after {args.timeout} s")
    emit(f"backfill {action.id} finished: {final.outcome}")
    if final.outcome == "CANCELLED":
        raise CliError(f"backfill {action.id} was cancelled: its schedule was removed")
    if final.outcome != "SUCCESS":
        raise CliError(f"backfill {action.id} finished with failed ticks (see history)")
