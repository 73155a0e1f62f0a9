-- Operator statements on the lease table (sdcore.job_scheduler.LeaseAdmin; the CLI calls it).
-- {table} is the quoted table, {conditions} a fixed fragment chosen in code; values are
-- parameters. Ages and cutoffs come from the database clock (clock_timestamp()), the clock the
-- lease itself uses, never from the machine running the command.

-- name: list_runs
-- One clock reading for the whole listing, so ages of different rows compare.
WITH clock AS MATERIALIZED (SELECT clock_timestamp() AS now)
SELECT j.id::text AS id, j.code, j.name, j.type, j.run_key, j.status, j.fencing_token,
       j.lock_key, j.idempotency_key, j.data, j.created_at, j.modified_at,
       greatest(clock.now - j.modified_at, interval '0') AS age
FROM {table} AS j CROSS JOIN clock
WHERE {conditions}
ORDER BY j.created_at DESC, j.id DESC
LIMIT %(limit)s

-- name: release
-- The heartbeat and finalize statements require status = 'RUNNING' and the owner's token, so the
-- owner learns of the release at its next heartbeat; FAIL lets the next acquire take the row.
UPDATE {table}
SET status = 'FAIL',
    data = jsonb_build_object('released_by', 'operator', 'reason', %(reason)s::text),
    released = 'operator',
    given_back = NULL,
    modified_at = clock_timestamp()
WHERE id = %(id)s::uuid AND status NOT IN ('SUCCESS', 'FAIL')  -- RUNNING (see lease.sql heartbeat)
RETURNING code, type, run_key, fencing_token

-- name: status_of
SELECT status FROM {table} WHERE id = %(id)s::uuid

-- name: prune_cutoff
SELECT clock_timestamp() - %(older_than)s::interval

-- name: prune_count
-- On the created_at index: a row's modified_at is never before its created_at.
SELECT count(*) FILTER (WHERE %(include_initial)s OR type <> 'INITIAL'),
       count(*) FILTER (WHERE NOT %(include_initial)s AND type = 'INITIAL')
FROM {table}
WHERE created_at < %(cutoff)s AND modified_at < %(cutoff)s AND status = ANY(%(statuses)s)

-- name: prune_batch
-- Keyset batches on the created_at index (migration lease/0004; created_at never changes, so the
-- index costs complete and heartbeat nothing: they stay HOT updates). Each batch starts where the
-- last one ended (created_at >= %(after)s), so it never walks the dead index entries that earlier
-- batches left at the front; rows that do not qualify (RUNNING, modified recently, INITIAL) are
-- walked past once. A row an acquire is taking over right now is locked: SKIP LOCKED passes it by
-- instead of waiting. A takeover that committed after our snapshot (FAIL -> RUNNING, fresh
-- modified_at) is re-checked by FOR UPDATE on the newest row version, and the predicate is
-- repeated on the DELETE so it never removes a row that stopped matching. The picked ids are a
-- MATERIALIZED CTE: as "id IN (SELECT … LIMIT … SKIP LOCKED)" the planner may re-run the
-- subquery per row, each run skipping the rows the previous ones locked, so a "batch" could
-- delete more rows than its limit (PostgreSQL 15 does; tests/integration/test_lease_admin.py).
WITH picked AS MATERIALIZED (
    SELECT id FROM {table}
    WHERE created_at < %(cutoff)s
      AND created_at >= %(after)s
      AND modified_at < %(cutoff)s
      AND status = ANY(%(statuses)s)
      AND (%(include_initial)s OR type <> 'INITIAL')
    ORDER BY created_at
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
), deleted AS (
    DELETE FROM {table} AS j
    USING picked
    WHERE j.id = picked.id
      AND j.status = ANY(%(statuses)s)
      AND j.modified_at < %(cutoff)s
      AND (%(include_initial)s OR j.type <> 'INITIAL')
    RETURNING j.created_at
)
SELECT count(*), max(created_at) FROM deleted

-- name: has_schedule_runs
SELECT EXISTS (SELECT 1 FROM {table} WHERE code = %(code)s AND type = 'SCHEDULE')
