"""The control plane's state in PostgreSQL (migration component ``schedules``).

Statements live in ``sdcore/postgres/sql/schedules.sql``. Every write of a schedule row or an
action runs in one transaction under an advisory lock and ends with ``pg_notify``; replicas
LISTEN on the channel (the schedules table's name) and also poll, so a change reaches every
replica even under PgBouncer transaction pooling, where LISTEN is unavailable (``listen=False``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from sdcore._internal.identifiers import MAX_IDENTIFIER_BYTES, qualified
from sdcore._internal.sql import queries
from sdcore.job_scheduler import JobScheduler
from sdcore.postgres import derived_name, migrate, notifications
from sdcore.scheduling._control import (
    DEFAULT_LIVE_MS,
    ActionKind,
    Changes,
    ControlAction,
    ControlWriteUncertainError,
    Declared,
    LiveVersion,
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

__all__ = ["PostgresScheduleStore"]

# pg_advisory_xact_lock key of control writes (distinct from the schema lock).
CONTROL_LOCK_ID = 0x5DC0_0013
T = TypeVar("T")


def _record(
    cls: Callable[..., T], columns: str, r: Sequence[Any], **convert: Callable[[Any], Any]
) -> T:
    """Build ``cls`` from a result row whose columns are named, in order, by ``columns``."""
    values = dict(zip(columns.split(), r, strict=True))
    for name, function in convert.items():
        values[name] = function(values[name])
    return cls(**values)


def _object(value: Any) -> Any:
    return value or {}


_ROW = (
    "name origin kind expression time_zone options handler args fingerprint paused paused_at "
    "resumed_at removed_at revision day_rule"
)
_ACTION = (
    "id schedule action actor reason params progress outcome created_at finished_at request_id"
)
_RUN = (
    "schedule run_key source scheduled_at started_at finished_at status attempt fencing_token "
    "host pid error"
)
_STATE = (
    "name origin kind expression time_zone paused paused_at paused_by paused_reason handler "
    "args options replicas versions last_run_at last_status last_seen_at day_rule version"
)


def notify_channel(table: str, schema: str | None) -> str:
    """The NOTIFY channel of a schedules table: ``schema.table``, at most 63 bytes.

    PostgreSQL refuses ``pg_notify`` on a longer channel (and clips a ``LISTEN`` identifier to
    63 bytes, so the two would never meet); past 63 bytes the name is clipped and an 8-hex-digit
    hash of the whole name added, as :func:`~sdcore.postgres.derived_name` does, so two long
    names sharing a prefix keep distinct channels.
    """
    name = table if schema is None else f"{schema}.{table}"
    if len(name.encode("utf-8")) <= MAX_IDENTIFIER_BYTES:
        return name
    digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:8]
    room = MAX_IDENTIFIER_BYTES - len(digest) - 1
    return name.encode("utf-8")[:room].decode("utf-8", "ignore") + "_" + digest


def _row(r: Sequence[Any]) -> ScheduleRow:
    return _record(ScheduleRow, _ROW, r, options=_object, paused=bool, revision=int)


def _action(r: Sequence[Any]) -> ControlAction:
    return _record(ControlAction, _ACTION, r, id=int, action=ActionKind, params=_object)


class PostgresScheduleStore:
    """The schedules table, its companion tables and the lease table, over a pool.

    Args:
        pool: An open ``AsyncConnectionPool`` (autocommit connections).
        table: The schedules table (default ``sdcore_schedules``).
        schema: Its schema (``None``: the ``search_path``).
        lease_table: The lease table backfill reopens failed ticks in.
        live_ms: A replica not seen for this long no longer counts as declaring its schedules.
        transaction_pooling: The pool goes through PgBouncer in transaction mode: statements are
            never prepared server-side (PgBouncer before 1.21 would meet a prepared statement on
            another server connection); use with ``ScheduleControl(listen=False)``.

    Raises:
        InvalidIdentifierError: A bad table or schema name.
    """

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        *,
        table: str = "sdcore_schedules",
        schema: str | None = None,
        lease_table: str = JobScheduler.TABLE_NAME,
        live_ms: int = DEFAULT_LIVE_MS,
        transaction_pooling: bool = False,
    ) -> None:
        self.pool = pool
        self.transaction_pooling = bool(transaction_pooling)
        # Prepared at first use (a poll or heartbeat runs a few times a minute on a replica),
        # never behind a transaction-mode pooler.
        self._prepare = not transaction_pooling
        self.table = table
        self.schema = schema
        self.live_ms = live_ms
        self.channel = notify_channel(table, schema)

        def companion(suffix: str) -> sql.Identifier:
            name = derived_name(table, suffix)
            return sql.Identifier(name) if schema is None else sql.Identifier(schema, name)

        seq = companion("revision_seq")
        names: dict[str, sql.Composable] = {
            "table": qualified(table, schema),
            "seq_text": sql.Literal(seq.as_string(None)),
            "replicas": companion("replicas"),
            "declarations": companion("declarations"),
            "actions": companion("actions"),
            "runs": companion("runs"),
            "lease": qualified(lease_table, schema),
        }
        self._sql = {
            key: sql.SQL(text).format(**names).as_string(None).encode("utf-8")
            for key, text in queries("schedules").items()
        }

    async def ensure_schema(self) -> None:
        """Apply the ``schedules`` component's pending migrations (race-safe)."""
        await migrate(self.pool, "schedules", table=self.table, schema=self.schema)

    async def _x(
        self, conn: psycopg.AsyncConnection[Any], statement: bytes, params: Sequence[Any]
    ) -> psycopg.AsyncCursor[Any]:
        return await conn.execute(statement, tuple(params), prepare=self._prepare)

    async def _all(self, key: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        async with self.pool.connection() as conn:
            cur = await self._x(conn, self._sql[key], params)
            return list(await cur.fetchall())

    async def _one(self, key: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        rows = await self._all(key, params)
        return rows[0] if rows else None

    async def _exec(self, key: str, params: Sequence[Any] = ()) -> int:
        async with self.pool.connection() as conn:
            cur = await self._x(conn, self._sql[key], params)
            return int(cur.rowcount)

    async def sync(self, replica: Replica, declared: Sequence[Declared]) -> list[str]:
        names = [d.name for d in declared]
        async with self.pool.connection() as conn, conn.transaction():
            await self._x(conn, self._sql["lock_shared"], (CONTROL_LOCK_ID,))
            await self._x(conn, self._sql["expire_replicas"], (10 * self.live_ms,))
            cur = await self._x(
                conn, self._sql["changed_names"], (names, [d.fingerprint for d in declared])
            )
            changed = {r[0] for r in await cur.fetchall()}
            fresh = [d for d in declared if d.name in changed]
            if fresh:
                await self._x(conn, self._sql["keep_definitions"], ([d.name for d in fresh],))
                await self._x(
                    conn,
                    self._sql["sync_schedules"],
                    (
                        [d.name for d in fresh],
                        [d.kind for d in fresh],
                        [d.expression for d in fresh],
                        [d.time_zone for d in fresh],
                        [json.dumps(dict(d.options)) for d in fresh],
                        [d.fingerprint for d in fresh],
                        [d.day_rule for d in fresh],
                    ),
                )
            await self._x(
                conn,
                self._sql["upsert_replica"],
                (replica.replica_id, replica.host, replica.pid, list(replica.handlers)),
            )
            await self._x(
                conn,
                self._sql["declare"],
                (
                    replica.replica_id,
                    names,
                    [d.fingerprint for d in declared],
                    [None] * len(declared),  # the row holds it (see the statement)
                ),
            )
            cur = await self._x(conn, self._sql["mixed_versions"], (names, self.live_ms))
            return [r[0] for r in await cur.fetchall()]

    async def declare(
        self,
        replica: Replica,
        name: str,
        fingerprint: str | None,
        definition: Mapping[str, Any] | None = None,
    ) -> None:
        if fingerprint is None:
            await self._exec("undeclare", (replica.replica_id, name))
        else:
            encoded = None if definition is None else json.dumps(dict(definition))
            await self._exec("declare", (replica.replica_id, [name], [fingerprint], [encoded]))

    async def heartbeat(self, replica: Replica) -> bool:
        return await self._exec("heartbeat", (replica.replica_id,)) > 0

    async def members(self, replica: Replica, digest: str, ttl_ms: int) -> list[MemberRow] | None:
        try:
            rows = await self._all("members", (digest, replica.replica_id, ttl_ms))
        except psycopg.errors.UndefinedColumn:
            return None  # schedules/0005_replica_digest not applied yet
        return [MemberRow(replica_id=r[0], digest=r[1]) for r in rows]

    async def declared_versions(self, digest: str) -> dict[str, str]:
        rows = await self._all("declared_versions", (digest,))
        return {r[0]: r[1] for r in rows}

    async def leave(self, replica: Replica) -> None:
        await self._exec("leave", (replica.replica_id, self.channel))

    async def revision(self) -> int:
        row = await self._one("revision")
        return int(row[0]) if row else 0

    async def changes(self) -> Changes:
        row = await self._one("changes")
        assert row is not None  # noqa: S101 - a SELECT without FROM returns one row
        return Changes(revision=int(row[0]), actions_open=bool(row[1]))

    async def rows(self, since: int | None) -> list[ScheduleRow]:
        if since is None:
            return [_row(r) for r in await self._all("rows_all", (MAX_WINDOW_MS,))]
        return [_row(r) for r in await self._all("rows_since", (since,))]

    async def row(self, name: str) -> ScheduleRow | None:
        found = await self._one("row", (name,))
        return None if found is None else _row(found)

    async def live_declarers(self, name: str) -> int:
        found = await self._one("live_declarers", (name, self.live_ms))
        return int(found[0]) if found else 0

    async def live_handlers(self) -> set[str]:
        return {r[0] for r in await self._all("live_handlers", (self.live_ms,))}

    async def write(self, write: Write) -> ControlAction | None:
        committing = False
        try:
            async with self.pool.connection() as conn, conn.transaction() as tx:
                found = await self._write(conn, write)
                if found is None:
                    tx.force_rollback = True
                    return None
                committing = True
        except psycopg.OperationalError as exc:
            # No SQLSTATE: the connection itself broke. During COMMIT the server may have
            # committed before the reply was lost, so the caller must not read it as refused.
            if committing and exc.sqlstate is None:
                raise ControlWriteUncertainError(
                    write.name, write.action, write.request_id
                ) from exc
            raise
        return found

    async def _write(
        self, conn: psycopg.AsyncConnection[Any], write: Write
    ) -> ControlAction | None:
        """The statements of :meth:`write` in its transaction (``None``: roll back)."""
        await self._x(conn, self._sql["lock"], (CONTROL_LOCK_ID,))
        if write.request_id is not None:
            cur = await self._x(
                conn, self._sql["action_of_request"], (write.name, write.request_id)
            )
            earlier = await cur.fetchone()
            if earlier is not None:
                return replace(_action(earlier), replayed=True)
        changed = 1
        if write.action is ActionKind.PAUSE:
            cur = await self._x(conn, self._sql["pause"], (write.actor, write.reason, write.name))
            changed = cur.rowcount
        elif write.action is ActionKind.RESUME:
            cur = await self._x(conn, self._sql["resume"], (write.name,))
            changed = cur.rowcount
        elif write.action is ActionKind.REMOVE:
            cur = await self._x(conn, self._sql["remove"], (write.name, self.live_ms))
            changed = cur.rowcount
        elif write.stored is not None:
            d = write.stored
            cur = await self._x(
                conn,
                self._sql["store"],
                (
                    d.name,
                    d.kind,
                    d.expression,
                    d.time_zone,
                    json.dumps(dict(d.options)),
                    write.handler,
                    json.dumps(dict(write.args or {})),
                    d.fingerprint,
                    d.day_rule,
                    write.action is ActionKind.CREATE,
                    d.name,
                    write.action is ActionKind.CREATE,
                    self.live_ms,
                    write.expected_revision,
                ),
            )
            changed = cur.rowcount
        if changed != 1:
            return None
        if write.action in (ActionKind.REMOVE, ActionKind.CREATE):
            await self._x(conn, self._sql["cancel_open_actions"], (write.name,))
        cur = await self._x(
            conn,
            self._sql["insert_action"],
            (
                write.name,
                write.action.value,
                write.actor,
                write.reason,
                json.dumps(dict(write.params)),
                write.finished,
                "done" if write.finished else None,
                write.request_id,
            ),
        )
        found = await cur.fetchone()
        await self._x(conn, self._sql["notify"], (self.channel, write.name))
        assert found is not None  # noqa: S101 - INSERT … RETURNING
        return _action(found)

    async def open_actions(self, names: Sequence[str]) -> list[ControlAction]:
        wanted = set(names)
        found = [_action(r) for r in await self._all("open_actions")]
        return [a for a in found if a.schedule in wanted]

    async def action_of_request(self, name: str, request_id: str) -> ControlAction | None:
        found = await self._one("action_of_request", (name, request_id))
        return None if found is None else replace(_action(found), replayed=True)

    async def action(self, action_id: int) -> ControlAction | None:
        found = await self._one("action", (action_id,))
        return None if found is None else _action(found)

    async def actions(self, name: str, limit: int) -> list[ControlAction]:
        return [_action(r) for r in await self._all("actions_of", (name, limit))]

    async def finish_action(
        self, action_id: int, outcome: str, progress: Mapping[str, Any] | None
    ) -> None:
        encoded = None if progress is None else json.dumps(dict(progress))
        await self._exec("finish_action", (outcome, encoded, action_id, outcome))

    async def set_progress(self, action_id: int, progress: Mapping[str, Any]) -> None:
        await self._exec("progress", (json.dumps(dict(progress)), action_id))

    async def release_failed(self, lock_keys: Sequence[str], before: datetime, by: str) -> int:
        return await self._exec("release_failed", (by, list(lock_keys), before))

    async def succeeded_before(self, lock_keys: Sequence[str], before: datetime) -> set[str]:
        rows = await self._all("succeeded_before", (list(lock_keys), before))
        return {r[0] for r in rows}

    async def runs_started(self, runs: Sequence[RunStart]) -> list[int]:
        if not runs:
            return []
        rows = await self._all(
            "runs_started",
            (
                [r.schedule for r in runs],
                [r.run_key for r in runs],
                [r.source for r in runs],
                [r.scheduled_at for r in runs],
                [r.attempt for r in runs],
                [r.fencing_token for r in runs],
                [r.replica.replica_id for r in runs],
                [r.replica.host for r in runs],
                [r.replica.pid for r in runs],
            ),
        )
        return [int(r[0]) for r in rows]

    async def runs_finished(self, runs: Sequence[RunFinish]) -> None:
        if runs:
            await self._exec(
                "runs_finished",
                (
                    [r.run_id for r in runs],
                    [r.status for r in runs],
                    [r.error for r in runs],
                    [r.lease_id for r in runs],
                ),
            )

    async def run_started(self, run: RunStart) -> int:
        (run_id,) = await self.runs_started([run])
        return run_id

    async def run_finished(self, run_id: int, status: str, error: str | None) -> None:
        await self.runs_finished([RunFinish(run_id=run_id, status=status, error=error)])

    async def history(self, name: str, limit: int) -> list[RunRecord]:
        rows = await self._all("history", (name, limit))
        return [_record(RunRecord, _RUN, r, attempt=int, pid=int) for r in rows]

    async def states(self) -> list[ScheduleState]:
        rows = await self._all("list", (self.live_ms,))
        versions: dict[str, list[LiveVersion]] = {}
        for name, fp, definition, replicas in await self._all("live_versions", (self.live_ms,)):
            versions.setdefault(name, []).append(live_version(fp, definition, replicas))
        states = [
            _record(
                ScheduleState,
                _STATE,
                r,
                paused=bool,
                options=_object,
                replicas=lambda v: tuple(v or ()),
                versions=int,
                version=int,
            )
            for r in rows
        ]
        return [replace(s, live_versions=tuple(versions.get(s.name, ()))) for s in states]

    async def prune(self, before: datetime, batch: int) -> int:
        total = 0
        for key in ("prune_runs", "prune_actions"):
            while True:
                deleted = await self._exec(key, (before, batch))
                total += deleted
                if deleted < batch:
                    break
        return total

    async def listen(self, wake: Callable[[], None]) -> None:
        """LISTEN on the channel on a dedicated connection and call ``wake`` per notification.

        Runs until cancelled. Raises ``psycopg.Error`` when the connection breaks (the engine
        falls back to polling and listens again later).
        """
        kwargs: dict[str, Any] = {}
        if isinstance(self.pool.kwargs, dict):
            kwargs.update(self.pool.kwargs)
        kwargs["autocommit"] = True
        conninfo = self.pool.conninfo
        if not isinstance(conninfo, str):
            raise TypeError("LISTEN needs a pool built from a conninfo string (use listen=False)")
        conn = await psycopg.AsyncConnection.connect(conninfo, **kwargs)
        async with conn:
            await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
            wake()  # anything written before LISTEN took effect is read by the next poll
            async for _ in notifications(conn):
                wake()
