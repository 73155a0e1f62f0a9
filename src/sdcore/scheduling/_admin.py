"""``ScheduleAdmin``: the operator API of the control plane (see ``_control.py`` for its types).

Every input is validated before anything is written: a refused action changes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from sdcore._internal.validation import (
    ErrorFactory,
    boolean,
    int_between,
    integer,
    positive_timedelta,
)
from sdcore.job_scheduler import DEFAULT_HEARTBEAT_MS
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
from sdcore.scheduling._cron import DayRule, InvalidScheduleError
from sdcore.scheduling._policy import KNOWN_OPTIONS, build_policy, check_name
from sdcore.scheduling._runner import utcnow
from sdcore.scheduling._triggers import ScheduleKind, Trigger, expected_instants

__all__ = ["ScheduleAdmin"]

# The first instant a backfill window may start at: computing ticks looks a little before the
# window, and Python's datetimes end at 0001-01-01T00:00:00.
EARLIEST = datetime(1, 1, 2, tzinfo=UTC)
MAX_REQUEST_ID = 200


class _Definition(NamedTuple):
    """What ``create`` and ``update`` are given about a stored schedule."""

    handler: str
    cron: str | None
    every_ms: int | None
    time_zone: str
    args: Mapping[str, Any] | None
    options: Mapping[str, Any] | None


def _refused(schedule: str | None = None) -> ErrorFactory:
    """Word a refused argument as a :class:`ScheduleControlError` about ``schedule``."""
    return lambda refusal: ScheduleControlError(schedule, refusal.message)


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
            or :class:`~sdcore.testing.MemoryScheduleStore`).
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
        return self._same_request(write, action)

    async def _earlier(self, write: Write) -> ControlAction | None:
        """The action a retried request already recorded (checked before whether a replica is
        live now: the retry of a lost reply comes when the database is back, possibly before
        the replicas are)."""
        if write.request_id is None:
            return None
        found = await self.store.action_of_request(write.name, write.request_id)
        return None if found is None else self._same_request(write, found)

    @staticmethod
    def _same_request(write: Write, action: ControlAction) -> ControlAction:
        if write.request_id is not None and (
            action.action is not write.action or dict(action.params) != dict(write.params)
        ):
            # The same request id names the same request: a different one reusing it is a
            # client's mistake, not a retry.
            raise ScheduleControlError(
                write.name,
                f"request id {write.request_id!r} already recorded action {action.id} (a "
                f"{action.action.value} with other parameters); use a new request id; "
                "nothing changed",
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

    async def _runnable(
        self, name: str, done: str, *, declared: bool = True
    ) -> tuple[ScheduleRow, Trigger]:
        """The row and trigger of a schedule that can be ``done`` (triggered, backfilled)."""
        row = await self._known(name, declared=declared)
        trigger = row_trigger(row.name, row.kind, row.expression, row.time_zone, row.day_rule)
        if trigger is None:
            raise ScheduleControlError(
                row.name, f"a {row.kind} schedule cannot be {done}; nothing changed"
            )
        if row.origin != "stored" and not row.options.get("exclusive", False):
            raise ScheduleControlError(
                row.name,
                f"only exclusive schedules (run on one replica) can be {done}; nothing changed",
            )
        return row, trigger

    async def trigger(
        self,
        name: str,
        *,
        actor: str,
        reason: str | None = None,
        request_id: str | None = None,
    ) -> ControlAction:
        """Run a schedule once now on exactly one replica, even while paused.

        Its run key is ``trigger:<action id>``.

        Args:
            name: The schedule.
            actor: Who asks (recorded).
            reason: Why (recorded).
            request_id: The client's id of this request (1-200 characters): a retry with the
                same id (after a lost reply, a double submit) returns the action the first one
                recorded instead of running the schedule again.

        Raises:
            ScheduleControlError: Unknown, undeclared, not exclusive, not cron/interval, or a
                request id already used for another action.
            ControlWriteUncertainError: The connection broke while the action was committing.
        """
        who = _text("actor", actor, MAX_ACTOR, optional=False)
        why = _text("reason", reason, MAX_REASON, optional=True)
        request = _text("request_id", request_id, MAX_REQUEST_ID, optional=True)
        row, _ = await self._runnable(name, "triggered", declared=False)
        assert who is not None  # noqa: S101
        write = Write(
            name=row.name, action=ActionKind.TRIGGER, actor=who, reason=why, request_id=request
        )
        earlier = await self._earlier(write)
        if earlier is not None:
            return earlier
        await self._runnable(name, "triggered")
        return await self._write(write)

    async def backfill(
        self,
        name: str,
        start: datetime,
        end: datetime,
        *,
        actor: str,
        reason: str | None = None,
        concurrency: int = 1,
        request_id: str | None = None,
        rerun_succeeded: bool = False,
    ) -> ControlAction:
        """Run every expected tick in ``[start, end]`` (both inclusive) without ``SUCCESS``.

        One replica coordinates, oldest tick first, at most ``concurrency`` at once (1 unless the
        schedule's overlap is ``allow``); progress is in the action's ``progress`` (ticks that
        had already succeeded are counted as ``already_succeeded``). With ``rerun_succeeded``
        those ticks run again too, once per backfill, under the run key
        ``backfill:<action id>:<tick's run key>`` (the tick's own row stays as it is). A
        ``request_id`` makes a retry of the same request return the first one's action (see
        :meth:`trigger`).

        Raises:
            ScheduleControlError: Unknown or undeclared schedule, unaware or reversed bounds, a
                window in the future, no tick in it, more than 10,000 ticks, or a request id
                already used for another action.
            ControlWriteUncertainError: The connection broke while the action was committing.
        """
        who = _text("actor", actor, MAX_ACTOR, optional=False)
        why = _text("reason", reason, MAX_REASON, optional=True)
        request = _text("request_id", request_id, MAX_REQUEST_ID, optional=True)
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
        int_between("concurrency", concurrency, 1, MAX_BACKFILL_CONCURRENCY, error=_refused())
        boolean("rerun_succeeded", rerun_succeeded, error=_refused())
        if low < EARLIEST:
            raise ScheduleControlError(
                None,
                f"--from {low.isoformat()} is out of range: the window must start at "
                f"{EARLIEST:%Y-%m-%dT%H:%M:%SZ} or later",
            )
        row, trigger = await self._runnable(name, "backfilled", declared=False)
        try:
            ticks = expected_instants(
                trigger, low, high + timedelta(microseconds=1), limit=MAX_RANGE_TICKS
            )
        except (ValueError, OverflowError) as exc:
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
        if rerun_succeeded:
            params["rerun_succeeded"] = True
        write = Write(
            name=row.name,
            action=ActionKind.BACKFILL,
            actor=who,
            reason=why,
            params=params,
            request_id=request,
        )
        earlier = await self._earlier(write)
        if earlier is not None:
            return earlier
        await self._runnable(name, "backfilled")
        return await self._write(write)

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
        handler: str | None = None,
        cron: str | None = None,
        every_ms: int | None = None,
        time_zone: str | None = None,
        args: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
        expected_version: int | None = None,
        actor: str,
        reason: str | None = None,
    ) -> ControlAction:
        """Change the given fields of a stored schedule; replicas follow within seconds.

        Fields left ``None`` keep their values: ``cron`` or ``every_ms`` replaces the timing
        (and the kind), ``args`` replaces the whole arguments object, ``options`` changes the
        options it names and keeps the others.

        Args:
            expected_version: The schedule's ``version`` (``list_schedules``) the change was
                made from: refused when the schedule changed since.

        Raises:
            ScheduleControlError: Not a stored schedule, a stale ``expected_version``, a change
                meanwhile, or no replica registers the handler.
            InvalidScheduleError: A bad expression, zone or option.
        """
        if not isinstance(name, str):
            raise ScheduleControlError(None, f"schedule name must be a str, got {name!r:.60}")
        if expected_version is not None:
            integer("expected_version", expected_version, error=_refused(name))
        if cron is not None and every_ms is not None:
            raise ScheduleControlError(name, "give at most one of cron or every_ms")
        given = (handler, cron, every_ms, time_zone, args)
        if all(value is None for value in given) and not options:
            raise ScheduleControlError(
                name, "give at least one field to change (handler, timing, zone, args, option)"
            )
        row = await self.store.row(name)
        if row is None or row.removed_at is not None or row.origin != "stored":
            raise ScheduleControlError(name, "no stored schedule with this name; nothing changed")
        if expected_version is not None and expected_version != row.revision:
            raise ScheduleControlError(
                name,
                f"version {expected_version} is stale: the schedule is at version "
                f"{row.revision} (see `sdcore schedules log {name}`); nothing changed",
            )
        if cron is None and every_ms is None:
            if row.kind == ScheduleKind.CRON.value:
                cron = row.expression
            else:
                every_ms = int(row.expression)
        kept = {k: v for k, v in row.options.items() if k in KNOWN_OPTIONS}
        # A row an older version wrote may say exclusive=false; replicas run it exclusive
        # anyway, and a patch records what runs rather than refusing what it did not give.
        kept.pop("exclusive", None)
        patch = dict(options or {})
        if "lease_ms" in patch and "heartbeat_ms" not in patch:
            # The row records the heartbeat create derived from the lease when none was given:
            # a new lease derives it again (a heartbeat chosen apart from it stays).
            old_lease = kept.get("lease_ms")
            if isinstance(old_lease, int) and kept.get("heartbeat_ms") == min(
                DEFAULT_HEARTBEAT_MS, old_lease // 3
            ):
                kept.pop("heartbeat_ms")
        definition = _Definition(
            handler if handler is not None else (row.handler or ""),
            cron,
            every_ms,
            time_zone if time_zone is not None else row.time_zone,
            args if args is not None else row.args,
            {**kept, **patch},
        )
        return await self._store(ActionKind.UPDATE, name, definition, actor, reason, previous=row)

    async def _store(
        self,
        kind: ActionKind,
        name: str,
        definition: _Definition,
        actor: str,
        reason: str | None,
        *,
        previous: ScheduleRow | None = None,
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
        # A stored schedule runs on every replica that registers its handler: only the lease
        # keeps each tick to one of them, so it cannot be anything but exclusive.
        if opts.setdefault("exclusive", True) is not True:
            raise ScheduleControlError(
                name,
                f"exclusive={opts['exclusive']!r:.20} is refused: stored schedules are always "
                "exclusive (each tick runs on one replica); drop the option",
            )
        policy = build_policy(name, opts, has_jobs=True, default_lease_ms=300_000)
        if cron is not None:
            expression, schedule_kind = cron, ScheduleKind.CRON.value
        else:
            expression, schedule_kind = str(every_ms), ScheduleKind.INTERVAL.value
            integer("every_ms", every_ms, error=_refused(name))
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
        # A code schedule no live replica declares (dropped from the code) does not hold its
        # name: a create takes the row over.
        undeclared = (
            live
            and existing is not None
            and existing.origin == "code"
            and not await self.store.live_declarers(name)
        )
        if kind is ActionKind.CREATE and live and not undeclared:
            assert existing is not None  # noqa: S101
            raise ScheduleControlError(
                name, f"a {existing.origin} schedule with this name exists; nothing changed"
            )
        if kind is ActionKind.UPDATE and (
            not live or existing is None or existing.origin != "stored"
        ):
            raise ScheduleControlError(name, "no stored schedule with this name; nothing changed")
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
        params: dict[str, Any] = {
            "handler": handler,
            "kind": schedule_kind,
            "expression": expression,
            "time_zone": time_zone,
            "args": arguments,
            "options": recorded,
        }
        if previous is not None:
            params["previous"] = {
                "handler": previous.handler,
                "kind": previous.kind,
                "expression": previous.expression,
                "time_zone": previous.time_zone,
                "args": dict(previous.args or {}),
                "options": dict(previous.options),
                "version": previous.revision,
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
                expected_revision=None if previous is None else previous.revision,
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
        if row.origin != "stored" and await self.store.live_declarers(row.name):
            raise ScheduleControlError(
                row.name,
                "declared in code by a running replica: remove it from the code; nothing changed",
            )
        assert who is not None  # noqa: S101
        return await self._write(
            Write(name=row.name, action=ActionKind.REMOVE, actor=who, reason=why)
        )

    async def list_schedules(self) -> list[ScheduleState]:
        """Every schedule: paused state, next fire time, last run and outcome, replicas.

        A code schedule no live replica declares is ``undeclared`` and has no next fire time.
        Each live version (``live_versions``) has its own next fire time.
        """
        states = await self.store.states()
        now = self._clock()
        out = []
        for state in states:
            upcoming = None
            if not state.paused and not state.undeclared:
                upcoming = _next_fire(
                    state.name, state.kind, state.expression, state.time_zone, state.day_rule, now
                )
            versions = tuple(
                replace(
                    v,
                    next_fire_at=None
                    if state.paused or v.kind is None or v.expression is None
                    else _next_fire(
                        state.name,
                        v.kind,
                        v.expression,
                        v.time_zone or "UTC",
                        v.day_rule or DayRule.VIXIE.value,
                        now,
                    ),
                )
                for v in state.live_versions
            )
            out.append(replace(_with_next(state, upcoming), live_versions=versions))
        return out

    async def history(self, name: str, *, limit: int = 50) -> list[RunRecord]:
        """Runs of one schedule, newest first (a removed stored schedule's runs too).

        Raises:
            ScheduleControlError: Unknown schedule or a bad limit.
        """
        int_between("limit", limit, 1, 10_000, error=_refused())
        if not isinstance(name, str):
            raise ScheduleControlError(None, f"schedule name must be a str, got {name!r:.60}")
        if await self.store.row(name) is None:
            raise ScheduleControlError(name, "no such schedule (see `sdcore schedules list`)")
        return await self.store.history(name, limit)

    async def actions(self, name: str, *, limit: int = 50) -> list[ControlAction]:
        """The control-action log of one schedule (who/why/when, progress), newest first."""
        int_between("limit", limit, 1, 10_000, error=_refused())
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
        positive_timedelta("older_than", older_than, error=_refused())
        return await self.store.prune(self._clock() - older_than, batch_size)


def _next_fire(
    name: str, kind: str, expression: str, time_zone: str, day_rule: str, now: datetime
) -> datetime | None:
    try:
        trigger = row_trigger(name, kind, expression, time_zone, day_rule)
    except InvalidScheduleError:
        return None
    return None if trigger is None else trigger.next_after(now)


def _with_next(state: ScheduleState, upcoming: datetime | None) -> ScheduleState:
    return replace(state, next_fire_at=upcoming)
