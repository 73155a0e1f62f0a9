"""``MemoryScheduleStore``: the control plane's store in process memory, the twin of
``PostgresScheduleStore`` (public as ``sdcore.testing.MemoryScheduleStore``).

Share one instance (and one :class:`~sdcore.testing.MemoryJobScheduler`) between several
schedulers to test code that pauses, triggers or backfills: it behaves as the PostgreSQL store
does (revisions, open actions, declarations, run history), and notifies every listener at once.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from sdcore.job_scheduler import BaseJobScheduler, JobSchedulerStatus
from sdcore.scheduling._control import (
    DEFAULT_LIVE_MS,
    ActionKind,
    Changes,
    ControlAction,
    Declared,
    MemberRow,
    Replica,
    RunFinish,
    RunRecord,
    RunStart,
    ScheduleRow,
    ScheduleState,
    Write,
    live_version,
)
from sdcore.scheduling._policy import MAX_WINDOW_MS

__all__ = ["MemoryScheduleStore"]


def _now() -> datetime:
    return datetime.now(UTC)


def _definition(row: ScheduleRow) -> dict[str, Any]:
    """A row's definition, as a declaration records it (``Declared.definition``)."""
    return {
        "kind": row.kind,
        "expression": row.expression,
        "time_zone": row.time_zone,
        "day_rule": row.day_rule,
        "options": dict(row.options),
    }


class MemoryScheduleStore:
    """The schedules table, declarations, action log and run history in memory.

    Args:
        jobs: The in-memory job scheduler the replicas share (backfill reopens failed ticks in it).
        live_ms: A replica not seen for this long no longer declares its schedules.
        clock: The "database clock" (aware UTC).
    """

    def __init__(
        self,
        jobs: BaseJobScheduler | None = None,
        *,
        live_ms: int = DEFAULT_LIVE_MS,
        clock: Callable[[], datetime] = _now,
    ) -> None:
        self.jobs = jobs
        self.live_ms = live_ms
        self._clock = clock
        self._seq = itertools.count(1)
        self._rows: dict[str, ScheduleRow] = {}
        self._extra: dict[str, dict[str, Any]] = {}  # paused_by, paused_reason per schedule
        self._replicas: dict[str, tuple[Replica, datetime]] = {}
        self._started: dict[str, datetime] = {}  # replica id -> its first sync
        self._digests: dict[str, str] = {}  # replica id -> digest of its declared names
        self._declarations: dict[tuple[str, str], str] = {}
        self._definitions: dict[tuple[str, str], Mapping[str, Any] | None] = {}
        self._actions: dict[int, ControlAction] = {}
        self._runs: dict[int, RunRecord] = {}
        self._run_ids = itertools.count(1)
        self._listeners: list[Callable[[], None]] = []

    # --- replicas ----------------------------------------------------------------------------

    def _live(self) -> set[str]:
        limit = self._clock() - timedelta(milliseconds=self.live_ms)
        return {rid for rid, (_, seen) in self._replicas.items() if seen >= limit}

    def _forget(self, replica_id: str) -> bool:
        """Drop a replica with its declarations and digest; whether it was known."""
        self._digests.pop(replica_id, None)
        self._started.pop(replica_id, None)
        for key in [k for k in self._declarations if k[1] == replica_id]:
            del self._declarations[key]
            self._definitions.pop(key, None)
        return self._replicas.pop(replica_id, None) is not None

    async def sync(self, replica: Replica, declared: Sequence[Declared]) -> list[str]:
        now = self._clock()
        # As the PostgreSQL store: a replica not seen for ten times live_ms is forgotten (its
        # heartbeat then answers False, and it syncs again as a new start).
        expired = now - timedelta(milliseconds=10 * self.live_ms)
        for rid in [rid for rid, (_, seen) in self._replicas.items() if seen < expired]:
            self._forget(rid)
        for d in declared:
            row = self._rows.get(d.name)
            if row is None or row.removed_at is not None:
                # New, or a removed row taken over: the name is the code's, with none of the
                # old row's state.
                self._rows[d.name] = ScheduleRow(
                    name=d.name,
                    origin="code",
                    kind=d.kind,
                    expression=d.expression,
                    time_zone=d.time_zone,
                    options=dict(d.options),
                    handler=None,
                    args=None,
                    fingerprint=d.fingerprint,
                    paused=False,
                    paused_at=None,
                    resumed_at=None,
                    removed_at=None,
                    revision=0 if row is None else row.revision,
                    day_rule=d.day_rule,
                )
                self._extra.pop(d.name, None)
            elif row.origin == "code" and row.fingerprint != d.fingerprint:
                self._rows[d.name] = replace(
                    row,
                    kind=d.kind,
                    expression=d.expression,
                    time_zone=d.time_zone,
                    options=dict(d.options),
                    fingerprint=d.fingerprint,
                    day_rule=d.day_rule,
                )
        self._replicas[replica.replica_id] = (replica, now)
        self._started.setdefault(replica.replica_id, now)
        for d in declared:
            self._declarations[(d.name, replica.replica_id)] = d.fingerprint
            self._definitions[(d.name, replica.replica_id)] = d.definition()
        live = self._live()
        mixed = []
        for d in declared:
            prints = {
                fp
                for (name, rid), fp in self._declarations.items()
                if name == d.name and rid in live
            }
            if len(prints) > 1:
                mixed.append(d.name)
        return mixed

    async def declare(
        self,
        replica: Replica,
        name: str,
        fingerprint: str | None,
        definition: Mapping[str, Any] | None = None,
    ) -> None:
        key = (name, replica.replica_id)
        if fingerprint is None:
            self._declarations.pop(key, None)
            self._definitions.pop(key, None)
        else:
            # No definition given: the one recorded for this same version stays (as coalesce
            # does in the PostgreSQL statement).
            known = (
                self._definitions.get(key) if self._declarations.get(key) == fingerprint else None
            )
            self._declarations[key] = fingerprint
            self._definitions[key] = known if definition is None else dict(definition)

    async def heartbeat(self, replica: Replica) -> bool:
        if replica.replica_id not in self._replicas:
            return False
        self._replicas[replica.replica_id] = (replica, self._clock())
        return True

    async def members(self, replica: Replica, digest: str, ttl_ms: int) -> list[MemberRow] | None:
        limit = self._clock() - timedelta(milliseconds=ttl_ms)
        rows = [
            MemberRow(replica_id=rid, digest=self._digests.get(rid))
            for rid, (_, seen) in self._replicas.items()
            if seen >= limit
        ]
        known = self._replicas.get(replica.replica_id)
        if known is not None:
            self._digests[replica.replica_id] = digest
            self._replicas[replica.replica_id] = (known[0], self._clock())
        return rows

    async def declared_versions(self, digest: str) -> dict[str, str]:
        holders = [rid for rid, d in self._digests.items() if d == digest and rid in self._replicas]
        if not holders:
            return {}
        rid = max(holders, key=lambda r: self._replicas[r][1])
        return {n: fp for (n, r), fp in self._declarations.items() if r == rid}

    async def leave(self, replica: Replica) -> None:
        if self._forget(replica.replica_id):
            for wake in list(self._listeners):
                wake()

    # --- rows --------------------------------------------------------------------------------

    async def revision(self) -> int:
        return max((r.revision for r in self._rows.values()), default=0)

    async def changes(self) -> Changes:
        return Changes(
            revision=await self.revision(),
            actions_open=any(a.finished_at is None for a in self._actions.values()),
        )

    async def rows(self, since: int | None) -> list[ScheduleRow]:
        if since is None:
            resumed = self._clock() - timedelta(milliseconds=MAX_WINDOW_MS)
            return [
                r
                for r in self._rows.values()
                if r.removed_at is None
                and (
                    r.paused
                    or r.origin == "stored"
                    or (r.resumed_at is not None and r.resumed_at >= resumed)
                )
            ]
        return sorted(
            (r for r in self._rows.values() if r.revision > since), key=lambda r: r.revision
        )

    async def row(self, name: str) -> ScheduleRow | None:
        return self._rows.get(name)

    async def live_declarers(self, name: str) -> int:
        live = self._live()
        return sum(1 for (n, rid) in self._declarations if n == name and rid in live)

    async def live_handlers(self) -> set[str]:
        live = self._live()
        return {h for rid, (rep, _) in self._replicas.items() if rid in live for h in rep.handlers}

    async def write(self, write: Write) -> ControlAction | None:
        row = self._rows.get(write.name)
        now = self._clock()
        if write.request_id is not None:
            for earlier in self._actions.values():
                if earlier.schedule == write.name and earlier.request_id == write.request_id:
                    return replace(earlier, replayed=True)
        if write.action is ActionKind.PAUSE:
            if row is None or row.removed_at is not None or row.paused:
                return None
            self._rows[write.name] = replace(
                row, paused=True, paused_at=now, revision=next(self._seq)
            )
            self._extra[write.name] = {"paused_by": write.actor, "paused_reason": write.reason}
        elif write.action is ActionKind.RESUME:
            if row is None or row.removed_at is not None or not row.paused:
                return None
            self._rows[write.name] = replace(
                row, paused=False, resumed_at=now, revision=next(self._seq)
            )
            self._extra.pop(write.name, None)
        elif write.action is ActionKind.REMOVE:
            if row is None or row.removed_at is not None:
                return None
            if row.origin != "stored" and await self.live_declarers(write.name):
                return None
            self._rows[write.name] = replace(row, removed_at=now, revision=next(self._seq))
        elif write.stored is not None:
            live = row is not None and row.removed_at is None
            if write.action is ActionKind.CREATE:
                # A create takes over only a removed row or a code row no live replica declares.
                if (
                    row is not None
                    and live
                    and (row.origin == "stored" or await self.live_declarers(write.name))
                ):
                    return None  # created meanwhile, or a live code schedule
            elif (
                row is None
                or not live
                or row.origin != "stored"
                or row.revision != write.expected_revision
            ):
                return None  # removed or changed since the update's read
            d = write.stored
            kept = row if live and row is not None and row.origin == "stored" else None
            if kept is None:  # re-created or taken over: no pause history carries over
                self._extra.pop(write.name, None)
            self._rows[write.name] = ScheduleRow(
                name=d.name,
                origin="stored",
                kind=d.kind,
                expression=d.expression,
                time_zone=d.time_zone,
                options=dict(d.options),
                handler=write.handler,
                args=dict(write.args or {}),
                fingerprint=d.fingerprint,
                paused=bool(kept is not None and kept.paused),
                paused_at=None if kept is None else kept.paused_at,
                resumed_at=None if kept is None else kept.resumed_at,
                removed_at=None,
                revision=next(self._seq),
                day_rule=d.day_rule,
            )
        if write.action in (ActionKind.REMOVE, ActionKind.CREATE):
            for old in [a for a in self._actions.values() if a.schedule == write.name]:
                if old.finished_at is None:
                    self._actions[old.id] = replace(old, outcome="CANCELLED", finished_at=now)
        action = ControlAction(
            id=next(self._seq),
            schedule=write.name,
            action=write.action,
            actor=write.actor,
            reason=write.reason,
            params=dict(write.params),
            progress=None,
            outcome="done" if write.finished else None,
            created_at=now,
            finished_at=now if write.finished else None,
            request_id=write.request_id,
        )
        self._actions[action.id] = action
        for wake in list(self._listeners):
            wake()
        return action

    # --- actions -----------------------------------------------------------------------------

    async def open_actions(self, names: Sequence[str]) -> list[ControlAction]:
        wanted = set(names)
        return sorted(
            (a for a in self._actions.values() if a.finished_at is None and a.schedule in wanted),
            key=lambda a: a.id,
        )

    async def action_of_request(self, name: str, request_id: str) -> ControlAction | None:
        for earlier in self._actions.values():
            if earlier.schedule == name and earlier.request_id == request_id:
                return replace(earlier, replayed=True)
        return None

    async def action(self, action_id: int) -> ControlAction | None:
        return self._actions.get(action_id)

    async def actions(self, name: str, limit: int) -> list[ControlAction]:
        found = [a for a in self._actions.values() if a.schedule == name]
        return sorted(found, key=lambda a: -a.id)[:limit]

    async def finish_action(
        self, action_id: int, outcome: str, progress: Mapping[str, Any] | None
    ) -> None:
        action = self._actions.get(action_id)
        if action is None:
            return
        if action.finished_at is not None:
            # As the PostgreSQL store: a remove's CANCELLED takes the coordinator's progress.
            if action.outcome == outcome == "CANCELLED" and progress is not None:
                self._actions[action_id] = replace(action, progress=dict(progress))
            return
        self._actions[action_id] = replace(
            action,
            outcome=outcome,
            finished_at=action.finished_at or self._clock(),
            progress=action.progress if progress is None else dict(progress),
        )

    async def set_progress(self, action_id: int, progress: Mapping[str, Any]) -> None:
        action = self._actions.get(action_id)
        if action is not None and action.finished_at is None:
            self._actions[action_id] = replace(action, progress=dict(progress))

    async def release_failed(self, lock_keys: Sequence[str], before: datetime, by: str) -> int:
        rows = getattr(self.jobs, "_rows", None)
        attempts = getattr(self.jobs, "_attempts", {})
        released = getattr(self.jobs, "_released", None)
        if not isinstance(rows, dict) or not isinstance(released, dict):
            return 0
        count = 0
        for key in lock_keys:
            row = rows.get(key)
            if row is None or row.status is not JobSchedulerStatus.FAIL:
                continue
            if attempts.get(key, 1) == 0 or key in released or row.modified_at >= before:
                continue
            released[key] = by  # the lease's column released, never the run's data
            count += 1
        return count

    async def succeeded_before(self, lock_keys: Sequence[str], before: datetime) -> set[str]:
        rows = getattr(self.jobs, "_rows", None)
        if not isinstance(rows, dict):
            return set()
        return {
            key
            for key in lock_keys
            if (row := rows.get(key)) is not None
            and row.status is JobSchedulerStatus.SUCCESS
            and row.modified_at < before
        }

    # --- history -----------------------------------------------------------------------------

    async def runs_started(self, runs: Sequence[RunStart]) -> list[int]:
        # As the PostgreSQL statement: the newest fencing token of each tick in the batch closes
        # that tick's older attempts, recorded before or in this batch.
        newest: dict[tuple[str, str], int] = {}
        for run in runs:
            if run.fencing_token is not None:
                tick = (run.schedule, run.run_key)
                newest[tick] = max(newest.get(tick, run.fencing_token), run.fencing_token)
        now = self._clock()

        def abandoned(tick: tuple[str, str], token: int | None) -> str | None:
            newer = newest.get(tick)
            if token is None or newer is None or token >= newer:
                return None
            return f"abandoned: the tick was taken over (fencing token {newer})"

        for old_id, old in list(self._runs.items()):
            error = abandoned((old.schedule, old.run_key), old.fencing_token)
            if old.status == "RUNNING" and error is not None:
                self._runs[old_id] = replace(old, status="FAIL", finished_at=now, error=error)
        ids = []
        for run in runs:
            error = abandoned((run.schedule, run.run_key), run.fencing_token)
            run_id = next(self._run_ids)
            self._runs[run_id] = RunRecord(
                schedule=run.schedule,
                run_key=run.run_key,
                source=run.source,
                scheduled_at=run.scheduled_at,
                started_at=now,
                finished_at=None if error is None else now,
                status="RUNNING" if error is None else "FAIL",
                attempt=run.attempt,
                fencing_token=run.fencing_token,
                host=run.replica.host,
                pid=run.replica.pid,
                error=error,
            )
            ids.append(run_id)
        return ids

    async def runs_finished(self, runs: Sequence[RunFinish]) -> None:
        now = self._clock()
        for done in runs:
            run = self._runs.get(done.run_id)
            if run is None or run.status != "RUNNING":  # a takeover's close stays
                continue
            status, error = done.status, done.error
            # As the PostgreSQL statement: a lease row whose token moved on was taken over.
            row = None if done.lease_id is None else self._lease_row(done.lease_id)
            newer = None if row is None else int(row.fencing_token)
            if newer is not None and run.fencing_token is not None and newer > run.fencing_token:
                status = "FAIL"
                error = f"abandoned: the tick was taken over (fencing token {newer})"
            self._runs[done.run_id] = replace(run, status=status, error=error, finished_at=now)

    def _lease_row(self, lease_id: str) -> Any:
        get = getattr(self.jobs, "get", None)  # MemoryJobScheduler's lookup by row id
        return None if get is None else get(lease_id)

    async def run_started(self, run: RunStart) -> int:
        (run_id,) = await self.runs_started([run])
        return run_id

    async def run_finished(self, run_id: int, status: str, error: str | None) -> None:
        await self.runs_finished([RunFinish(run_id=run_id, status=status, error=error)])

    async def history(self, name: str, limit: int) -> list[RunRecord]:
        found = [(i, r) for i, r in self._runs.items() if r.schedule == name]
        found.sort(key=lambda item: (item[1].started_at, item[0]), reverse=True)
        return [r for _, r in found[:limit]]

    async def states(self) -> list[ScheduleState]:
        live = self._live()
        out = []
        for row in sorted(self._rows.values(), key=lambda r: r.name):
            if row.removed_at is not None:
                continue
            # As the PostgreSQL store orders them: replicas by host, then pid as a number;
            # versions by the start of their oldest replica (the old one first in a deploy).
            holders = sorted(
                (
                    (self._replicas[rid][0], fp, self._definitions.get((n, rid)), rid)
                    for (n, rid), fp in self._declarations.items()
                    if n == row.name and rid in live
                ),
                key=lambda h: (h[0].host, h[0].pid),
            )
            by_print: dict[str, tuple[list[str], Mapping[str, Any] | None]] = {}
            first: dict[str, datetime] = {}
            for rep, fp, declared, rid in holders:
                # A declaration without its definition: the row's, when it is that version.
                definition = declared
                if definition is None and fp == row.fingerprint:
                    definition = _definition(row)
                hosts, known = by_print.setdefault(fp, ([], definition))
                hosts.append(f"{rep.host}:{rep.pid}")
                started = self._started.get(rid, self._replicas[rid][1])
                first[fp] = min(first.get(fp, started), started)
                if known is None and definition is not None:
                    by_print[fp] = (hosts, definition)
            runs = await self.history(row.name, 1)
            extra = self._extra.get(row.name, {}) if row.paused else {}
            out.append(
                ScheduleState(
                    name=row.name,
                    origin=row.origin,
                    kind=row.kind,
                    expression=row.expression,
                    time_zone=row.time_zone,
                    paused=row.paused,
                    paused_at=row.paused_at if row.paused else None,
                    paused_by=extra.get("paused_by"),
                    paused_reason=extra.get("paused_reason"),
                    handler=row.handler,
                    args=row.args,
                    options=row.options,
                    replicas=tuple(f"{rep.host}:{rep.pid}" for rep, _, _, _ in holders),
                    versions=len(by_print),
                    last_run_at=runs[0].started_at if runs else None,
                    last_status=runs[0].status if runs else None,
                    version=row.revision,
                    last_seen_at=max(
                        (
                            self._replicas[rid][1]
                            for (n, rid) in self._declarations
                            if n == row.name and rid in live
                        ),
                        default=None,
                    ),
                    day_rule=row.day_rule,
                    live_versions=tuple(
                        live_version(fp, definition, hosts)
                        for fp, (hosts, definition) in sorted(
                            by_print.items(), key=lambda item: (first[item[0]], item[0])
                        )
                    ),
                )
            )
        return out

    async def prune(self, before: datetime, batch: int) -> int:
        old_runs = [i for i, r in self._runs.items() if r.started_at < before]
        for i in old_runs:
            del self._runs[i]
        old_actions = [
            i
            for i, a in self._actions.items()
            if a.finished_at is not None and a.finished_at < before
        ]
        for i in old_actions:
            del self._actions[i]
        return len(old_runs) + len(old_actions)

    async def listen(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` once listening, then on every write until cancelled (as the
        PostgreSQL store's LISTEN/NOTIFY does)."""
        self._listeners.append(wake)
        wake()
        try:
            await asyncio.Event().wait()
        finally:
            self._listeners.remove(wake)
