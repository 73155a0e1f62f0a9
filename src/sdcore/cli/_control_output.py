"""How the control-plane commands print: actions, the cluster's schedules, run history."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from sdcore.cli._format import compact_age, escape, json_line, render_table, utc_iso

Emit = Callable[[str], None]


def when(value: datetime | None) -> str:
    """A UTC instant to the second, or ``-``."""
    return "-" if value is None else utc_iso(value)


def _precise(value: datetime | None) -> str | None:
    return None if value is None else utc_iso(value, precise=True)


def _plain(value: datetime | None) -> str | None:
    return None if value is None else utc_iso(value)


def action_json(action: Any) -> dict[str, Any]:
    """One control action as a JSON object."""
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
        "finished_at": _precise(action.finished_at),
        "request_id": action.request_id,
        "replayed": action.replayed,
    }


def describe(action: Any) -> str:
    """The one line an action command prints: what was recorded and when it takes effect."""
    what = action.action.value
    if getattr(action, "replayed", False):
        state = "still open" if action.finished_at is None else f"finished {action.outcome}"
        return (
            f"{what} of {escape(action.schedule)!s}: request id "
            f"{escape(repr(action.request_id))!s} already recorded action {action.id} ({state}); "
            f"nothing new was recorded (a new request needs a new id; see "
            f"`sdcore schedules log {escape(action.schedule)!s}`)"
        )
    base = f"{what} of {escape(action.schedule)!s} recorded as action {action.id}"
    if what == "trigger":
        return base + f" (run key trigger:{action.id}); one replica runs it within ~2 s"
    if what == "backfill":
        ticks = action.params.get("ticks")
        again = ", those that succeeded run again" if action.params.get("rerun_succeeded") else ""
        return (
            base + f" ({ticks} tick(s){again}); follow it with "
            f"`sdcore schedules log {action.schedule}`"
        )
    return base + "; every replica applies it within ~2 s"


def emit_action(action: Any, emit: Emit, *, as_json: bool) -> None:
    """Print one action as JSON or as its :func:`describe` line."""
    emit(json_line(action_json(action)) if as_json else describe(action))


def _before(p: dict[str, Any]) -> str:
    """What a backfill's progress says of the ticks that had succeeded before it."""
    if p.get("rerun"):
        return f"{p['rerun']} had succeeded (re-run)"
    if p.get("already_succeeded"):
        return f"{p['already_succeeded']} already succeeded (not re-run)"
    return ""


def progress_line(progress: Any) -> str:
    """A backfill's progress while it is followed."""
    p = dict(progress)
    before = _before(p)
    return (
        f"progress: {p.get('succeeded', 0)} succeeded, {p.get('failed', 0)} failed, "
        f"{p.get('remaining', '?')} remaining of {p.get('total', '?')}"
        + (f"; {before}" if before else "")
    )


def _emit_json(items: Sequence[Any], as_dict: Callable[[Any], dict[str, Any]], emit: Emit) -> None:
    for item in items:
        emit(json_line(as_dict(item)))


def _schedule_json(s: Any) -> dict[str, Any]:
    return {
        "name": s.name,
        "origin": s.origin,
        "kind": s.kind,
        "expression": s.expression,
        "time_zone": s.time_zone,
        "paused": s.paused,
        "paused_at": _plain(s.paused_at),
        "paused_by": s.paused_by,
        "paused_reason": s.paused_reason,
        "handler": s.handler,
        "args": s.args,
        "options": dict(s.options),
        "next_fire_at": _plain(s.next_fire_at),
        "last_run_at": _plain(s.last_run_at),
        "last_status": s.last_status,
        "replicas": list(s.replicas),
        "last_seen_at": _plain(s.last_seen_at),
        "versions": s.versions,
        "undeclared": s.undeclared,
        "day_rule": s.day_rule,
        "live_versions": [_version_json(v) for v in s.live_versions],
        "version": s.version,
    }


def _version_json(v: Any) -> dict[str, Any]:
    return {
        "fingerprint": v.fingerprint,
        "kind": v.kind,
        "expression": v.expression,
        "time_zone": v.time_zone,
        "day_rule": v.day_rule,
        "options": None if v.options is None else dict(v.options),
        "next_fire_at": _plain(v.next_fire_at),
        "replicas": list(v.replicas),
    }


def _when_text(kind: str | None, expression: str | None, day_rule: str | None) -> str:
    if kind is None or expression is None:
        return "(definition not recorded: an older sdcore)"
    text = f"every {expression} ms" if kind == "interval" else expression
    return text + (f" ({day_rule} days)" if day_rule not in (None, "vixie") else "")


def _state(s: Any) -> str:
    if s.paused:
        return f"paused by {s.paused_by or '?'}"
    return "undeclared" if s.undeclared else "active"


def emit_schedules(states: Sequence[Any], emit: Emit, *, as_json: bool) -> None:
    """Print the cluster's schedules (``sdcore schedules list`` without ``--app``).

    Table cells are given raw: :func:`render_table` escapes each one (escaping them here too
    would double every backslash an odd name shows).
    """
    if as_json:
        _emit_json(states, _schedule_json, emit)
        return
    rows = [
        [
            s.name,
            s.origin,
            _when_text(s.kind, s.expression, s.day_rule),
            s.time_zone,
            _state(s),
            when(s.next_fire_at),
            f"{when(s.last_run_at)} {s.last_status or ''}".strip(),
            str(len(s.replicas)) + (f" ({s.versions} versions!)" if s.versions > 1 else ""),
            str(s.version),
        ]
        for s in states
    ]
    headers = [
        "NAME",
        "ORIGIN",
        "WHEN",
        "ZONE",
        "STATE",
        "NEXT",
        "LAST RUN",
        "REPLICAS",
        "VERSION",
    ]
    for line in render_table(headers, rows, {"NAME": 40, "WHEN": 30, "STATE": 30}):
        emit(line)
    # The row above shows the definition synced last; during a rolling deploy every live one
    # runs somewhere, so each is shown with its replicas and its own next fire.
    for s in states:
        if len(s.live_versions) < 2:
            continue
        emit("")
        emit(f"{escape(s.name)}: {len(s.live_versions)} versions live")
        version_rows = [
            [
                v.fingerprint[:12],
                _when_text(v.kind, v.expression, v.day_rule),
                v.time_zone or "-",
                when(v.next_fire_at),
                ", ".join(v.replicas),
            ]
            for v in s.live_versions
        ]
        version_headers = ["DEFINITION", "WHEN", "ZONE", "NEXT", "REPLICAS"]
        limits = {"WHEN": 30, "REPLICAS": 80}
        for line in render_table(version_headers, version_rows, limits):
            emit("  " + line)


def _ms(value: Any) -> int | None:
    return None if value is None else round(value.total_seconds() * 1000)


def _seconds(value: Any) -> str:
    return "-" if value is None else f"{value.total_seconds():.3f}s"


def _run_json(r: Any) -> dict[str, Any]:
    return {
        "schedule": r.schedule,
        "run_key": r.run_key,
        "source": r.source,
        "status": r.status,
        "scheduled_at": utc_iso(r.scheduled_at, precise=True),
        "started_at": utc_iso(r.started_at, precise=True),
        "finished_at": _precise(r.finished_at),
        "lag_ms": _ms(r.lag),
        "duration_ms": _ms(r.duration),
        "attempt": r.attempt,
        "fencing_token": r.fencing_token,
        "host": r.host,
        "pid": r.pid,
        "error": r.error,
    }


def emit_history(runs: Sequence[Any], emit: Emit, *, as_json: bool) -> None:
    """Print the runs of a schedule (``sdcore schedules history``)."""
    if as_json:
        _emit_json(runs, _run_json, emit)
        return
    rows = [
        [
            r.run_key,
            r.source,
            r.status,
            when(r.started_at),
            _seconds(r.lag),
            _seconds(r.duration),
            f"{r.host}:{r.pid}",
            "-" if r.fencing_token is None else str(r.fencing_token),
            r.error or "",
        ]
        for r in runs
    ]
    headers = ["RUN KEY", "SOURCE", "STATUS", "STARTED", "LAG", "DURATION", "REPLICA", "FENCE"]
    for line in render_table([*headers, "ERROR"], rows, {"RUN KEY": 40, "ERROR": 60}):
        emit(line)


def emit_actions(actions: Sequence[Any], emit: Emit, *, as_json: bool) -> None:
    """Print the control actions of a schedule (``sdcore schedules log``)."""
    if as_json:
        _emit_json(actions, action_json, emit)
        return
    rows = []
    for a in actions:
        progress = ""
        if a.progress:
            p = dict(a.progress)
            progress = (
                f"{p.get('succeeded', 0)}/{p.get('total', 0)} ok, {p.get('failed', 0)} failed"
            )
            if _before(p):
                progress += f", {_before(p)}"
        age = "-" if a.finished_at is None else compact_age(a.finished_at - a.created_at)
        rows.append(
            [
                str(a.id),
                a.action.value,
                a.actor,
                when(a.created_at),
                a.outcome or "open",
                age,
                progress,
                a.reason or "",
            ]
        )
    headers = ["ID", "ACTION", "ACTOR", "AT", "OUTCOME", "TOOK", "PROGRESS", "REASON"]
    for line in render_table(headers, rows, {"ACTOR": 30, "REASON": 60}):
        emit(line)
