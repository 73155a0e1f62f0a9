"""The outbox statements. ``{table}`` is the quoted table; values are always parameters.

The enqueue statements use psycopg's named placeholders (``%(key)s``); :func:`_named` turns them
into SQLAlchemy ``text()`` binds (``:key``), so both paths run the same SQL.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from psycopg import sql

# One statement: the row and, only if it was inserted, a NOTIFY that PostgreSQL delivers at
# commit (and drops on rollback), so a relay wakes exactly when there is something to publish.
#
# job_id (v2) = "sd2-" + SHA-256 hex of "<namespace byte length>:<namespace><key>" (the length
# prefix keeps distinct (namespace, key) pairs apart); only [a-z0-9-], so Node-safe (no ':', not
# all digits). v1 ("sd-" + sha256(key), 0.1.0) stays on the rows written with it: the relay
# publishes the stored id. Without a namespace, the outbox's identity is the namespace: the
# database, the table's real schema (resolved through search_path when the Outbox has none) and
# the table, each quote_ident()-ed so the joined text is unambiguous.
#
# trace_context: the W3C trace context of the enqueuing span (sdcore.tracing), or NULL; not part
# of the message (nor of its digest): the same message enqueued from two traces is one message.
#
# message_digest = SHA-256 of jsonb's canonical text (keys sorted and deduplicated, whitespace
# normalized) of [queue, name, payload, options]: equal messages, as jsonb compares them, have
# equal digests. The migration backfills 0.1.0 rows with the same expression.
ENQUEUE = """\
WITH inserted AS (
    INSERT INTO {table} (idempotency_key, queue, name, job_id, payload, options, max_attempts,
                         message_digest, trace_context)
    SELECT m.key, m.queue, m.name,
           'sd2-' || encode(sha256(convert_to(
               CAST(octet_length(convert_to(m.ns, 'UTF8')) AS text) || ':' || m.ns || m.key,
               'UTF8')), 'hex'),
           m.payload, m.options, m.max_attempts,
           sha256(convert_to(CAST(jsonb_build_array(m.queue, m.name, m.payload, m.options)
                                  AS text), 'UTF8')),
           m.trace_context
    FROM (
        SELECT CAST(%(key)s AS text) AS key, CAST(%(queue)s AS text) AS queue,
               CAST(%(name)s AS text) AS name, CAST(%(payload)s AS jsonb) AS payload,
               CAST(%(options)s AS jsonb) AS options, CAST(%(max)s AS integer) AS max_attempts,
               CAST(%(trace)s AS jsonb) AS trace_context,
               COALESCE(CAST(%(namespace)s AS text), (
                   SELECT quote_ident(current_database()) || '.' || quote_ident(n.nspname)
                          || '.' || quote_ident(c.relname)
                   FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                   WHERE c.oid = CAST(%(target)s AS regclass))) AS ns
    ) AS m
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING id, job_id
)
SELECT id, job_id, pg_notify(CAST(%(channel)s AS text), '') FROM inserted"""

# Without NOTIFY (Outbox(notify=False)): relays find the row by polling.
ENQUEUE_QUIET = ENQUEUE.replace(
    "SELECT id, job_id, pg_notify(CAST(%(channel)s AS text), '') FROM inserted",
    "SELECT id, job_id FROM inserted",
)

# After ON CONFLICT DO NOTHING: is the existing row (or tombstone) the same message? A separate
# statement, so under READ COMMITTED it sees a row another transaction committed meanwhile.
EXISTING = """\
SELECT message_digest = sha256(convert_to(CAST(jsonb_build_array(
           CAST(%(queue)s AS text), CAST(%(name)s AS text), CAST(%(payload)s AS jsonb),
           CAST(%(options)s AS jsonb)) AS text), 'UTF8')),
       queue, name, status, pruned_at IS NOT NULL
FROM {table} WHERE idempotency_key = CAST(%(key)s AS text)"""

# Claim due rows for claim_ms: a short autocommit statement, no transaction held across Redis
# I/O. SKIP LOCKED and the claim time keep concurrent relays off each other's rows; a relay
# that dies leaves its claims to expire. No "id > cursor": a row that commits late is still due.
# The claim token fences the outcome: a relay whose claim was taken over cannot record one.
CLAIM = """\
UPDATE {table} SET claimed_until = clock_timestamp() + %s * interval '1 millisecond',
                   claim_token = %s, attempts = attempts + 1
WHERE id IN (
    SELECT id FROM {table}
    WHERE status = 'PENDING' AND next_attempt_at <= clock_timestamp()
      AND (claimed_until IS NULL OR claimed_until < clock_timestamp())
    ORDER BY next_attempt_at, id
    LIMIT %s
    FOR UPDATE SKIP LOCKED
)
RETURNING id, idempotency_key, queue, name, job_id, payload, options, attempts, max_attempts,
          created_at, trace_context"""

# A delivery is a fact, whoever's claim it was: any relay that published the job may mark the
# row, even one whose claim was taken over, and even a row another relay marked DEAD meanwhile
# (the job is in the broker, so it is not dead).
PUBLISHED = """\
UPDATE {table} SET status = 'PUBLISHED', published_at = clock_timestamp(), claimed_until = NULL,
                   claim_token = NULL, last_error = NULL
WHERE id = ANY(%s) AND status IN ('PENDING', 'DEAD')"""

# A message's own failure: back off (delay per row), dead after max_attempts. Only under the
# claim that made the attempt: if another relay took the row over (and may have delivered it),
# this relay's failure is not the row's outcome.
FAILED = """\
UPDATE {table} AS o
SET claimed_until = NULL,
    claim_token = NULL,
    last_error = f.error,
    next_attempt_at = clock_timestamp() + f.delay_ms * interval '1 millisecond',
    status = CASE WHEN o.attempts >= o.max_attempts THEN 'DEAD' ELSE 'PENDING' END
FROM unnest(%s::bigint[], %s::text[], %s::bigint[]) AS f(id, error, delay_ms)
WHERE o.id = f.id AND o.status = 'PENDING' AND o.claim_token = %s
RETURNING o.id, o.status"""

# The broker was down: not the message's fault, so the attempt does not count.
UNCLAIM = """\
UPDATE {table} SET claimed_until = NULL, claim_token = NULL, attempts = greatest(attempts - 1, 0),
                   last_error = %s
WHERE id = ANY(%s) AND status = 'PENDING' AND claim_token = %s"""

# Pruning, step 1: published rows past the retention become tombstones (payload and options
# dropped; key, digest and job id kept), so the key stays taken for the deduplication window.
TOMBSTONE = """\
UPDATE {table} SET payload = '{}'::jsonb, options = '{}'::jsonb, pruned_at = clock_timestamp()
WHERE id IN (
    SELECT id FROM {table}
    WHERE status = 'PUBLISHED' AND pruned_at IS NULL
      AND published_at < clock_timestamp() - %s * interval '1 millisecond'
    LIMIT %s
)"""

# Step 2: tombstones of messages published before the window are deleted: only then can the
# key be enqueued again (as a new message).
PRUNE = """\
DELETE FROM {table} WHERE id IN (
    SELECT id FROM {table}
    WHERE pruned_at IS NOT NULL
      AND published_at < clock_timestamp() - %s * interval '1 millisecond'
    LIMIT %s
)"""

STATS = """\
SELECT count(*) FILTER (WHERE status = 'PENDING'),
       count(*) FILTER (WHERE status = 'PENDING' AND next_attempt_at <= clock_timestamp()),
       count(*) FILTER (WHERE status = 'DEAD'),
       count(*) FILTER (WHERE status = 'PUBLISHED' AND pruned_at IS NULL),
       extract(epoch FROM clock_timestamp() - min(created_at) FILTER (WHERE status = 'PENDING')),
       count(*) FILTER (WHERE pruned_at IS NOT NULL)
FROM {table}"""

RETRY = """\
UPDATE {table} SET status = 'PENDING', attempts = 0, next_attempt_at = clock_timestamp(),
                   claimed_until = NULL, claim_token = NULL
WHERE id = %s AND status IN ('DEAD', 'PENDING')
RETURNING id"""

_PYFORMAT = re.compile(r"%\((\w+)\)s")


def _named(statement: str) -> str:
    """Turn psycopg's ``%(name)s`` into SQLAlchemy ``text()``'s ``:name``."""
    return _PYFORMAT.sub(r":\1", statement)


@dataclass(frozen=True, slots=True)
class OutboxStatements:
    """Every statement rendered once for one table."""

    enqueue: bytes
    enqueue_named: str
    enqueue_quiet: bytes
    enqueue_quiet_named: str
    existing: bytes
    existing_named: str
    claim: bytes
    published: bytes
    failed: bytes
    unclaim: bytes
    tombstone: bytes
    prune: bytes
    stats: bytes
    retry: bytes

    @classmethod
    def render(cls, table: sql.Identifier) -> OutboxStatements:
        """Render every statement for ``table``."""
        quoted = table.as_string(None)

        def one(template: str) -> str:
            return template.replace("{table}", quoted)

        return cls(
            enqueue=one(ENQUEUE).encode(),
            enqueue_named=_named(one(ENQUEUE)),
            enqueue_quiet=one(ENQUEUE_QUIET).encode(),
            enqueue_quiet_named=_named(one(ENQUEUE_QUIET)),
            existing=one(EXISTING).encode(),
            existing_named=_named(one(EXISTING)),
            claim=one(CLAIM).encode(),
            published=one(PUBLISHED).encode(),
            failed=one(FAILED).encode(),
            unclaim=one(UNCLAIM).encode(),
            tombstone=one(TOMBSTONE).encode(),
            prune=one(PRUNE).encode(),
            stats=one(STATS).encode(),
            retry=one(RETRY).encode(),
        )
