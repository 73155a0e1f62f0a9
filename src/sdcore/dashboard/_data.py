"""What the dashboard's pages show, read from PostgreSQL (and Redis) one page at a time.

Statements are in ``sdcore/postgres/sql/dashboard.sql``; writes go through the public operator
APIs (:class:`~sdcore.scheduling.ScheduleAdmin`, :class:`~sdcore.outbox.OutboxAdmin`).

Missed ticks: a schedule's expected ticks come from its trigger (a never-started
:class:`~sdcore.scheduling.Scheduler` used as a calendar, so cron semantics are the scheduler's
own), its ticks that ran from the run history, both per hour. A tick is *missed* when it was due
more than :data:`GRACE` ago, after the schedule was created, and has no successful or running
run. An hour's instants never change and are cached per expression and zone (``_calendar``),
so 10,000 schedules sharing a few expressions cost a few calendar walks per hour.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from sdcore._internal.sql import queries
from sdcore.dashboard._calendar import BUCKET, WARM_PAIRS, Calendar
from sdcore.job_scheduler import JobScheduler, JobSchedulerStatus, LeaseAdmin
from sdcore.outbox import Outbox, OutboxAdmin, OutboxRow, OutboxStats, PostgresOutboxStore
from sdcore.postgres import derived_name
from sdcore.scheduling import PostgresScheduleStore

BUCKETS = 24
GRACE = timedelta(minutes=1)
PAGE_SIZE = 50
MAX_ROWS = 200


@dataclass(frozen=True, slots=True, kw_only=True)
class Bucket:
    """One hour of a schedule's timeline."""

    start: datetime
    expected: int
    ok: int
    running: int
    failed: int
    label: str = ""
    """The hour as ``HH:MM`` (UTC)."""
    missed: int = field(init=False)
    """Expected ticks that neither succeeded nor are running (failed ones included)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "missed", max(0, self.expected - self.ok - self.running))


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleRow:
    """A schedule as the schedules page shows it."""

    name: str
    origin: str
    kind: str
    expression: str
    time_zone: str
    paused: bool
    paused_at: datetime | None
    paused_by: str | None
    paused_reason: str | None
    exclusive: bool
    replicas: int
    last_run_at: datetime | None
    last_status: str | None
    last_error: str | None
    next_fire_at: datetime | None
    timeline: tuple[Bucket, ...] = ()

    @property
    def missed(self) -> int:
        """Missed ticks over the timeline."""
        return sum(b.missed for b in self.timeline)


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulePage:
    """One page of schedules."""

    rows: list[ScheduleRow]
    matched: int
    total: int
    paused: int
    page: int
    pages: int


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseRow:
    """A RUNNING lease."""

    id: str
    code: str
    run_key: str | None
    fencing_token: int
    owner: str | None
    heartbeat_age: timedelta
    lease_ms: int | None
    started_at: datetime

    @property
    def stale(self) -> bool:
        """The owner's lease has passed without a heartbeat (another replica may take it)."""
        return self.lease_ms is not None and self.heartbeat_age.total_seconds() * 1000 > (
            self.lease_ms
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueRow:
    """A BullMQ queue's job counts."""

    name: str
    counts: Mapping[str, int] = field(default_factory=dict)


def _bucket_starts(now: datetime) -> list[datetime]:
    top = now.replace(minute=0, second=0, microsecond=0)
    return [top - (BUCKETS - 1 - i) * BUCKET for i in range(BUCKETS)]


class DashboardData:
    """The dashboard's reads and writes over one pool.

    Args:
        pool: An open pool (autocommit connections).
        store: The schedules control plane's store (its tables).
        lease_table: The lease table.
        schema: The lease table's schema.
        outbox: The outbox table.
    """

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        *,
        store: PostgresScheduleStore,
        lease_table: str = JobScheduler.TABLE_NAME,
        schema: str | None = None,
        outbox: Outbox | None = None,
    ) -> None:
        self.pool = pool
        self.store = store
        self.outbox = outbox or Outbox()
        self.leases = LeaseAdmin(table=lease_table, schema=schema)
        self.calendar = Calendar()

        def companion(suffix: str) -> sql.Identifier:
            name = derived_name(store.table, suffix)
            where = store.schema
            return sql.Identifier(name) if where is None else sql.Identifier(where, name)

        def table(name: str, where: str | None) -> sql.Identifier:
            return sql.Identifier(name) if where is None else sql.Identifier(where, name)

        names = {
            "schedules": table(store.table, store.schema),
            "replicas": companion("replicas"),
            "declarations": companion("declarations"),
            "runs": companion("runs"),
            "lease": table(lease_table, schema),
        }
        self._sql = {
            key: sql.SQL(text).format(**names).as_string(None).encode("utf-8")
            for key, text in queries("dashboard").items()
        }
        self._outbox_store = PostgresOutboxStore(pool, outbox=self.outbox)
        self.outbox_admin = OutboxAdmin(self.outbox)

    async def _all(self, key: str, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql[key], params)
            return list(await cur.fetchall())

    # --- schedules ---------------------------------------------------------------------------

    async def schedules(
        self, *, query: str | None = None, paused: bool | None = None, page: int = 1
    ) -> SchedulePage:
        """One page of schedules (``PAGE_SIZE``), by name, with their 24-hour timelines."""
        params = {
            "query": query or None,
            "paused": paused,
            "limit": PAGE_SIZE,
            "offset": (page - 1) * PAGE_SIZE,
            "live_ms": self.store.live_ms,
        }
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql["schedules_page"], params)
            found = list(await cur.fetchall())
            cur = await conn.execute(self._sql["schedule_counts"], params)
            counts = await cur.fetchone()
        total, paused_count, matched = (int(n) for n in counts) if counts else (0, 0, 0)
        rows = await self._with_timelines(found)
        return SchedulePage(
            rows=rows,
            matched=matched,
            total=total,
            paused=paused_count,
            page=page,
            pages=max(1, math.ceil(matched / PAGE_SIZE)),
        )

    async def schedule(self, name: str) -> ScheduleRow | None:
        """One live schedule with its timeline, or ``None``."""
        found = await self._all("schedule_one", {"name": name, "live_ms": self.store.live_ms})
        rows = await self._with_timelines(found)
        return rows[0] if rows else None

    async def warm_calendar(self) -> int:
        """Compute the timelines' expected ticks of every cron expression and zone in use.

        Called in the background when the dashboard starts, so that the first view of the
        schedules list does not pay the calendar walks. Returns how many hours were computed.
        """
        pairs = await self._all("cron_calendars", {"limit": WARM_PAIRS})
        starts = _bucket_starts(datetime.now(UTC))
        return await self.calendar.warm(((str(e), str(z)) for e, z in pairs), starts)

    async def _with_timelines(self, found: Sequence[tuple[Any, ...]]) -> list[ScheduleRow]:
        now = datetime.now(UTC)
        starts = _bucket_starts(now)
        labels = [start.strftime("%H:%M") for start in starts]
        # Ticks are counted over the instants the timeline expects, never as an hourly total: a
        # tick of the last GRACE, or a backfilled one from before the schedule existed, would
        # otherwise cancel a real miss of the same hour.
        since, until = starts[0], now - GRACE
        ran: dict[tuple[str, int], tuple[int, int, int]] = {}
        names = [r[0] for r in found if r[2] in ("cron", "interval")]
        if names:
            params = {
                "names": names,
                "since": since,
                "until": until,
                "bucket_s": int(BUCKET.total_seconds()),
            }
            for name, index, ok, running, failed in await self._all("tick_buckets", params):
                ran[(name, int(index))] = (int(ok), int(running), int(failed))
        # Every bucket ends an hour after it starts, but the current one ends GRACE before now.
        highs = [min(start + BUCKET, until) for start in starts]
        none = (0, 0, 0)
        rows = []
        for r in found:
            name, kind, expression, zone, paused, created = r[0], r[2], r[3], r[4], r[5], r[10]
            rule = r[11] or "vixie"
            timeline: tuple[Bucket, ...] = ()
            if kind in ("cron", "interval"):
                buckets = []
                expected_in = self.calendar.expected
                for index, start in enumerate(starts):
                    low = start if created <= start else created
                    ok, running, failed = ran.get((name, index), none)
                    expected = expected_in(kind, expression, zone, start, low, highs[index], rule)
                    if ok + running + failed > expected:
                        ok, running, failed = await self._on_calendar(
                            name, kind, expression, zone, start, low, highs[index], rule
                        )
                    buckets.append(
                        Bucket(
                            start=start,
                            expected=expected,
                            ok=ok,
                            running=running,
                            failed=failed,
                            label=labels[index],
                        )
                    )
                timeline = tuple(buckets)
            options = r[9] or {}
            rows.append(
                ScheduleRow(
                    name=name,
                    origin=r[1],
                    kind=kind,
                    expression=expression,
                    time_zone=zone,
                    paused=bool(paused),
                    paused_at=r[6],
                    paused_by=r[7],
                    paused_reason=r[8],
                    exclusive=bool(options.get("exclusive", False)),
                    replicas=int(r[12]),
                    last_run_at=r[13],
                    last_status=r[14],
                    last_error=r[15],
                    # A code schedule no live replica declares (dropped from the code) fires
                    # nowhere: no next fire.
                    next_fire_at=None
                    if paused or (r[1] == "code" and not int(r[12]))
                    else self.calendar.next_fire(kind, expression, zone, rule),
                    timeline=timeline,
                )
            )
        return rows

    async def _on_calendar(
        self,
        name: str,
        kind: str,
        expression: str,
        zone: str,
        bucket: datetime,
        low: datetime,
        high: datetime,
        day_rule: str,
    ) -> tuple[int, int, int]:
        """Succeeded, running and failed ticks of ``[low, high)`` that the calendar expects."""
        params = {"name": name, "low": low, "high": high}
        ok = running = failed = 0
        for at, succeeded, is_running in await self._all("tick_instants", params):
            if not self.calendar.expects(kind, expression, zone, bucket, at, day_rule):
                continue
            if succeeded:
                ok += 1
            elif is_running:
                running += 1
            else:
                failed += 1
        return ok, running, failed

    async def runs(self, name: str, *, limit: int = 100) -> list[dict[str, Any]]:
        """A schedule's runs, newest first."""
        keys = (
            "run_key",
            "source",
            "scheduled_at",
            "started_at",
            "finished_at",
            "status",
            "attempt",
            "fencing_token",
            "host",
            "pid",
            "error",
        )
        found = await self._all("runs_of", {"name": name, "limit": limit})
        return [dict(zip(keys, r, strict=True)) for r in found]

    # --- leases ------------------------------------------------------------------------------

    async def running_leases(self) -> list[LeaseRow]:
        """RUNNING leases, newest first (at most ``MAX_ROWS``), with owner and heartbeat age."""
        async with self.pool.connection() as conn:
            runs = await self.leases.list_runs(
                conn, status=JobSchedulerStatus.RUNNING, limit=MAX_ROWS
            )
            cur = await conn.execute(self._sql["lease_details"], {"ids": [r.id for r in runs]})
            details = {r[0]: r[1:] for r in await cur.fetchall()}
        rows = []
        for run in runs:
            lease_ms, host, pid = details.get(run.id, (None, None, None))
            rows.append(
                LeaseRow(
                    id=run.id,
                    code=run.code,
                    run_key=run.run_key,
                    fencing_token=run.fencing_token,
                    owner=None if host is None else f"{host}:{pid}",
                    heartbeat_age=run.age,
                    lease_ms=lease_ms,
                    started_at=run.created_at,
                )
            )
        return rows

    # --- outbox ------------------------------------------------------------------------------

    async def outbox_stats(self) -> OutboxStats:
        """Row counts of the outbox table."""
        return await self._outbox_store.stats()

    async def outbox_rows(self, statuses: Sequence[str]) -> list[OutboxRow]:
        """Rows of these statuses, newest first (at most ``MAX_ROWS``).

        Raises:
            OutboxDatabaseError: The statement failed (``sqlstate`` in :data:`MISSING_STATES`:
                no outbox table).
        """
        async with self.pool.connection() as conn:
            return await self.outbox_admin.list_rows(conn, statuses=statuses, limit=MAX_ROWS)

    async def retry_outbox(self, row_id: int) -> bool:
        """Make a DEAD (or pending) row due now, attempts reset; ``False``: no such row."""
        async with self.pool.connection() as conn:
            return await self.outbox_admin.retry(conn, row_id)


QUEUE_KEY_SUFFIXES = ("meta", "events", "wait", "completed", "failed")
"""Keys a BullMQ queue has (at least one of them) while it holds jobs or has been used."""


class QueueNames:
    """The BullMQ queue names under a prefix, found by one SCAN walk and kept for ``ttl_s``.

    SCAN visits every key of the Redis database whatever its pattern, and a BullMQ Redis holds
    a hash per retained job: one walk costs O(keyspace). So the walk runs at most once per
    ``ttl_s`` (one at a time: concurrent views wait for it and share its result, and the
    pages' refreshes only read the counts), and stops after ``max_calls`` SCAN calls of
    ``count`` keys or at ``limit`` names, the list then marked :attr:`partial`.
    """

    def __init__(
        self,
        *,
        ttl_s: float = 60.0,
        max_calls: int = 200,
        count: int = 1000,
        limit: int = 100,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl_s = ttl_s
        self._max_calls = max_calls
        self._count = count
        self._limit = limit
        self._clock = clock
        self._lock = asyncio.Lock()
        self._names: list[str] | None = None
        self._found_at = 0.0
        self.partial = False
        """Whether the last walk stopped before the end of the keyspace."""

    async def get(self, client: Any, prefix: str) -> list[str]:
        """The queue names (sorted, at most ``limit``), walked again once ``ttl_s`` passed."""
        async with self._lock:
            if self._names is None or self._clock() - self._found_at >= self._ttl_s:
                self._names, self.partial = await self._walk(client, prefix)
                self._found_at = self._clock()
            return self._names

    async def _walk(self, client: Any, prefix: str) -> tuple[list[str], bool]:
        # One walk for every suffix: the class matches their first letters, the loop the rest.
        pattern = f"{_glob(prefix)}:*:[cefmw]*"
        names: set[str] = set()
        cursor, calls = 0, 0
        # On Redis Cluster the prefix's hash tag puts every queue key on one master: walk that
        # node alone (a cluster's SCAN cursor is one per node).
        node = client.get_node_from_key(prefix) if hasattr(client, "get_node_from_key") else None
        while True:
            if node is None:
                cursor, keys = await client.scan(cursor=cursor, match=pattern, count=self._count)
            else:
                cursors, keys = await client.scan(
                    cursor=cursor, match=pattern, count=self._count, target_nodes=node
                )
                cursor = cursors[node.name]
            calls += 1
            for key in keys:
                text = key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)
                head, _, suffix = text.rpartition(":")
                if suffix in QUEUE_KEY_SUFFIXES and head.startswith(f"{prefix}:"):
                    names.add(head[len(prefix) + 1 :])
            if cursor == 0:
                return sorted(names)[: self._limit], len(names) > self._limit
            if len(names) >= self._limit or calls >= self._max_calls:
                return sorted(names)[: self._limit], True


async def queue_counts(
    redis_url: str, prefix: str, *, limit: int = 100, names: QueueNames | None = None
) -> list[QueueRow]:
    """Job counts of the BullMQ queues under ``prefix`` (found by their keys, see
    :class:`QueueNames`; pass one to keep the names between calls).

    Raises:
        ImportError: The ``redis`` package is missing (``sdcore[bullmq]``).
        redis.RedisError: Redis cannot be reached.
    """
    from sdcore._internal.redis_client import open_redis

    finder = names if names is not None else QueueNames(limit=limit)
    client = open_redis(redis_url, decode_responses=False, socket_timeout_s=2, connect_timeout_s=2)
    async with client:
        found = (await finder.get(client, prefix))[:limit]
        keys = ("waiting", "active", "delayed", "prioritized", "completed", "failed", "paused")
        async with client.pipeline(transaction=False) as pipe:
            for name in found:
                base = f"{prefix}:{name}:"
                pipe.llen(base + "wait")
                pipe.llen(base + "active")
                pipe.zcard(base + "delayed")
                pipe.zcard(base + "prioritized")
                pipe.zcard(base + "completed")
                pipe.zcard(base + "failed")
                pipe.llen(base + "paused")
            values = list(map(int, await pipe.execute())) if found else []
        return [
            QueueRow(name=name, counts=dict(zip(keys, values[i * 7 : i * 7 + 7], strict=True)))
            for i, name in enumerate(found)
        ]


class QueueView:
    """The ``/queues`` rows, read from Redis by one view at a time and kept for ``ttl_s``.

    Every view of the page (anonymous ones included) would otherwise open its own Redis
    connection and send seven commands per queue: a burst of views would be as many
    connections to the Redis that BullMQ's workers need. Here concurrent views wait for one
    read and share its rows, or its error (a Redis that is down is tried once per ``ttl_s``,
    not once per waiting view), so the dashboard holds at most one Redis connection for it.
    """

    def __init__(
        self,
        names: QueueNames,
        *,
        ttl_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.names = names
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = asyncio.Lock()
        self._rows: list[QueueRow] | None = None
        self._error: Exception | None = None
        self._read_at = 0.0

    async def get(self, redis_url: str, prefix: str) -> list[QueueRow]:
        """The rows of at most ``ttl_s`` ago (read again after), or the error of that read.

        Raises:
            ImportError: The ``redis`` package is missing.
            redis.RedisError: Redis could not be read (kept, like rows, for ``ttl_s``).
        """
        async with self._lock:
            if self._clock() - self._read_at >= self._ttl_s or (
                self._rows is None and self._error is None
            ):
                try:
                    rows = await queue_counts(redis_url, prefix, names=self.names)
                except Exception as exc:  # noqa: BLE001 - kept for the waiting views, raised below
                    self._rows, self._error = None, exc
                else:
                    self._rows, self._error = rows, None
                self._read_at = self._clock()
            if self._error is not None:
                raise self._error.with_traceback(None)
            assert self._rows is not None  # noqa: S101 - set with the error cleared
            return self._rows


def _glob(text: str) -> str:
    """Escape Redis glob characters in a literal prefix."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


__all__ = [
    "Bucket",
    "DashboardData",
    "LeaseRow",
    "QueueNames",
    "QueueRow",
    "QueueView",
    "SchedulePage",
    "ScheduleRow",
    "queue_counts",
]

# psycopg's errors the pages turn into a notice instead of a 500 (a table not created yet).
MISSING_TABLE = (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName)
MISSING_STATES = frozenset(error.sqlstate for error in MISSING_TABLE)
"""SQLSTATEs of a missing table or schema, as an ``OutboxDatabaseError`` carries them."""
