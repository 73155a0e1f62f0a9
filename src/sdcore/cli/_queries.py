"""The CLI's SQL, as SQL. ``{table}`` is the quoted table; every value is a parameter.

Ages and cutoffs come from the database clock (``clock_timestamp()``), the clock the lease itself
uses, never from the machine running the CLI.
"""

from __future__ import annotations

from psycopg import sql

# Resolution exactly as a query would do it (search_path included); NULL when missing.
TABLE_OID = "SELECT to_regclass(%s)::oid"
SCHEMA_EXISTS = "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = %s)"
INDEX_COUNT = "SELECT count(*) FROM pg_index WHERE indrelid = %s::oid"
SCHEMA_LOCK = "SELECT pg_advisory_lock(%s)"
SCHEMA_UNLOCK = "SELECT pg_advisory_unlock(%s)"

# One clock reading for the whole listing, so ages of different rows compare.
LIST = """\
WITH clock AS MATERIALIZED (SELECT clock_timestamp() AS now)
SELECT j.id::text AS id, j.code, j.name, j.type, j.run_key, j.status, j.fencing_token,
       j.lock_key, j.idempotency_key, j.data, j.created_at, j.modified_at,
       greatest(clock.now - j.modified_at, interval '0') AS age
FROM {table} AS j CROSS JOIN clock
WHERE {conditions}
ORDER BY j.created_at DESC, j.id DESC
LIMIT %(limit)s"""
LIST_BY_CODE = "j.code = %(code)s"
LIST_BY_STATUS = "j.status = %(status)s"
LIST_ALL = "TRUE"

# The heartbeat and finalize statements require status = 'RUNNING' and the owner's token, so the
# owner learns of the release at its next heartbeat; FAIL lets the next acquire take the row.
RELEASE = """\
UPDATE {table}
SET status = 'FAIL',
    data = jsonb_build_object('released_by', 'operator', 'reason', %(reason)s::text),
    modified_at = clock_timestamp()
WHERE id = %(id)s::uuid AND status = 'RUNNING'
RETURNING code, type, run_key, fencing_token"""

STATUS_OF = "SELECT status FROM {table} WHERE id = %(id)s::uuid"

PRUNE_CUTOFF = "SELECT clock_timestamp() - %(older_than)s::interval"

PRUNE_COUNT = """\
SELECT count(*) FILTER (WHERE %(include_initial)s OR type <> 'INITIAL'),
       count(*) FILTER (WHERE NOT %(include_initial)s AND type = 'INITIAL')
FROM {table}
WHERE status <> 'RUNNING' AND status = ANY(%(statuses)s::text[]) AND modified_at < %(cutoff)s"""

# A row an acquire is taking over right now is locked: SKIP LOCKED passes it by instead of
# waiting. A takeover that committed after our snapshot (FAIL -> RUNNING, fresh modified_at) is
# re-checked by FOR UPDATE on the newest row version, and the predicate is repeated outside the
# subquery so the DELETE itself never removes a row that stopped matching. RUNNING never matches.
PRUNE_BATCH = """\
DELETE FROM {table}
WHERE id IN (
        SELECT id FROM {table}
        WHERE status <> 'RUNNING' AND status = ANY(%(statuses)s::text[])
          AND modified_at < %(cutoff)s
          AND (%(include_initial)s OR type <> 'INITIAL')
        ORDER BY modified_at
        LIMIT %(batch)s
        FOR UPDATE SKIP LOCKED
    )
  AND status <> 'RUNNING' AND status = ANY(%(statuses)s::text[])
  AND modified_at < %(cutoff)s
  AND (%(include_initial)s OR type <> 'INITIAL')"""


def render(template: str, table: sql.Identifier, **fragments: str) -> sql.Composed:
    """Fill ``{table}`` and fixed SQL fragments into a statement; values stay parameters."""
    return sql.SQL(template).format(
        table=table, **{name: sql.SQL(text) for name, text in fragments.items()}
    )
