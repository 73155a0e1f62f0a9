"""Incidents in PostgreSQL: one alert per incident across the cluster, one ``resolved`` per alert.

Several replicas notice the same problem (every replica fires a tick the cluster missed; a
failing tick that is not exclusive fails on each of them), so the decision to alert is taken in
the database, in one transaction per decision:

1. ``pg_advisory_xact_lock`` on the schedule (two-key form, a class of its own: it never meets
   sdcore's other advisory locks) serializes the decisions about one schedule cluster-wide;
2. the alerts outbox is read: an alert of this exact (schedule, kind, run key) written before
   means this incident was alerted already; the schedule's newest alert row, when it is not a
   ``resolved``, means an incident is open and this problem is part of it; a missed tick
   scheduled before the tick whose success resolved the last incident belongs to that one (the
   late runs of an outage's ticks interleave with the ticks that run on time again);
3. otherwise one outbox row per webhook sink is written, keyed by (schedule, kind, run key,
   sink), and committed with the decision.

A success resolves: under the same lock, if the schedule's newest alert row is an incident, one
``resolved`` row per sink is written, keyed by that incident: two replicas resolving at once
write it once. The outbox table itself is the incident log (its tombstones keep key and name
after the payload is pruned), so nothing else needs a migration.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from sdcore.alerting._model import (
    Alert,
    AlertKind,
    incident_key,
    incident_prefix,
    parse_key,
)
from sdcore.outbox import Outbox, OutboxKeyConflictError

__all__ = ["IncidentLog", "Problem"]

# The first key of pg_advisory_xact_lock(int, int) for alert decisions ("sdal" in ASCII).
LOCK_CLASS = 0x7364616C
_LOCK = "SELECT pg_advisory_xact_lock(%s, hashtext(%s))"
_SEEN = "SELECT EXISTS (SELECT 1 FROM {table} WHERE starts_with(idempotency_key, %s))"
# The newest alert row of a schedule, with the scheduled instant of its tick (NULL once the row
# is pruned to a tombstone).
_NEWEST = (
    "SELECT idempotency_key, name, CAST(payload->>'scheduled_at' AS timestamptz) "
    "FROM {table} WHERE starts_with(idempotency_key, %s) ORDER BY id DESC LIMIT 1"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Problem:
    """Something that may open an incident."""

    kind: AlertKind
    schedule: str
    run_key: str
    scheduled_at: datetime | None
    attempt: int
    reason: str


def alert_id(schedule: str, kind: AlertKind, run_key: str) -> str:
    """The alert's id: the same on every replica and for every sink."""
    text = f"{incident_prefix(schedule)}{kind.value}|{run_key}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


class IncidentLog:
    """Decides and writes alerts in the alerts outbox.

    Args:
        pool: The service's pool.
        outbox: The alerts outbox (its own table).
        sinks: The webhook sinks' names (one row per sink and alert).
        logger: Where decisions are logged.
    """

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        outbox: Outbox,
        sinks: Sequence[str],
        logger: logging.Logger,
    ) -> None:
        self._pool = pool
        self._outbox = outbox
        self._sinks = tuple(sinks)
        self._log = logger
        table = (
            sql.Identifier(outbox.table)
            if outbox.schema is None
            else sql.Identifier(outbox.schema, outbox.table)
        )
        self._seen = sql.SQL(_SEEN).format(table=table)
        self._newest = sql.SQL(_NEWEST).format(table=table)

    async def open(self, problem: Problem) -> Alert | None:
        """Alert ``problem`` unless it was alerted, or an incident of its schedule is open.

        Returns:
            The alert written (``None``: nothing was written).
        """
        if not self._sinks:
            return None
        name = problem.schedule
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute(_LOCK, (LOCK_CLASS, name))
            mine = f"{incident_prefix(name)}{problem.kind.value}|{problem.run_key}|"
            row = await (await conn.execute(self._seen, (mine,))).fetchone()
            if row is not None and row[0]:
                return None  # this incident was alerted (by this replica or another)
            newest = await (await conn.execute(self._newest, (incident_prefix(name),))).fetchone()
            if newest is not None and newest[1] != AlertKind.RESOLVED.value:
                return None  # part of the incident already open
            if (
                newest is not None
                and problem.kind is AlertKind.MISSED
                and problem.scheduled_at is not None
                and newest[2] is not None
                and problem.scheduled_at <= newest[2]
            ):
                # A missed tick from before the recovery: caught up late, after a tick that ran
                # on time resolved its outage. Part of that incident.
                return None
            alert = Alert(
                id=alert_id(name, problem.kind, problem.run_key),
                kind=problem.kind,
                schedule=name,
                run_key=problem.run_key,
                scheduled_at=problem.scheduled_at,
                detected_at=datetime.now(UTC),
                attempt=problem.attempt,
                reason=problem.reason,
            )
            await self._write(conn, alert, problem.run_key)
        return alert

    async def resolve(
        self, schedule: str, run_key: str | None, scheduled_at: datetime | None, attempt: int
    ) -> Alert | None:
        """Resolve the open incident of ``schedule``, if any: its tick ``run_key`` succeeded.

        Returns:
            The ``resolved`` alert written (``None``: no incident was open).
        """
        if not self._sinks:
            return None
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute(_LOCK, (LOCK_CLASS, schedule))
            prefix = incident_prefix(schedule)
            newest = await (await conn.execute(self._newest, (prefix,))).fetchone()
            if newest is None or newest[1] == AlertKind.RESOLVED.value:
                return None
            parsed = parse_key(schedule, newest[0])
            if parsed is None:
                return None
            kind, incident_run = parsed
            closes = f"{kind.value}:{incident_run}"
            alert = Alert(
                id=alert_id(schedule, AlertKind.RESOLVED, closes),
                kind=AlertKind.RESOLVED,
                schedule=schedule,
                run_key=run_key,
                scheduled_at=scheduled_at,
                detected_at=datetime.now(UTC),
                attempt=attempt,
                reason=f"run {run_key} succeeded after the {kind.value} run {incident_run}",
                incident_kind=kind,
                incident_run_key=incident_run,
            )
            await self._write(conn, alert, closes)
        return alert

    async def _write(self, conn: Any, alert: Alert, run_part: str) -> None:
        payload = alert.payload()
        for sink in self._sinks:
            try:
                await self._outbox.enqueue_once(
                    conn,
                    idempotency_key=incident_key(alert.schedule, alert.kind, run_part, sink),
                    queue=sink,
                    name=alert.kind.value,
                    payload=payload,
                )
            except OutboxKeyConflictError:
                # The key outlived the decision that wrote it (a tombstone past the read above):
                # this alert went out already.
                continue
        self._log.warning(
            "alert: schedule %r %s (run %r): %s",
            alert.schedule,
            alert.kind.value,
            alert.run_key,
            alert.reason,
            extra={
                "action": "alert",
                "schedule": alert.schedule,
                "run_key": alert.run_key,
                "alert": alert.kind.value,
            },
        )
