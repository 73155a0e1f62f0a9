"""The operator's control plane: schedules in the database, pause/resume, trigger, backfill.

Types shared by the stores (PostgreSQL, in-memory), the operator API
:class:`~sdcore.scheduling.ScheduleAdmin` (``_admin.py``) and the per-replica engine
:class:`~sdcore.scheduling.ScheduleControl` (``_plane.py``).

Lease keys (every action keeps each tick exactly once through the lease table):

- a regular tick, catch-up, a resumed schedule's catch-up and every backfilled tick use the tick's
  own run key (``2026-12-01T08:00:00Z``): one row per tick, whoever starts it;
- ``trigger`` runs under the run key ``trigger:<action id>``, which can never equal a tick's
  (tick keys are ISO instants and start with a digit);
- a backfill is coordinated by one replica holding the lease ``backfill:<action id>``; if that
  replica dies another one takes the lease over after ``lease_ms`` and continues, ticks already
  done being refused by their own rows; with ``rerun_succeeded`` a tick that had succeeded before
  the request runs again under ``backfill:<action id>:<tick's run key>``, once per backfill.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from sdcore.scheduling._cron import (
    CronSpec,
    DayRule,
    InvalidScheduleError,
    SchedulingError,
    load_zone,
)
from sdcore.scheduling._policy import (
    MAX_PERIOD_MS,
    RunPolicy,
    check_ms,
)
from sdcore.scheduling._triggers import (
    IntervalTrigger,
    ScheduleKind,
    Trigger,
    cron_trigger,
)

__all__ = [
    "ActionKind",
    "Changes",
    "ControlAction",
    "ControlWriteUncertainError",
    "Declared",
    "LiveVersion",
    "MemberRow",
    "Replica",
    "RunRecord",
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


class ControlWriteUncertainError(SchedulingError, ConnectionError):
    """The connection broke while a control write was committing: it may have been recorded.

    Look at the schedule's action log (``sdcore schedules log NAME``); a trigger or backfill
    retried with the same ``request_id`` is recorded at most once.

    Attributes:
        schedule: The schedule written.
        action: What was being recorded.
        request_id: The write's request id, if any.
    """

    def __init__(self, schedule: str, action: ActionKind, request_id: str | None) -> None:
        self.schedule = schedule
        self.action = action
        self.request_id = request_id
        super().__init__(
            f"schedule {schedule!r}: the connection broke while the {action.value} was being "
            f"committed: the action may have been recorded; see `sdcore schedules log {schedule}`"
        )


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
    day_rule: str = DayRule.VIXIE.value

    def definition(self) -> dict[str, Any]:
        """What the declarations record of it, so that ``list`` can show every live version."""
        return {
            "kind": self.kind,
            "expression": self.expression,
            "time_zone": self.time_zone,
            "day_rule": self.day_rule,
            "options": dict(self.options),
        }


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
    day_rule: str = DayRule.VIXIE.value


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlAction:
    """An entry of the control-action log.

    Attributes:
        id: Its id (also the number in ``trigger:<id>`` / ``backfill:<id>``).
        schedule: The schedule.
        action: What was done.
        actor: Who did it.
        reason: Why (free text), if given.
        params: The action's parameters (a backfill's window, concurrency and
            ``rerun_succeeded``).
        progress: A backfill's progress: ``total``, ``succeeded`` (ticks with ``SUCCESS``,
            those that already had it included), ``failed``, ``remaining``, and
            ``already_succeeded`` (had succeeded before the request and were not re-run) or,
            with ``rerun_succeeded``, ``rerun`` (had succeeded and are run again).
        outcome: ``"done"``, ``"SUCCESS"``/``"FAIL"`` (trigger, backfill), ``"CANCELLED"`` (a
            trigger or backfill still open when its stored schedule was removed), ``None`` while
            open.
        created_at: When it was requested (database clock).
        finished_at: When it finished (``None``: a trigger or backfill still open).
        request_id: The client's request id of a trigger or backfill (a retry with the same
            id gets this action back), or ``None``.
        replayed: ``True`` when a write returned this action because its request id had
            already recorded it (a retry, a resubmitted form): nothing new was recorded, and it
            may have finished long ago.
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
    request_id: str | None = None
    replayed: bool = False


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
class LiveVersion:
    """One definition of a schedule that live replicas run (several during a rolling deploy).

    Attributes:
        fingerprint: The definition's fingerprint.
        kind: ``cron`` or ``interval`` (``None``: declared by a replica of an sdcore that does
            not record definitions).
        expression: The cron expression or the interval in ms.
        time_zone: Its zone.
        day_rule: How its day fields combine (cron).
        options: Its run options.
        replicas: ``host:pid`` of each live replica that runs this definition.
        next_fire_at: When this definition fires next (set by ``ScheduleAdmin.list_schedules``).
    """

    fingerprint: str
    kind: str | None
    expression: str | None
    time_zone: str | None
    day_rule: str | None
    options: Mapping[str, Any] | None
    replicas: tuple[str, ...]
    next_fire_at: datetime | None = None


def live_version(fp: str, definition: Any, replicas: Sequence[str]) -> LiveVersion:
    """A live version from a declaration's recorded definition (``None``: not recorded)."""
    d = definition if isinstance(definition, Mapping) else {}
    options = d.get("options")
    return LiveVersion(
        fingerprint=fp,
        kind=d.get("kind"),
        expression=d.get("expression"),
        time_zone=d.get("time_zone"),
        day_rule=d.get("day_rule"),
        options=options if isinstance(options, Mapping) else None,
        replicas=tuple(replicas),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleState:
    """A schedule as ``sdcore schedules list`` shows it.

    ``live_versions`` holds each definition live replicas declare, with its replicas: more than
    one while a rolling deploy changes the schedule.

    ``version`` changes with every change of the schedule (pause, resume, update): give it to
    ``ScheduleAdmin.update(expected_version=...)`` to refuse an edit of what changed since.
    """

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
    day_rule: str = DayRule.VIXIE.value
    live_versions: tuple[LiveVersion, ...] = ()
    version: int = 0

    @property
    def undeclared(self) -> bool:
        """A code schedule no live replica declares (dropped from the code, or none running)."""
        return self.origin == "code" and not self.replicas


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
class Changes:
    """What :meth:`ScheduleStore.changes` reads: enough to tell whether a poll has anything to
    read.

    Attributes:
        revision: The newest revision of any row (0: no row).
        actions_open: Whether any trigger or backfill action is unfinished.
    """

    revision: int
    actions_open: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class MemberRow:
    """A live replica as :meth:`ScheduleStore.members` reads it."""

    replica_id: str
    digest: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunFinish:
    """What the history records when a run ends.

    ``lease_id``: the lease row of the run (exclusive schedules). A row whose fencing token has
    moved past the run's by then was taken over: the run is recorded as abandoned, whatever its
    handler returned (the takeover's own start may not be written yet).
    """

    run_id: int
    status: str
    error: str | None
    lease_id: str | None = None


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
    request_id: str | None = None
    expected_revision: int | None = None
    """An update's condition: the stored row is still at this revision (what it was merged
    from). A create's condition is that no live row has the name."""

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

    async def declare(
        self,
        replica: Replica,
        name: str,
        fingerprint: str | None,
        definition: Mapping[str, Any] | None = None,
    ) -> None:
        """Add (``fingerprint``, with its ``definition``) or drop (``None``) one declaration."""
        ...

    async def heartbeat(self, replica: Replica) -> bool:
        """Mark the replica alive; ``False`` if its row was expired (sync again)."""
        ...

    async def members(self, replica: Replica, digest: str, ttl_ms: int) -> list[MemberRow] | None:
        """The heartbeat of a replica that reads its peers: mark ``replica`` alive (as
        :meth:`heartbeat`) and record ``digest`` (of the names it declares) on its row; return
        the replicas seen within ``ttl_ms`` before this call, with their digests (this replica
        absent when it was not seen within ``ttl_ms`` or was forgotten: sync again; its digest
        may be its previous one), or ``None`` when the store keeps no digests (a migration
        pending): every replica asks, and nothing was marked."""
        ...

    async def declared_versions(self, digest: str) -> dict[str, str]:
        """The schedules declared by the replica last seen with ``digest``, each with the
        fingerprint of its definition there (empty: no replica has that digest)."""
        ...

    async def leave(self, replica: Replica) -> None:
        """Forget the replica and its declarations, and notify the listeners (the others read
        the live replicas again at once)."""
        ...

    async def revision(self) -> int:
        """The newest revision of any row."""
        ...

    async def changes(self) -> Changes:
        """The newest revision and whether any action is open: a poll reads rows and actions
        only when these say there is something to read (one cheap statement otherwise)."""
        ...

    async def rows(self, since: int | None) -> list[ScheduleRow]:
        """Rows changed after revision ``since`` (removed ones too), or (``None``) every live
        row that is paused or stored, or was resumed within the longest catch-up window
        (``MAX_WINDOW_MS``, by the store's clock)."""
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
        """Apply one control write atomically; ``None`` when its row condition failed.

        A write with a ``request_id`` that an action of the schedule already carries records
        nothing and returns that action.

        Raises:
            ControlWriteUncertainError: The connection broke while the write committed.
        """
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

    async def action_of_request(self, name: str, request_id: str) -> ControlAction | None:
        """The action ``request_id`` already recorded for schedule ``name``, if any."""
        ...

    async def succeeded_before(self, lock_keys: Sequence[str], before: datetime) -> set[str]:
        """The ticks among ``lock_keys`` whose row was ``SUCCESS`` before ``before`` (backfill:
        what had succeeded when it was requested)."""
        ...

    async def runs_started(self, runs: Sequence[RunStart]) -> list[int]:
        """Record run starts in one statement; their history ids, in the order of ``runs``.

        A run under a newer fencing token than another attempt of its tick still ``RUNNING``
        (recorded earlier, or earlier in ``runs``) closes that attempt as abandoned.
        """
        ...

    async def runs_finished(self, runs: Sequence[RunFinish]) -> None:
        """Record runs' ends in one statement (a run no longer ``RUNNING`` is left as it is)."""
        ...

    async def run_started(self, run: RunStart) -> int:
        """Record one run start (:meth:`runs_started` of one run); return its history id."""
        ...

    async def run_finished(self, run_id: int, status: str, error: str | None) -> None:
        """Record one run's end (:meth:`runs_finished` of one run)."""
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
    """A policy as the JSON options recorded with a schedule.

    ``max_runtime_ms`` is recorded only when set: the fingerprints of schedules without it stay
    those that replicas of earlier versions compute.
    """
    options = {
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
    if policy.max_runtime_ms is not None:
        options["max_runtime_ms"] = policy.max_runtime_ms
    return options


def fingerprint(
    kind: str,
    expression: str,
    time_zone: str,
    options: Mapping[str, Any],
    handler: str | None = None,
    args: Mapping[str, Any] | None = None,
    day_rule: str = DayRule.VIXIE.value,
) -> str:
    """SHA-256 (hex, 32 chars) of a schedule's definition: equal on replicas of one version.

    The day rule counts only when it is not the default, so the fingerprints of every schedule
    recorded before the rule was (all of them Vixie) stay what they were.
    """
    parts: list[Any] = [kind, expression, time_zone, dict(options), handler, args]
    if day_rule != DayRule.VIXIE.value:
        parts.append(day_rule)
    text = json.dumps(
        parts,
        sort_keys=True,
        separators=(",", ":"),
        default=str,
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def row_trigger(
    name: str,
    kind: str,
    expression: str,
    time_zone: str,
    day_rule: str = DayRule.VIXIE.value,
) -> Trigger | None:
    """The trigger of a recorded cron or interval schedule (``None`` for other kinds).

    The zone is checked for intervals too: it is the zone of their ticks' ``local_time``.

    Raises:
        InvalidScheduleError: A bad expression, zone or day rule.
    """
    if kind == ScheduleKind.CRON.value:
        zone = load_zone(time_zone, name)
        return cron_trigger(CronSpec.parse(expression, zone, name, day_rule=day_rule))
    if kind == ScheduleKind.INTERVAL.value:
        load_zone(time_zone, name)
        try:
            every = int(expression)
        except ValueError:
            raise InvalidScheduleError(name, f"bad interval {expression!r}") from None
        return IntervalTrigger(check_ms(name, "every_ms", every, minimum=1, maximum=MAX_PERIOD_MS))
    return None
