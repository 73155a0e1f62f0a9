"""The outbox statements. ``{table}`` is the quoted table; values are always parameters."""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql

# One statement: the row and, only if it was inserted, a NOTIFY that PostgreSQL delivers at
# commit (and drops on rollback), so a relay wakes exactly when there is something to publish.
ENQUEUE = """\
WITH inserted AS (
    INSERT INTO {table} (idempotency_key, queue, name, job_id, payload, options, max_attempts)
    VALUES (%s, %s, %s, %s, %s::jsonb, %s::jsonb, %s)
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING id
)
SELECT id, pg_notify(%s, '') FROM inserted"""

# The same for SQLAlchemy's text() (named parameters).
ENQUEUE_NAMED = """\
WITH inserted AS (
    INSERT INTO {table} (idempotency_key, queue, name, job_id, payload, options, max_attempts)
    VALUES (:key, :queue, :name, :job_id, CAST(:payload AS jsonb), CAST(:options AS jsonb), :max)
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING id
)
SELECT id, pg_notify(:channel, '') FROM inserted"""

# Without NOTIFY (Outbox(notify=False)): relays find the row by polling.
ENQUEUE_QUIET = """\
INSERT INTO {table} (idempotency_key, queue, name, job_id, payload, options, max_attempts)
VALUES (%s, %s, %s, %s, %s::jsonb, %s::jsonb, %s)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id, %s::text"""

ENQUEUE_QUIET_NAMED = """\
INSERT INTO {table} (idempotency_key, queue, name, job_id, payload, options, max_attempts)
VALUES (:key, :queue, :name, :job_id, CAST(:payload AS jsonb), CAST(:options AS jsonb), :max)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id, CAST(:channel AS text)"""

# Claim due rows for claim_ms: a short autocommit statement, no transaction held across Redis
# I/O. SKIP LOCKED and the claim time keep concurrent relays off each other's rows; a relay
# that dies leaves its claims to expire. No "id > cursor": a row that commits late is still due.
CLAIM = """\
UPDATE {table} SET claimed_until = clock_timestamp() + %s * interval '1 millisecond',
                   attempts = attempts + 1
WHERE id IN (
    SELECT id FROM {table}
    WHERE status = 'PENDING' AND next_attempt_at <= clock_timestamp()
      AND (claimed_until IS NULL OR claimed_until < clock_timestamp())
    ORDER BY next_attempt_at, id
    LIMIT %s
    FOR UPDATE SKIP LOCKED
)
RETURNING id, idempotency_key, queue, name, job_id, payload, options, attempts, max_attempts,
          created_at"""

PUBLISHED = """\
UPDATE {table} SET status = 'PUBLISHED', published_at = clock_timestamp(), claimed_until = NULL,
                   last_error = NULL
WHERE id = ANY(%s) AND status = 'PENDING'"""

# A message's own failure: back off (delay per row), dead after max_attempts.
FAILED = """\
UPDATE {table} AS o
SET claimed_until = NULL,
    last_error = f.error,
    next_attempt_at = clock_timestamp() + f.delay_ms * interval '1 millisecond',
    status = CASE WHEN o.attempts >= o.max_attempts THEN 'DEAD' ELSE 'PENDING' END
FROM unnest(%s::bigint[], %s::text[], %s::bigint[]) AS f(id, error, delay_ms)
WHERE o.id = f.id AND o.status = 'PENDING'"""

# The broker was down: not the message's fault, so the attempt does not count.
UNCLAIM = """\
UPDATE {table} SET claimed_until = NULL, attempts = greatest(attempts - 1, 0), last_error = %s
WHERE id = ANY(%s) AND status = 'PENDING'"""

PRUNE = """\
DELETE FROM {table} WHERE id IN (
    SELECT id FROM {table}
    WHERE status = 'PUBLISHED' AND published_at < clock_timestamp() - %s * interval '1 millisecond'
    LIMIT %s
)"""

STATS = """\
SELECT count(*) FILTER (WHERE status = 'PENDING'),
       count(*) FILTER (WHERE status = 'PENDING' AND next_attempt_at <= clock_timestamp()),
       count(*) FILTER (WHERE status = 'DEAD'),
       count(*) FILTER (WHERE status = 'PUBLISHED'),
       extract(epoch FROM clock_timestamp() - min(created_at) FILTER (WHERE status = 'PENDING'))
FROM {table}"""

RETRY = """\
UPDATE {table} SET status = 'PENDING', attempts = 0, next_attempt_at = clock_timestamp(),
                   claimed_until = NULL
WHERE id = %s AND status IN ('DEAD', 'PENDING')
RETURNING id"""


@dataclass(frozen=True, slots=True)
class OutboxStatements:
    """Every statement rendered once for one table."""

    enqueue: bytes
    enqueue_named: str
    enqueue_quiet: bytes
    enqueue_quiet_named: str
    claim: bytes
    published: bytes
    failed: bytes
    unclaim: bytes
    prune: bytes
    stats: bytes
    retry: bytes

    @classmethod
    def render(cls, table: sql.Identifier) -> OutboxStatements:
        """Render every statement for ``table``."""
        quoted = table.as_string(None)

        def one(template: str) -> str:
            return template.format(table=quoted)

        return cls(
            enqueue=one(ENQUEUE).encode(),
            enqueue_named=one(ENQUEUE_NAMED),
            enqueue_quiet=one(ENQUEUE_QUIET).encode(),
            enqueue_quiet_named=one(ENQUEUE_QUIET_NAMED),
            claim=one(CLAIM).encode(),
            published=one(PUBLISHED).encode(),
            failed=one(FAILED).encode(),
            unclaim=one(UNCLAIM).encode(),
            prune=one(PRUNE).encode(),
            stats=one(STATS).encode(),
            retry=one(RETRY).encode(),
        )
