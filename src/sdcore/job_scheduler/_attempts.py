"""Scheduler tick operations on the lease table: an attempt budget, skipped ticks, tick records.

The plain lease (``acquire`` / ``run_exclusive``) takes a ``FAIL`` row at once, as the seed does.
A scheduled tick must not: its retry policy allows ``max_attempts`` runs across the cluster, each
after a backoff. These statements keep that budget on the row (column ``attempts``, migration
``lease/0003``) and are used by :mod:`sdcore.scheduling` only.

Rules of :data:`ACQUIRE_ATTEMPT` (everything else is the plain ``ACQUIRE``: a new row is
``RUNNING``; a takeover rotates the owner token, draws a higher fencing token from the table's
sequence, records the new owner's ``lease_ms``, clears ``data``):

- no row: insert it, ``attempts = 1``;
- ``RUNNING`` silent for longer than *its owner's* lease (its owner died): take it,
  ``attempts + 1`` (an abandoned attempt is re-run whatever the budget);
- ``FAIL`` released by an operator (``data`` has ``released`` or ``released_by``): take it and
  start a new budget, ``attempts = 1``;
- ``FAIL`` otherwise: take it only while ``attempts < max_attempts`` and once
  ``backoff_ms * 2 ** (attempts - 1)`` (at most 2**31 - 1 ms; 0 for a skipped tick, whose
  ``attempts`` is 0) has passed since the failure by the database clock;
- ``SUCCESS``: never.
"""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql

from sdcore._internal.sql import queries, render
from sdcore.job_scheduler._model import JobSchedulerStatus
from sdcore.job_scheduler._sql import COLUMNS, COLUMNS_J, fencing_sequence

MAX_BACKOFF_MS = 2**31 - 1

_RELEASED = "(j.data ? 'released' OR j.data ? 'released_by')"

ACQUIRE_ATTEMPT = """\
INSERT INTO {table} AS j
    (lock_key, idempotency_key, code, name, type, run_key, status, owner_token,
     fencing_token, data, created_at, modified_at, lease_ms, attempts)
VALUES (%s, %s, %s, %s, %s, %s, 'RUNNING', %s::uuid, nextval({sequence}), NULL, clock_timestamp(),
        clock_timestamp(), %s::bigint, 1)
ON CONFLICT (lock_key) DO UPDATE
SET status = 'RUNNING',
    owner_token = EXCLUDED.owner_token,
    fencing_token = greatest(nextval({sequence}), j.fencing_token + 1),
    name = EXCLUDED.name,
    data = NULL,
    lease_ms = EXCLUDED.lease_ms,
    attempts = CASE WHEN j.status = 'FAIL' AND {released} THEN 1 ELSE j.attempts + 1 END,
    modified_at = clock_timestamp()
WHERE (j.status = 'RUNNING'
       AND clock_timestamp() - j.modified_at
           > coalesce(j.lease_ms, EXCLUDED.lease_ms) * interval '1 millisecond')
   OR (j.status = 'FAIL' AND {released})
   OR (j.status = 'FAIL'
       AND j.attempts < %s::int
       AND clock_timestamp() - j.modified_at >= CASE WHEN j.attempts = 0 THEN interval '0'
           ELSE LEAST(%s::float8 * power(2::float8, j.attempts - 1), {max_backoff}::float8)
                * interval '1 millisecond' END)
RETURNING {columns}, j.attempts"""

# A tick skipped on purpose (overlap): a FAIL row with attempts = 0 and data {"skipped": reason},
# only if the tick has no row yet. Any replica's ACQUIRE_ATTEMPT may still take it (a replica that
# is not busy), but the catch-up sweep and missed_ticks see that it was skipped, not missed.
RECORD_SKIPPED = """\
INSERT INTO {table}
    (lock_key, idempotency_key, code, name, type, run_key, status, owner_token,
     fencing_token, data, created_at, modified_at, attempts)
VALUES (%s, %s, %s, %s, %s, %s, 'FAIL', %s::uuid, nextval({sequence}), %s::jsonb,
        clock_timestamp(), clock_timestamp(), 0)
ON CONFLICT (lock_key) DO NOTHING"""

TICK_RECORDS = """\
SELECT lock_key, status, attempts, j.data ->> 'skipped', {released},
       extract(epoch FROM clock_timestamp() - j.modified_at)::float8 * 1000
FROM {table} AS j WHERE lock_key = ANY(%s)"""

# When did a schedule first leave a row (catch-up never reaches back before it)?
FIRST_SEEN = "SELECT min(created_at) FROM {table} WHERE code = %s"


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptBudget:
    """How often a tick may run across the cluster.

    Attributes:
        max_attempts: Runs allowed (``retries + 1``), at least 1.
        backoff_ms: Wait after the first failure, doubled after each further one (at most
            2**31 - 1 ms), by the database clock.
    """

    max_attempts: int
    backoff_ms: int

    def __post_init__(self) -> None:
        for field, value, low in (
            ("max_attempts", self.max_attempts, 1),
            ("backoff_ms", self.backoff_ms, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{field} must be an int, got {type(value).__name__}")
            if not low <= value <= MAX_BACKOFF_MS:
                raise ValueError(f"{field} must be between {low} and {MAX_BACKOFF_MS}, got {value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TickRecord:
    """What the lease table says about one tick.

    Attributes:
        status: The row's status.
        attempts: Runs started for the tick (0: recorded as skipped, never run).
        skipped: Why the tick was skipped (``"overlap"``), if it was recorded as skipped.
        released: An operator (or ``release()``) reopened the tick.
        age_ms: Milliseconds since the row last changed, by the database clock (how much of a
            retry backoff has passed).
    """

    status: JobSchedulerStatus
    attempts: int
    skipped: str | None
    released: bool
    age_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class TickStatements:
    """The tick statements rendered once for one table."""

    acquire_attempt: bytes
    record_skipped: bytes
    tick_records: bytes
    first_seen: bytes
    acquire_attempt_many: bytes
    read_owned_attempts: bytes

    @classmethod
    def render(cls, table: sql.Identifier) -> TickStatements:
        """Render every statement for ``table`` (and its fencing sequence, as ``_sql`` names it)."""
        quoted = table.as_string(None)
        sequence = fencing_sequence(table)

        def one(template: str) -> bytes:
            return template.format(
                table=quoted,
                columns=COLUMNS,
                released=_RELEASED,
                max_backoff=MAX_BACKOFF_MS,
                sequence=sequence,
            ).encode("utf-8")

        ticks = queries("ticks")

        def named(name: str) -> bytes:
            fragments = {
                "sequence": sequence,
                "columns_j": COLUMNS_J,
                "released": _RELEASED,
                "max_backoff": str(MAX_BACKOFF_MS),
            }
            return render(ticks[name], table, **fragments).as_string(None).encode("utf-8")

        return cls(
            acquire_attempt=one(ACQUIRE_ATTEMPT),
            record_skipped=one(RECORD_SKIPPED),
            tick_records=one(TICK_RECORDS),
            first_seen=one(FIRST_SEEN),
            acquire_attempt_many=named("acquire_attempt_many"),
            read_owned_attempts=named("read_owned_attempts"),
        )
