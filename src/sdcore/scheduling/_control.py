"""The operator's control plane: schedules in the database, pause/resume, trigger, backfill.

Types shared by the stores (PostgreSQL, in-memory), the operator API :class:`ScheduleAdmin` and
the per-replica engine :class:`~sdcore.scheduling.ScheduleControl`.

Lease keys (every action keeps each tick exactly once through the lease table):

- a regular tick, catch-up, a resumed schedule's catch-up and every backfilled tick use the tick's
  own run key (``2026-12-01T08:00:00Z``): one row per tick, whoever starts it;
- ``trigger`` runs under the run key ``trigger:<action id>``, which can never equal a tick's
  (tick keys are ISO instants and start with a digit);
- a backfill is coordinated by one replica holding the lease ``backfill:<action id>``; if that
  replica dies another one takes the lease over after ``lease_ms`` and continues, ticks already
  done being refused by their own rows.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from sdcore.scheduling._catch_up import MAX_RANGE_TICKS
from sdcore.scheduling._cron import CronSpec, InvalidScheduleError, SchedulingError, load_zone
from sdcore.scheduling._policy import (
    KNOWN_OPTIONS,
    MAX_PERIOD_MS,
    RunPolicy,
    build_policy,
    check_ms,
    check_name,
)
from sdcore.scheduling._triggers import (
    CronTrigger,
    IntervalTrigger,
    ScheduleKind,
    Trigger,
    expected_instants,
)

__all__ = [
    "ActionKind",
    "ControlAction",
    "Declared",
    "Replica",
    "RunRecord",
    "ScheduleAdmin",
    "ScheduleControlError",
    "ScheduleRow",
    "ScheduleState",
    "ScheduleStore",
]

TRIGGER_PREFIX = "trigger:"
BACKFILL_PREFIX = "backfill:"
MAX_ACTOR = 200
MAX_REASON = 1_000
MAX_BACKFILL_CONCURRENCY = 32
MAX_ARGS_BYTES = 64_000
DEFAULT_LIVE_MS = 30_000


class ActionKind(enum.StrEnum):
    """What an operator did."""

    PAUSE = "pause"
    RESUME = "resume"
    TRIGGER = "trigger"
    BACKFILL = "backfill"
    CREATE = "create"
    UPDATE = "update"
    REMOVE = "remove"


class ScheduleControlError(SchedulingError, ValueError):
    """A control action was refused; nothing was changed.

    Attributes:
        schedule: The schedule named, if any.
        problem: What is wrong, for people.
    """

    def __init__(self, schedule: str | None, problem: str) -> None:
        self.schedule = schedule
        self.problem = problem
        where = f"schedule {schedule!r}: " if schedule is not None else ""
        super().__init__(where + problem)


@dataclass(frozen=True, slots=True, kw_only=True)
class Replica:
    """One process running schedules (for the declarations and the run history)."""

    replica_id: str
    host: str
    pid: int
    handlers: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Declared:
    """A code-declared schedule as a replica syncs it."""

    name: str
    kind: str
    expression: str
    time_zone: str
    options: Mapping[str, Any]
    fingerprint: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleRow:
    """A row of the schedules table."""

    name: str
    origin: str
    kind: str
    expression: str
    time_zone: str
    options: Mapping[str, Any]
    handler: str | None
    args: Mapping[str, Any] | None
    fingerprint: str
    paused: bool
    paused_at: datetime | None
    resumed_at: datetime | None
    removed_at: datetime | None
    revision: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlAction:
    """An entry of the control-action log.

    Attributes:
        id: Its id (also the number in ``trigger:<id>`` / ``backfill:<id>``).
        schedule: The schedule.
        action: What was done.
        actor: Who did it.
        reason: Why (free text), if given.
        params: The action's parameters (a backfill's window and concurrency).
        progress: A backfill's progress (``total``, ``succeeded``, ``failed``, ``remaining``).
        outcome: ``"done"``, ``"SUCCESS"``/``"FAIL"`` (trigger, backfill), ``None`` while open.
        created_at: When it was requested (database clock).
        finished_at: When it finished (``None``: a trigger or backfill still open).
    """

    id: int
    schedule: str
    action: ActionKind
    actor: str
    reason: str | None
    params: Mapping[str, Any]
    progress: Mapping[str, Any] | None
    outcome: str | None
    created_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunRecord:
    """One run of a schedule in its history (one row per attempt)."""

    schedule: str
    run_key: str
    source: str
    scheduled_at: datetime
    started_at: datetime
    finished_at: datetime | None
    status: str
    attempt: int
    fencing_token: int | None
    host: str
    pid: int
    error: str | None

    @property
    def lag(self) -> timedelta:
        """How late the run started after its scheduled instant."""
        return self.started_at - self.scheduled_at

    @property
    def duration(self) -> timedelta | None:
        """How long it ran (``None`` while running)."""
        return None if self.finished_at is None else self.finished_at - self.started_at


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleState:
    """A schedule as ``sdcore schedules list`` shows it."""

    name: str
    origin: str
    kind: str
    expression: str
    time_zone: str
    paused: bool
    paused_at: datetime | None
    paused_by: str | None
    paused_reason: str | None
    handler: str | None
    args: Mapping[str, Any] | None
    options: Mapping[str, Any]
    replicas: tuple[str, ...]
    versions: int
    last_run_at: datetime | None
    last_status: str | None
    next_fire_at: datetime | None = None
    last_seen_at: datetime | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunStart:
    """What the history records when a run starts."""

    schedule: str
    run_key: str
    source: str
    scheduled_at: datetime
    attempt: int
    fencing_token: int | None
    replica: Replica


@dataclass(frozen=True, slots=True, kw_only=True)
class Write:
    """One control write: an optional row change and the action recorded with it."""

    name: str
    action: ActionKind
    actor: str
    reason: str | None
    params: Mapping[str, Any] = field(default_factory=dict)
    stored: Declared | None = None
    handler: str | None = None
    args: Mapping[str, Any] | None = None

    @property
    def finished(self) -> bool:
        """Whether the action is complete when written (all but trigger and backfill)."""
        return self.action not in (ActionKind.TRIGGER, ActionKind.BACKFILL)


class ScheduleStore(Protocol):
    """Where the control plane keeps its state (PostgreSQL, or in memory for tests)."""

    live_ms: int

    async def sync(self, replica: Replica, declared: Sequence[Declared]) -> list[str]:
        """Upsert the declared schedules and the replica; return names with mixed versions."""
        ...

    async def declare(self, replica: Replica, name: str, fingerprint: str | None) -> None:
        """Add (``fingerprint``) or drop (``None``) one declaration of this replica."""
        ...

    async def heartbeat(self, replica: Replica) -> bool:
        """Mark the replica alive; ``False`` if its row was expired (sync again)."""
        ...

    async def leave(self, replica: Replica) -> None:
        """Forget the replica and its declarations."""
        ...

    async def revision(self) -> int:
        """The newest revision of any row."""
        ...

    async def rows(self, since: int | None) -> list[ScheduleRow]:
        """Rows changed after revision ``since`` (removed ones too), or (``None``) every live
        row that is paused or stored."""
        ...

    async def row(self, name: str) -> ScheduleRow | None:
        """One row (removed ones too)."""
        ...

    async def live_declarers(self, name: str) -> int:
        """How many live replicas declare ``name``."""
        ...

    async def live_handlers(self) -> set[str]:
        """The stored-schedule handler names live replicas register."""
        ...

    async def write(self, write: Write) -> ControlAction | None:
        """Apply one control write atomically; ``None`` when its row condition failed."""
        ...

    async def open_actions(self, names: Sequence[str]) -> list[ControlAction]:
        """Unfinished trigger/backfill actions of these schedules, oldest first."""
        ...

    async def action(self, action_id: int) -> ControlAction | None:
        """One action."""
        ...

    async def actions(self, name: str, limit: int) -> list[ControlAction]:
        """The action log of one schedule, newest first."""
        ...

    async def finish_action(
        self, action_id: int, outcome: str, progress: Mapping[str, Any] | None
    ) -> None:
        """Close an open action (no-op when already closed)."""
        ...

    async def set_progress(self, action_id: int, progress: Mapping[str, Any]) -> None:
        """Record an open action's progress."""
        ...

    async def release_failed(self, lock_keys: Sequence[str], before: datetime, by: str) -> int:
        """Reopen ticks whose row is ``FAIL`` since before ``before`` (backfill)."""
        ...

    async def run_started(self, run: RunStart) -> int | None:
        """Record a run start; return its history id."""
        ...

    async def run_finished(self, run_id: int, status: str, error: str | None) -> None:
        """Record a run's end."""
        ...

    async def history(self, name: str, limit: int) -> list[RunRecord]:
        """Runs of one schedule, newest first."""
        ...

    async def states(self) -> list[ScheduleState]:
        """Every live schedule with its declarations and last run."""
        ...

    async def prune(self, before: datetime, batch: int) -> int:
        """Delete history runs started and actions finished before ``before``."""
        ...


# --- definitions -----------------------------------------------------------------------------


def policy_options(policy: RunPolicy) -> dict[str, Any]:
    """A policy as the JSON options recorded with a schedule."""
    return {
        "exclusive": policy.exclusive,
        "overlap": policy.overlap.value,
        "catch_up": policy.catch_up.value,
        "catch_up_window_ms": policy.catch_up_window_ms,
        "retries": policy.retries,
        "retry_backoff_ms": policy.retry_backoff_ms,
        "jitter_ms": policy.jitter_ms,
        "lease_ms": policy.lease_ms,
        "heartbeat_ms": policy.heartbeat_ms,
    }


def fingerprint(
    kind: str,
    expression: str,
    time_zone: str,
    options: Mapping[str, Any],
    handler: str | None = None,
    args: Mapping[str, Any] | None = None,
) -> str:
    """SHA-256 (hex, 32 chars) of a schedule's definition: equal on replicas of one version."""
    text = json.dumps(
        [kind, expression, time_zone, dict(options), handler, args],
        sort_keys=True,
        separators=(",", ":"),
        default=str,
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def row_trigger(name: str, kind: str, expression: str, time_zone: str) -> Trigger | None:
    """The trigger of a recorded cron or interval schedule (``None`` for other kinds).

    Raises:
        InvalidScheduleError: A bad expression or zone.
    """
    if kind == ScheduleKind.CRON.value:
        return CronTrigger(CronSpec.parse(expression, load_zone(time_zone, name), name))
    if kind == ScheduleKind.INTERVAL.value:
        try:
            every = int(expression)
        except ValueError:
            raise InvalidScheduleError(name, f"bad interval {expression!r}") from None
        return IntervalTrigger(check_ms(name, "every_ms", every, minimum=1, maximum=MAX_PERIOD_MS))
    return None


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
    """

    def __init__(self, store: ScheduleStore) -> None:
        self.store = store

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
        if high > datetime.now(UTC):
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
        return await self._store(
            ActionKind.CREATE,
            name,
            handler,
            cron,
            every_ms,
            time_zone,
            args,
            options,
            actor,
            reason,
        )

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
        return await self._store(
            ActionKind.UPDATE,
            name,
            handler,
            cron,
            every_ms,
            time_zone,
            args,
            options,
            actor,
            reason,
        )

    async def _store(
        self,
        kind: ActionKind,
        name: str,
        handler: str,
        cron: str | None,
        every_ms: int | None,
        time_zone: str,
        args: Mapping[str, Any] | None,
        options: Mapping[str, Any] | None,
        actor: str,
        reason: str | None,
    ) -> ControlAction:
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
        now = datetime.now(UTC)
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
        return await self.store.prune(datetime.now(UTC) - older_than, batch_size)


def _with_next(state: ScheduleState, upcoming: datetime | None) -> ScheduleState:
    from dataclasses import replace

    return replace(state, next_fire_at=upcoming)
