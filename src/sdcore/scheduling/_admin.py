"""``ScheduleAdmin``: the operator API of the control plane (see ``_control.py`` for its types).

Every input is validated before anything is written: a refused action changes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from sdcore.scheduling._catch_up import MAX_RANGE_TICKS
from sdcore.scheduling._control import (
    MAX_ACTOR,
    MAX_ARGS_BYTES,
    MAX_BACKFILL_CONCURRENCY,
    MAX_REASON,
    ActionKind,
    ControlAction,
    Declared,
    RunRecord,
    ScheduleControlError,
    ScheduleRow,
    ScheduleState,
    ScheduleStore,
    Write,
    fingerprint,
    policy_options,
    row_trigger,
)
from sdcore.scheduling._cron import InvalidScheduleError
from sdcore.scheduling._policy import KNOWN_OPTIONS, build_policy, check_name
from sdcore.scheduling._runner import utcnow
from sdcore.scheduling._triggers import ScheduleKind, Trigger, expected_instants

__all__ = ["ScheduleAdmin"]


class _Definition(NamedTuple):
    """What ``create`` and ``update`` are given about a stored schedule."""

    handler: str
    cron: str | None
    every_ms: int | None
    time_zone: str
    args: Mapping[str, Any] | None
    options: Mapping[str, Any] | None


def _text(field_name: str, value: object, limit: int, *, optional: bool) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ScheduleControlError(None, f"{field_name} must be a non-empty str")
    if len(value) > limit or "\x00" in value:
        raise ScheduleControlError(
            None, f"{field_name} must hold at most {limit} characters and no NUL"
        )
    return value


def _aware(label: str, value: object) -> datetime:
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise ScheduleControlError(
            None, f"{label} must be an aware datetime (ISO 8601 with a zone)"
        )
    return value.astimezone(UTC)


class ScheduleAdmin:
    """The operator API: pause, resume, trigger, backfill, stored schedules, list, history.

    Every input is validated before anything is written; a refused action changes nothing and
    raises :class:`ScheduleControlError` (or :class:`~sdcore.scheduling.InvalidScheduleError`
    for a bad stored definition).

    Args:
        store: Where the control plane lives (:class:`~sdcore.scheduling.PostgresScheduleStore`
            or :class:`~sdcore.testing.InMemoryScheduleStore`).
        clock: The wall clock (aware UTC) that bounds a backfill's window and computes next
            fire times (inject one in tests that move time).
    """

    def __init__(self, store: ScheduleStore, *, clock: Callable[[], datetime] = utcnow) -> None:
        self.store = store
        self._clock = clock

    async def _known(self, name: object, *, declared: bool) -> ScheduleRow:
        if not isinstance(name, str):
            raise ScheduleControlError(None, f"schedule name must be a str, got {name!r:.60}")
        row = await self.store.row(name)
        if row is None or row.removed_at is not None:
            raise ScheduleControlError(
                name, "no such schedule (see `sdcore schedules list`); nothing changed"
            )
        if declared and row.origin == "code" and not await self.store.live_declarers(name):
            raise ScheduleControlError(
                name, "no running replica declares this schedule; nothing changed"
            )
        stored = declared and row.origin == "stored" and row.handler is not None
        if stored and row.handler not in await self.store.live_handlers():
            raise ScheduleControlError(
                name,
                f"no running replica registers its handler {row.handler!r}; nothing changed",
            )
        return row

    async def _write(self, write: Write) -> ControlAction:
        action = await self.store.write(write)
        if action is None:
            raise ScheduleControlError(
                write.name, "the schedule changed meanwhile; nothing changed"
            )
        return action

    async def pause(self, name: str, *, actor: str, reason: str | None = None) -> ControlAction:
        """Pause a schedule on every replica (no tick starts; fires are recorded as skipped).

        Raises:
            ScheduleControlError: Unknown, not declared by a running replica, already paused, or a
                bad actor/reason.
        """
        who = _text("actor", actor, MAX_ACTOR, optional=False)
        why = _text("reason", reason, MAX_REASON, optional=True)
        row = await self._known(name, declared=True)
        if row.paused:
            raise ScheduleControlError(row.name, "already paused; nothing changed")
        assert who is not None  # noqa: S101 - not optional
        return await self._write(
            Write(name=row.name, action=ActionKind.PAUSE, actor=who, reason=why)
        )

    async def resume(self, name: str, *, actor: str, reason: str | None = None) -> ControlAction:
        """Resume a paused schedule; each replica applies its catch-up policy to the pause.

        Raises:
            ScheduleControlError: Unknown, or not paused.
        """
        who = _text("actor", actor, MAX_ACTOR, optional=False)
        why = _text("reason", reason, MAX_REASON, optional=True)
        row = await self._known(name, declared=False)
        if not row.paused:
            raise ScheduleControlError(row.name, "not paused; nothing changed")
        assert who is not None  # noqa: S101
        return await self._write(
            Write(name=row.name, action=ActionKind.RESUME, actor=who, reason=why)
        )

    async def _runnable(self, name: str) -> tuple[ScheduleRow, Trigger]:
        row = await self._known(name, declared=True)
        trigger = row_trigger(row.name, row.kind, row.expression, row.time_zone)
        if trigger is None:
            raise ScheduleControlError(
                row.name, f"a {row.kind} schedule cannot be triggered or backfilled"
            )
        if not row.options.get("exclusive", False):
            raise ScheduleControlError(
                row.name, "only exclusive schedules (run on one replica) can be triggered"
            )
        return row, trigger

    async def trigger(self, name: str, *, actor: str, reason: str | None = None) -> ControlAction:
        """Run a schedule once now on exactly one replica, even while paused.

        Its run key is ``trigger:<action id>``.

        Raises:
            ScheduleControlError: Unknown, undeclared, not exclusive, or not cron/interval.
        """
        who = _text("actor", actor, MAX_ACTOR, optional=False)
        why = _text("reason", reason, MAX_REASON, optional=True)
        row, _ = await self._runnable(name)
        assert who is not None  # noqa: S101
        return await self._write(
            Write(name=row.name, action=ActionKind.TRIGGER, actor=who, reason=why)
        )

    async def backfill(
        self,
        name: str,
        start: datetime,
        end: datetime,
        *,
        actor: str,
        reason: str | None = None,
        concurrency: int = 1,
    ) -> ControlAction:
        """Run every expected tick in ``[start, end]`` (both inclusive) without ``SUCCESS``.

        One replica coordinates, oldest tick first, at most ``concurrency`` at once (1 unless the
        schedule's overlap is ``allow``); progress is in the action's ``progress``.

        Raises:
            ScheduleControlError: Unknown or undeclared schedule, unaware or reversed bounds, a
                window in the future, no tick in it, or more than 10,000 ticks.
        """
        who = _text("actor", actor, MAX_ACTOR, optional=False)
        why = _text("reason", reason, MAX_REASON, optional=True)
        low = _aware("--from", start)
        high = _aware("--to", end)
        if high < low:
            raise ScheduleControlError(
                None, f"the window ends ({high:%Y-%m-%dT%H:%M:%SZ}) before it starts"
            )
        if high > self._clock():
            raise ScheduleControlError(
                None, "the window must lie in the past (--to is in the future)"
            )
        if isinstance(concurrency, bool) or not isinstance(concurrency, int):
            raise ScheduleControlError(None, "concurrency must be an int")
        if not 1 <= concurrency <= MAX_BACKFILL_CONCURRENCY:
            raise ScheduleControlError(
                None, f"concurrency must be between 1 and {MAX_BACKFILL_CONCURRENCY}"
            )
        row, trigger = await self._runnable(name)
        try:
            ticks = expected_instants(
                trigger, low, high + timedelta(microseconds=1), limit=MAX_RANGE_TICKS
            )
        except ValueError as exc:
            raise ScheduleControlError(row.name, str(exc)) from None
        if not ticks:
            raise ScheduleControlError(row.name, "no tick falls in the window; nothing changed")
        assert who is not None  # noqa: S101
        params = {
            "from": low.isoformat(),
            "to": high.isoformat(),
            "ticks": len(ticks),
            "concurrency": concurrency,
        }
        return await self._write(
            Write(name=row.name, action=ActionKind.BACKFILL, actor=who, reason=why, params=params)
        )

    async def create(
        self,
        name: str,
        *,
        handler: str,
        cron: str | None = None,
        every_ms: int | None = None,
        time_zone: str = "UTC",
        args: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
        actor: str,
        reason: str | None = None,
    ) -> ControlAction:
        """Create a stored schedule run by a registered handler (``scheduler.handler(...)``).

        Raises:
            ScheduleControlError: The name exists, or no running replica registers ``handler``.
            InvalidScheduleError: A bad expression, zone or option.
        """
        definition = _Definition(handler, cron, every_ms, time_zone, args, options)
        return await self._store(ActionKind.CREATE, name, definition, actor, reason)

    async def update(
        self,
        name: str,
        *,
        handler: str,
        cron: str | None = None,
        every_ms: int | None = None,
        time_zone: str = "UTC",
        args: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
        actor: str,
        reason: str | None = None,
    ) -> ControlAction:
        """Replace a stored schedule's definition; replicas follow within seconds.

        Raises:
            ScheduleControlError: Not a stored schedule, or no replica registers ``handler``.
            InvalidScheduleError: A bad expression, zone or option.
        """
        definition = _Definition(handler, cron, every_ms, time_zone, args, options)
        return await self._store(ActionKind.UPDATE, name, definition, actor, reason)

    async def _store(
        self, kind: ActionKind, name: str, definition: _Definition, actor: str, reason: str | None
    ) -> ControlAction:
        handler, cron, every_ms, time_zone, args, options = definition
        who = _text("actor", actor, MAX_ACTOR, optional=False)
        why = _text("reason", reason, MAX_REASON, optional=True)
        check_name(name)
        check_name(handler)
        if (cron is None) == (every_ms is None):
            raise ScheduleControlError(name, "give exactly one of cron or every_ms")
        opts = dict(options or {})
        unknown = sorted(set(opts) - KNOWN_OPTIONS)
        if unknown:
            raise ScheduleControlError(name, f"unknown option(s): {', '.join(unknown)}")
        policy = build_policy(name, opts, has_jobs=True, default_lease_ms=300_000)
        if cron is not None:
            expression, schedule_kind = cron, ScheduleKind.CRON.value
        else:
            expression, schedule_kind = str(every_ms), ScheduleKind.INTERVAL.value
            if isinstance(every_ms, bool) or not isinstance(every_ms, int):
                raise ScheduleControlError(name, "every_ms must be an int")
        row_trigger(name, schedule_kind, expression, time_zone)
        arguments = dict(args or {})
        try:
            encoded = json.dumps(arguments)
        except (TypeError, ValueError) as exc:
            raise ScheduleControlError(name, f"args must be JSON: {exc}") from None
        if len(encoded) > MAX_ARGS_BYTES:
            raise ScheduleControlError(name, f"args must encode to at most {MAX_ARGS_BYTES} bytes")
        existing = await self.store.row(name)
        live = existing is not None and existing.removed_at is None
        if kind is ActionKind.CREATE and live:
            assert existing is not None  # noqa: S101
            raise ScheduleControlError(
                name, f"a {existing.origin} schedule with this name exists; nothing changed"
            )
        if kind is ActionKind.UPDATE and (
            not live or existing is None or existing.origin != "stored"
        ):
            raise ScheduleControlError(name, "no stored schedule with this name; nothing changed")
        if existing is not None and existing.origin == "code":
            raise ScheduleControlError(name, "a code-declared schedule has this name")
        if handler not in await self.store.live_handlers():
            raise ScheduleControlError(
                name, f"no running replica registers a handler named {handler!r}; nothing changed"
            )
        recorded = policy_options(policy)
        declared = Declared(
            name=name,
            kind=schedule_kind,
            expression=expression,
            time_zone=time_zone,
            options=recorded,
            fingerprint=fingerprint(
                schedule_kind, expression, time_zone, recorded, handler, arguments
            ),
        )
        assert who is not None  # noqa: S101
        params = {
            "handler": handler,
            "kind": schedule_kind,
            "expression": expression,
            "time_zone": time_zone,
        }
        return await self._write(
            Write(
                name=name,
                action=kind,
                actor=who,
                reason=why,
                params=params,
                stored=declared,
                handler=handler,
                args=arguments,
            )
        )

    async def remove(self, name: str, *, actor: str, reason: str | None = None) -> ControlAction:
        """Remove a stored schedule; every replica stops it within seconds.

        Raises:
            ScheduleControlError: Unknown, or declared in code (remove it from the code instead).
        """
        who = _text("actor", actor, MAX_ACTOR, optional=False)
        why = _text("reason", reason, MAX_REASON, optional=True)
        row = await self._known(name, declared=False)
        if row.origin != "stored":
            raise ScheduleControlError(
                row.name, "declared in code: remove it from the code; nothing changed"
            )
        assert who is not None  # noqa: S101
        return await self._write(
            Write(name=row.name, action=ActionKind.REMOVE, actor=who, reason=why)
        )

    async def list_schedules(self) -> list[ScheduleState]:
        """Every schedule: paused state, next fire time, last run and outcome, replicas."""
        states = await self.store.states()
        now = self._clock()
        out = []
        for state in states:
            upcoming = None
            try:
                trigger = row_trigger(state.name, state.kind, state.expression, state.time_zone)
            except InvalidScheduleError:
                trigger = None
            if trigger is not None and not state.paused:
                upcoming = trigger.next_after(now)
            out.append(_with_next(state, upcoming))
        return out

    async def history(self, name: str, *, limit: int = 50) -> list[RunRecord]:
        """Runs of one schedule, newest first.

        Raises:
            ScheduleControlError: Unknown schedule or a bad limit.
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10_000:
            raise ScheduleControlError(None, "limit must be an int between 1 and 10000")
        row = await self._known(name, declared=False)
        return await self.store.history(row.name, limit)

    async def actions(self, name: str, *, limit: int = 50) -> list[ControlAction]:
        """The control-action log of one schedule (who/why/when, progress), newest first."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10_000:
            raise ScheduleControlError(None, "limit must be an int between 1 and 10000")
        if not isinstance(name, str):
            raise ScheduleControlError(None, "schedule name must be a str")
        if await self.store.row(name) is None:
            raise ScheduleControlError(name, "no such schedule")
        return await self.store.actions(name, limit)

    async def action(self, action_id: int) -> ControlAction:
        """One action by id (a backfill's progress).

        Raises:
            ScheduleControlError: No such action.
        """
        found = await self.store.action(action_id)
        if found is None:
            raise ScheduleControlError(None, f"no action with id {action_id}")
        return found

    async def prune(self, older_than: timedelta, *, batch_size: int = 10_000) -> int:
        """Delete history runs and finished actions older than ``older_than``; return the count."""
        if not isinstance(older_than, timedelta) or older_than <= timedelta(0):
            raise ScheduleControlError(None, "older_than must be a positive timedelta")
        return await self.store.prune(self._clock() - older_than, batch_size)


def _with_next(state: ScheduleState, upcoming: datetime | None) -> ScheduleState:
    return replace(state, next_fire_at=upcoming)
